"""Layout equivalence: tp x dp in {1,2,4} x {1,2} against a single-process reference.

The reference is the tp=1 model in one process, trained with `torch.nn.functional.cross_entropy`,
`torch.nn.utils.clip_grad_norm_` and `torch.optim.AdamW` -- none of which kltron's distributed path
uses. Each layout runs the same global batch (each DP rank a different half, with ignored targets
spread unevenly so the per-rank token counts differ), FSDP2 over dp, kltron's vocab-parallel cross
entropy inside forward through the `head=` callback, `core.optim` clipping and AdamW. Compared,
within atol=rtol=1e-5 in fp32: this rank's logits shard, the global loss, every gradient (this
rank's TP-local gradient, gathered over FSDP, against the reference's full gradient sliced by
`core.model.local_shard`), the global gradient norm at every step, and every parameter after 3
steps with clipping engaged.

Variants: vocab 131 (uneven, padded), untied, no bias; vocab 128, tied embeddings, qkv bias,
activation checkpointing. n_kv_heads=2, so tp=4 replicates KV heads over rank pairs.

The functions here also run under NCCL on GPUs (tests/gpu/layout_nccl.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.config import ModelConfig, OptimConfig
from core.model import build_model, local_shard
from core.optim import build_optimizer
from core.shards import tp_slice
from parallel.comm import all_reduce
from parallel.dims import ParallelDims, init_parallel, kv_replica_group
from parallel.fsdp import FSDPOptions, full_tensor, is_fsdp, parallelize, sync_replicated_grads
from parallel.layers import vocab_parallel_logits
from tests.helpers import SEED, STEPS, VARIANTS, B, global_batch, model_config

OPTIM = OptimConfig(lr=1e-3, min_lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6, warmup_steps=0,
                    schedule="constant", grad_clip=0.05, skip_nonfinite=True)
TOL = dict(atol=1e-5, rtol=1e-5)


def _full(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A reference (tp=1) tensor without its vocabulary padding: the layout-independent full tensor."""
    return t[:cfg.vocab_size] if name in ("embed.weight", "lm_head.weight") else t


def _to(v, device):
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, dict):
        return {k: _to(x, device) for k, x in v.items()}
    return v


def reference_run(cfg: ModelConfig, device) -> dict:
    """Single process, plain torch: logits, loss, grads and norm at step 1; norms and params after."""
    model = build_model(cfg, seed=SEED, device=device)
    ids, tgt = global_batch(cfg, device)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": OPTIM.weight_decay},
         {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}],
        lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, foreach=False)
    out = {"norms": []}
    for step in range(STEPS):
        logits = model(ids)[..., :cfg.vocab_size]  # (B, S, V)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tgt.reshape(-1), ignore_index=-100)
        loss.backward()
        if step == 0:
            out["logits"], out["loss"] = logits.detach(), loss.detach()
            out["grads"] = {n: _full(n, p.grad, cfg).clone() for n, p in params.items()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip).item())
        opt.step()
        opt.zero_grad()
    out["params"] = {n: _full(n, p.detach(), cfg).clone() for n, p in params.items()}
    return out


def layout_run(dp: int, tp: int, variant: str, ref: dict | None = None, device=None, fsdp: bool = True,
               sp: bool = False) -> list[float]:
    """Run the layout on this rank and compare with `ref` (`reference_run`, computed here when
    None); raises on a mismatch. Returns the grad norm of every step. `fsdp=False`: plain data
    parallel (gradients all-reduced, replicated over dp). `sp`: sequence parallelism inside TP."""
    cfg = model_config(variant)
    state = init_parallel(ParallelDims(dp, tp), device, cfg.n_heads, cfg.n_kv_heads)
    device = state.device
    if ref is None:
        ref = reference_run(cfg, device)
    ref = {k: _to(v, device) for k, v in ref.items()}
    kv_group = kv_replica_group(state, cfg.n_kv_heads)
    model = build_model(cfg, state.tp_group, kv_group, seed=SEED, device=device)
    model = parallelize(model, state.dp_mesh, FSDPOptions(fsdp=fsdp, activation_checkpointing=VARIANTS[variant]["ac"]))
    model.sequence_parallel = sp
    assert is_fsdp(model) == (dp > 1 and fsdp)
    opt = build_optimizer(model, OPTIM, cfg, STEPS, state.tp_group, state.dp_group)

    from parallel.vocab import vocab_parallel_cross_entropy

    ids, tgt = global_batch(cfg, device)
    rows = slice(state.dp_rank * B // dp, (state.dp_rank + 1) * B // dp)
    ids, tgt = ids[rows], tgt[rows]  # this DP rank's half of the global batch
    n_tokens = (tgt != -100).sum().to(torch.float32).reshape(1)
    all_reduce(n_tokens, "sum", state.dp_group)  # global target count: the loss is the global mean

    def head(hidden, weight_local):
        logits_local = vocab_parallel_logits(hidden, weight_local, state.tp_group)  # (B/dp, S, Vp/tp)
        return logits_local, vocab_parallel_cross_entropy(logits_local, tgt, state.tp_group,
                                                          vocab_size=cfg.vocab_size)

    vs = tp_slice("embed.weight", cfg, state.tp_rank, tp)  # this rank's vocabulary columns
    norms = []
    for step in range(STEPS):
        logits_local, loss_tok = model(ids, head=head)
        loss = loss_tok.sum() / n_tokens
        loss.backward()
        sync_replicated_grads(model, state.dp_group)
        if step == 0:
            torch.testing.assert_close(logits_local[..., :vs.stop - vs.start], ref["logits"][rows, :, vs.start:vs.stop],
                                       **TOL, msg=lambda m: f"logits: {m}")
            assert torch.all(logits_local[..., vs.stop - vs.start:] == 0), "padded vocabulary columns"
            total = loss.detach().clone()
            all_reduce(total, "sum", state.dp_group)  # each dp rank holds its share of the global mean
            torch.testing.assert_close(total.reshape(()), ref["loss"], **TOL, msg=lambda m: f"loss: {m}")
            for name, p in model.named_parameters():
                want = local_shard(ref["grads"][name], name, cfg, state.tp_rank, tp)
                torch.testing.assert_close(full_tensor(p.grad), want, **TOL, msg=lambda m, n=name: f"grad {n}: {m}")
        stats = opt.step()
        assert not stats.skipped
        norms.append(stats.grad_norm)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref["norms"]), **TOL,
                               msg=lambda m: f"grad norms {norms} vs {ref['norms']}: {m}")
    assert min(ref["norms"]) > OPTIM.grad_clip, "clipping must engage"
    for name, p in model.named_parameters():
        want = local_shard(ref["params"][name], name, cfg, state.tp_rank, tp)
        torch.testing.assert_close(full_tensor(p.detach()), want, **TOL,
                                   msg=lambda m, n=name: f"param {n} after {STEPS} steps: {m}")
    return norms


LAYOUTS = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (2, 4)]
_REFERENCES: dict[str, dict] = {}


def _reference(variant: str) -> dict:
    """Computed once per variant in the test process and handed to every rank."""
    if variant not in _REFERENCES:
        _REFERENCES[variant] = reference_run(model_config(variant), torch.device("cpu"))
    return _REFERENCES[variant]


@pytest.mark.parametrize("dp,tp", [pytest.param(d, t, id=f"dp{d}_tp{t}", marks=[pytest.mark.slow] if d * t > 2 else [])
                                   for d, t in LAYOUTS])
def test_layout_matches_single_process(dist_pools, dp, tp):
    for variant in VARIANTS:
        if dp * tp == 1:
            norms = [layout_run(1, 1, variant, _reference(variant))]
        else:
            norms = dist_pools.run(dp * tp, layout_run, dp, tp, variant, _reference(variant))
        assert all(n == norms[0] for n in norms), f"ranks disagree on the grad norm: {norms}"


def test_plain_data_parallel_without_fsdp(dist_pools):
    """parallel.fsdp=False with dp=2: gradients all-reduced and counted once in the norm."""
    variant = "v131_untied"
    dist_pools.run(2, layout_run, 2, 1, variant, _reference(variant), None, False)


@pytest.mark.parametrize("dp,tp,fsdp", [
    pytest.param(1, 2, True, id="dp1_tp2", marks=pytest.mark.slow),
    pytest.param(2, 2, True, id="dp2_tp2_fsdp", marks=pytest.mark.slow),
    pytest.param(2, 2, False, id="dp2_tp2_no_fsdp", marks=pytest.mark.slow),
    pytest.param(1, 4, True, id="dp1_tp4_kv_replicas", marks=pytest.mark.slow)])
def test_sequence_parallel_layout_matches_single_process(dist_pools, dp, tp, fsdp):
    """parallel.sequence_parallel: the RMSNorm weights' partial gradients summed over tp with FSDP2 and
    without (3 clipped AdamW steps; activation checkpointing in the second variant); at tp=4 the KV heads
    are replicated over rank pairs (their gradients summed inside the gathered q/k/v node's inputs)."""
    for variant in VARIANTS:
        norms = dist_pools.run(dp * tp, layout_run, dp, tp, variant, _reference(variant), None, fsdp, True)
        assert all(n == norms[0] for n in norms), f"ranks disagree on the grad norm: {norms}"


# ---------------------------------------------------------------------------------------------
# bf16 mixed precision, CPU offload and the frozen sharded copy (dp=2, FSDP2)


def _bf16_offload_frozen(variant: str, ref: dict) -> dict:
    cfg = model_config(variant)
    state = init_parallel(ParallelDims(2, 1), "cpu", cfg.n_heads, cfg.n_kv_heads)
    ids, tgt = global_batch(cfg, "cpu")
    rows = slice(state.dp_rank * B // 2, (state.dp_rank + 1) * B // 2)
    out = {}
    for name, opts in (("bf16", FSDPOptions(mixed_precision="bf16")), ("offload", FSDPOptions(cpu_offload=True))):
        model = parallelize(build_model(cfg, seed=SEED), state.dp_mesh, opts)
        logits = model(ids[rows])[..., :cfg.vocab_size]
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), tgt[rows].reshape(-1), ignore_index=-100)
        loss.backward()
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
        tol = dict(atol=3e-2, rtol=3e-2) if name == "bf16" else TOL  # bf16 keeps ~3 significant digits
        if name == "bf16":
            assert logits.dtype == torch.bfloat16
        torch.testing.assert_close(logits.float(), ref["logits"][rows], **tol, msg=lambda m, n=name: f"{n} logits: {m}")
        out[name] = float(loss)

    # frozen copy: same outputs as the policy, no grad, eval, sharded over dp
    from parallel.fsdp import frozen_sharded_copy

    policy = build_model(cfg, seed=SEED)
    refm = frozen_sharded_copy(policy, state.dp_mesh)
    assert is_fsdp(refm) and not refm.training
    assert all(not p.requires_grad for p in refm.parameters())
    assert all(p.requires_grad for p in policy.parameters()), "the policy must stay trainable"
    shard = dict(refm.named_parameters())["layers.0.mlp.w_up.weight"]
    assert shard.to_local().shape[0] == cfg.intermediate_size // 2, "parameters are sharded over dp"
    with torch.no_grad():
        torch.testing.assert_close(refm(ids[rows])[..., :cfg.vocab_size], ref["logits"][rows], **TOL)
    return out


def test_bf16_offload_and_frozen_copy(dist_pools):
    variant = "v131_untied"
    ref = _reference(variant)
    out = dist_pools.run(2, _bf16_offload_frozen, variant, ref)
    assert out[0]["bf16"] != out[0]["offload"], "bf16 must actually compute in bf16"
