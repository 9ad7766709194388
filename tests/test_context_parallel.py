"""Context parallelism (parallel/context*.py) against a single process.

Attention level: Ulysses and ring attention of each rank's load-balanced tokens, and their
gradients, against `torch.nn.functional.scaled_dot_product_attention` over the whole sequence in
float64 (causal, and under a document mask with a shared prefix) -- within 1e-10.

Model level: a tiny Llama under cp x tp (FSDP2 over the cp ranks), each rank running only its own
tokens, the fused KL head on them (log-probs, entropy, exact KL against a second model's hidden
states) and a GRPO-style per-token loss normalised by the global token count; against the tp=1
model in one process: this rank's logits shard, the per-token values, the loss (summed over
ranks) and every parameter's gradient. float64 within 1e-10, float32 within 1e-5. The labels are
shifted over the whole sequence before sharding, so a chunk's last token predicts the first token
of the next chunk, wherever it lives.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.config import ModelConfig
from core.model import build_model, local_shard
from core.shards import tp_slice
from parallel.comm import all_reduce, copy_to_tp, count_comm
from parallel.context import ContextParallel, balanced_index, check_context, padded_len
from parallel.dims import LayoutError, ParallelDims, init_parallel, kv_replica_group
from parallel.fsdp import FSDPOptions, full_tensor, parallelize
from parallel.fused import fused_head
from parallel.fused_loss import fused_head_loss

SEED = 5


def _qkv(B, nh, nkv, S, d, dtype):
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(B, h, S, d, generator=g, dtype=dtype) for h in (nh, nkv, nkv, nh))
    return q, k, v, do


def _docs(B, S):
    """Two rows of packed documents (runs of ids) whose document 0 is every token's prefix in row 1."""
    doc = torch.zeros(B, S, dtype=torch.long)
    cuts = [S // 3, S // 2 + 1, S - 3]
    for c in cuts:
        doc[:, c:] += 1
    pre = doc.clone()
    pre[1] = 0  # row 1: every token also sees document 0 (a shared prompt)
    return doc, pre


def _sdpa(q, k, v, doc=None, pre=None):
    S = q.shape[2]
    if doc is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    pos = torch.arange(S, device=q.device)
    mask = (pos[None, :] <= pos[:, None])[None] & ((doc[:, None, :] == doc[:, :, None]) |
                                                    (doc[:, None, :] == pre[:, :, None]))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=q.shape[1] != k.shape[1])


def attention_run(cp: int, impl: str, nh: int, nkv: int, docs: bool, dtype=torch.float64, S: int = 24,
                  math: bool = False, device="cpu"):
    """`math`: the ring's math kernel for every block (what CUDA runs), not the CPU flash kernel. `device`:
    where the attention runs (tests/gpu/cp_check.py: CUDA under NCCL); the reference runs there too."""
    import parallel.context_ring as ring

    flash, elems = ring._flash, ring.TILE_ELEMS
    if math:  # and tiles of 16 query rows
        ring._flash, ring.TILE_ELEMS = (lambda q, mask: False), 256
    try:
        return _attention_run(cp, impl, nh, nkv, docs, dtype, S, torch.device(device))
    finally:
        ring._flash, ring.TILE_ELEMS = flash, elems


def _attention_run(cp, impl, nh, nkv, docs, dtype, S, device):
    state = init_parallel(ParallelDims(1, 1, cp), device)
    ctx = ContextParallel(state.cp_group, impl)
    B, d = 2, 8
    q, k, v, do = (t.to(device) for t in _qkv(B, nh, nkv, S, d, dtype))
    doc, pre = (t.to(device) for t in _docs(B, S)) if docs else (None, None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _sdpa(*leaves, doc, pre)
    ref.backward(do)
    loc = [ctx.shard(t, 2).detach().requires_grad_() for t in (q, k, v)]
    att = ctx.attention(S // cp, None if doc is None else ctx.shard(doc), None if pre is None else ctx.shard(pre))
    out = att.attend(*loc)
    out.backward(ctx.shard(do, 2))
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ctx.shard(ref.detach(), 2), **tol, msg=lambda m: f"{impl} output: {m}")
    for name, a, b in zip("qkv", loc, leaves):
        torch.testing.assert_close(a.grad, ctx.shard(b.grad, 2), **tol, msg=lambda m, n=name: f"{impl} d{n}: {m}")
    return True


def test_load_balance_layout():
    """Rank r holds chunk r and chunk 2cp-1-r; together the ranks hold every index once."""
    assert balanced_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert balanced_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 4):
        every = torch.cat([balanced_index(16, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(16))
    assert padded_len(13, 2) == 16 and padded_len(16, 4) == 16
    with pytest.raises(ValueError, match="multiple of 2"):
        balanced_index(10, 2, 0)


def test_layout_errors_name_the_numbers():
    with pytest.raises(LayoutError, match=r"dp=1 \* cp=2 \* tp=2 = 4, but the world size is 2"):
        ParallelDims(1, 2, 2).validate(2)
    with pytest.raises(LayoutError, match="parallel.cp must be a positive"):
        ParallelDims(1, 1, 0).validate()
    with pytest.raises(LayoutError, match=r"n_heads=6 / tp=2 = 3 heads per rank, not divisible by cp=2"):
        check_context(2, "ulysses", 2, 6, 2)
    with pytest.raises(LayoutError, match="cp_impl must be one of"):
        check_context(2, "stripe")
    check_context(2, "ring", 2, 6, 2)  # the ring takes any head count


@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_attention_cp2_float64(dist_pools, impl):
    dist_pools.run(2, attention_run, 2, impl, 4, 2, False)
    dist_pools.run(2, attention_run, 2, impl, 4, 1, False)  # ulysses: one KV head replicated over cp=2


def test_ring_math_kernel_float64(dist_pools):
    """The ring's own kernel (the one CUDA runs): causal diagonal blocks and tiles of a few query rows."""
    import parallel.context_ring as ring

    assert ring._tile(4096) == 16 and ring._tile(64) == ring.TILE_ELEMS // 64
    dist_pools.run(2, attention_run, 2, "ring", 4, 2, False, torch.float64, 24, True)
    dist_pools.run(2, attention_run, 2, "ring", 4, 1, False, torch.float64, 200, True)  # 4 tiles per block


@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_attention_documents_float64(dist_pools, impl):
    """Packed documents and a shared prefix across chunk boundaries: masked by global position."""
    dist_pools.run(2, attention_run, 2, impl, 4, 2, True)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_attention_cp4(dist_pools, impl):
    dist_pools.run(4, attention_run, 4, impl, 4, 2, False)
    dist_pools.run(4, attention_run, 4, impl, 4, 2, True)
    dist_pools.run(4, attention_run, 4, impl, 8, 2, False, torch.float32)


# ---------------------------------------------------------------------------------------------
# the model with the fused head under cp x tp

CFG = dict(vocab_size=131, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
           max_seq_len=64, tie_embeddings=False, qkv_bias=True)
B, S = 2, 21  # S not a multiple of 2*cp: the tail is padded


def _batch(cfg: ModelConfig):
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    tgt = torch.full((B, S), -1, dtype=torch.long)
    tgt[:, :-1] = ids[:, 1:]  # the causal label shift, over the whole sequence, before any sharding
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[0, 6:-1] = True  # a response after a prompt of 7 tokens
    mask[1, 3:14] = True
    adv = torch.randn(B, S, generator=g, dtype=torch.float64)
    old = -3.0 - torch.rand(B, S, generator=g, dtype=torch.float64)
    return ids, tgt, mask, adv, old


def _grpo_loss(adv, old, w, beta=0.1, ent=0.01):
    """A clipped GRPO-style per-token loss with an exact-KL penalty and an entropy bonus (flat tensors)."""
    def token_loss(logp, entropy, kl, tokens):
        ratio = torch.exp(logp - old[tokens].to(logp.dtype))
        a = adv[tokens].to(logp.dtype)
        pg = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
        return w[tokens].to(logp.dtype) * (pg + beta * kl - ent * entropy)
    return token_loss


def reference_model_run(dtype) -> dict:
    cfg = ModelConfig(**CFG)
    pol = build_model(cfg, seed=SEED, dtype=dtype)
    ref = build_model(cfg, seed=SEED + 1, dtype=dtype)
    ids, tgt, mask, adv, old = _batch(cfg)
    with torch.no_grad():
        ref_h, ref_w = ref(ids, head=lambda h, w: (h.clone(), w.clone()))
    logits = pol(ids).detach()
    w = mask.to(torch.float64) / mask.sum()
    m = mask.reshape(-1)

    def head(h, wt):
        return fused_head_loss(h.reshape(-1, h.shape[-1]), wt, tgt.reshape(-1).clamp(min=0),
                               token_loss=_grpo_loss(adv.reshape(-1), old.reshape(-1), w.reshape(-1)),
                               vocab_size=cfg.vocab_size, ref_hidden=ref_h.reshape(-1, ref_h.shape[-1]),
                               ref_weight_local=ref_w, kl="forward", entropy=True, mask=m)
    loss, out = pol(ids, head=head)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in pol.named_parameters()}
    grads = {n: g[:cfg.vocab_size] if n in ("embed.weight", "lm_head.weight") else g for n, g in grads.items()}
    return dict(logits=logits[..., :cfg.vocab_size], loss=loss.detach(), logprobs=out.logprobs.view(B, S),
                entropy=out.entropy.view(B, S), kl=out.kl.view(B, S), grads=grads)


def model_run(cp: int, tp: int, impl: str, ref: dict, dtype=torch.float64, fsdp: bool = True, device="cpu",
              ac: bool = False, sp: bool = False):
    cfg = ModelConfig(**CFG)
    device = torch.device(device)
    state = init_parallel(ParallelDims(1, tp, cp), device, cfg.n_heads, cfg.n_kv_heads)
    ctx = ContextParallel(state.cp_group, impl, tp if sp else 1)  # SP: each rank's tokens split over tp
    kv = kv_replica_group(state, cfg.n_kv_heads)
    pol = build_model(cfg, state.tp_group, kv, seed=SEED, dtype=dtype, device=device)
    refm = build_model(cfg, state.tp_group, kv, seed=SEED + 1, dtype=dtype, device=device)
    pol.sequence_parallel = refm.sequence_parallel = sp
    pol = parallelize(pol, state.dp_mesh, FSDPOptions(fsdp=fsdp, activation_checkpointing=ac))
    ids, tgt, mask, adv, old = (t.to(device) for t in _batch(cfg))
    ref = {k: (v.to(device) if isinstance(v, torch.Tensor) else {n: g.to(device) for n, g in v.items()})
           for k, v in ref.items()}
    pos = torch.arange(S, device=device).expand(B, S)
    sh = lambda t, pad=0: ctx.shard(t, 1, pad)
    ids_l, pos_l, tgt_l, mask_l, adv_l, old_l = sh(ids), sh(pos), sh(tgt, -1), sh(mask, False), sh(adv), sh(old)
    n = mask_l.sum().to(torch.float64).reshape(1)
    all_reduce(n, "sum", state.grad_group)  # the global token count over dp x cp
    w_l = mask_l.to(torch.float64) / n
    with torch.no_grad():
        ref_h, ref_w = refm(ids_l, position_ids=pos_l, context=ctx, head=lambda h, w: (h.clone(), w.clone()))
    logits = pol(ids_l, position_ids=pos_l, context=ctx).detach()
    m = mask_l.reshape(-1)

    def head(h, wt):
        H = h.shape[-1]
        return fused_head_loss(copy_to_tp(h.reshape(-1, H), state.tp_group), wt, tgt_l.reshape(-1).clamp(min=0),
                               state.tp_group, token_loss=_grpo_loss(adv_l.reshape(-1), old_l.reshape(-1),
                                                                     w_l.reshape(-1)),
                               vocab_size=cfg.vocab_size, ref_hidden=ref_h.reshape(-1, H), ref_weight_local=ref_w,
                               kl="forward", entropy=True, mask=m)
    with count_comm() as comm:
        loss, out = pol(ids_l, position_ids=pos_l, context=ctx, head=head)
    assert ("reduce_scatter:sum" in comm.by_kind()) == (sp and tp > 1), comm.by_kind()  # SP ran, or did not
    loss.backward()
    if not fsdp:
        from parallel.fsdp import sync_replicated_grads
        sync_replicated_grads(pol, state.grad_group)
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    vs = tp_slice("embed.weight", cfg, state.tp_rank, tp)
    real = (ctx.global_index(padded_len(S, cp, ctx.multiple), device) < S)  # this rank's tokens, not the padding
    want = lambda t: ctx.shard(t.to(dtype), 1)[:, real]
    torch.testing.assert_close(logits[:, real, :vs.stop - vs.start], want(ref["logits"])[..., vs.start:vs.stop],
                               **tol, msg=lambda msg: f"logits: {msg}")
    for name in ("logprobs", "entropy", "kl"):
        got = getattr(out, name).view(B, -1)[:, real] * mask_l[:, real]
        torch.testing.assert_close(got, want(ref[name]) * want(mask), **tol, msg=lambda msg, k=name: f"{k}: {msg}")
    total = loss.detach().clone().reshape(1)
    all_reduce(total, "sum", state.cp_group)
    torch.testing.assert_close(total.reshape(()), ref["loss"].to(dtype), **tol, msg=lambda msg: f"loss: {msg}")
    for name, p in pol.named_parameters():
        g = local_shard(ref["grads"][name].to(dtype), name, cfg, state.tp_rank, tp)
        torch.testing.assert_close(full_tensor(p.grad), g, **tol, msg=lambda msg, k=name: f"grad {k}: {msg}")
    return float(total)


_REFS: dict = {}


def _ref(dtype):
    if dtype not in _REFS:
        _REFS[dtype] = reference_model_run(dtype)
    return _REFS[dtype]


@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_model_cp2_float64(dist_pools, impl):
    dist_pools.run(2, model_run, 2, 1, impl, _ref(torch.float64))


def test_model_cp2_without_fsdp(dist_pools):
    """Replicated parameters: the gradients summed over the cp ranks by one all-reduce each."""
    dist_pools.run(2, model_run, 2, 1, "ring", _ref(torch.float64), torch.float64, False)


@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_model_cp2_activation_checkpointing(dist_pools, impl):
    """Each block recomputed in backward: the recomputation re-issues the ring's exchanges / the all-to-alls
    in the same order on every rank."""
    dist_pools.run(2, model_run, 2, 1, impl, _ref(torch.float64), torch.float64, True, "cpu", True)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_model_cp2_tp2_float64(dist_pools, impl):
    dist_pools.run(4, model_run, 2, 2, impl, _ref(torch.float64))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_model_cp2_tp2_sequence_parallel_float64(dist_pools, impl):
    """Megatron SP inside TP under CP: each cp rank's tokens split again over tp between the column/row pairs
    (the sequence padded to a multiple of 2 * cp * tp); the same logits, values, loss and gradients."""
    dist_pools.run(4, model_run, 2, 2, impl, _ref(torch.float64), torch.float64, True, "cpu", False, True)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_model_cp4_float64(dist_pools, impl):
    dist_pools.run(4, model_run, 4, 1, impl, _ref(torch.float64))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_model_cp2_float32(dist_pools, impl):
    dist_pools.run(2, model_run, 2, 1, impl, _ref(torch.float32), torch.float32)


def test_fused_head_matches_on_local_tokens():
    """Sanity of the reference itself: fused_head's log-probs equal log_softmax of the plain logits."""
    cfg = ModelConfig(**CFG)
    pol = build_model(cfg, seed=SEED, dtype=torch.float64)
    ids, tgt, mask, _, _ = _batch(cfg)
    logits = pol(ids)[..., :cfg.vocab_size]
    lp = torch.log_softmax(logits, -1).gather(-1, tgt.clamp(min=0)[..., None])[..., 0]
    out = pol(ids, head=lambda h, w: fused_head(h.reshape(-1, h.shape[-1]), w, tgt.reshape(-1).clamp(min=0),
                                                vocab_size=cfg.vocab_size, entropy=False))
    torch.testing.assert_close(out.logprobs.view(B, S)[mask], lp[mask], atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# a whole RL step under cp=2 against cp=1 in one process

RL_MODEL = dict(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                max_seq_len=64)
RL_BASE = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=9", "train.steps=2",
           "reward.use_task_reward=false", "reward.fns=[tests.reward_plugins:digits_over_9]",
           "optim.lr=1e-2", "optim.warmup_steps=0", "optim.grad_clip=0.5", "kl_ctl.beta=0.1",
           "train.progress=false", "optim.eps=1e-6", "algo.name=grpo", "loss.entropy_coef=0.01"]
# the exact KL in the loss (reference hidden states across the cp ranks), two mini-batches and two epochs (the
# old-log-prob pass, then the first mini-batch's old values from the update); k3 in the reward, padded rows
RL_VARIANTS = {
    "exact": ["kl.exact=true", "algo.mini_batches=2", "algo.epochs=2"],
    "k3_packed": ["kl.estimator=k3+", "algo.old_from_update=false", "algo.micro_batch_tokens=64",
                  "algo.pack_sequences=true"],
    "shared": ["kl.exact=true", "algo.share_prompts=true"],
}
RL_KEYS = ("reward_mean", "kl_mean", "kl_p50", "kl_p90", "kl_max", "pg_loss", "grad_norm", "entropy", "ratio_mean",
           "clipfrac", "logp_drift")


def rl_steps(cp: int, impl: str, overrides: list[str], tp: int = 1) -> tuple[list[dict], torch.Tensor]:
    """Two float64 RL steps at cp x tp (dp = 1): each step's metrics and the policy's logits of a fixed batch."""
    from core.config import load_config
    from core.tokenizer import load_tokenizer
    from parallel.comm import gather_from_tp
    from rl.config import RLConfig
    from rl.train import assemble

    cfg = load_config(RLConfig, None, RL_BASE + [f"parallel.cp={cp}", f"parallel.cp_impl={impl}", f"parallel.tp={tp}"]
                      + overrides)
    mc = ModelConfig(**RL_MODEL)
    state = init_parallel(ParallelDims(1, tp, cp), "cpu", mc.n_heads, mc.n_kv_heads)
    kv = kv_replica_group(state, mc.n_kv_heads)
    policy = build_model(mc, state.tp_group, kv, seed=11, dtype=torch.float64)
    ref = build_model(mc, state.tp_group, kv, seed=11, dtype=torch.float64)
    trainer = assemble(cfg, state, mc, load_tokenizer(None), policy, ref)
    recs = [trainer.step(s) for s in range(2)]
    ids = torch.arange(3, 3 + 2 * 12).view(2, 12) % 250 + 3
    trainer.policy.context_parallel = None  # a plain forward of the trained weights (gathered by FSDP)
    trainer.policy.sequence_parallel = False
    with torch.no_grad():
        logits = gather_from_tp(trainer.policy(ids), state.tp_group)[..., :256]
    return [{k: r[k] for k in RL_KEYS if k in r} for r in recs], logits


_RL_SINGLE: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(RL_VARIANTS))
@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_rl_step_cp2_matches_cp1(dist_pools, impl, variant):
    ov = RL_VARIANTS[variant]
    if variant not in _RL_SINGLE:
        _RL_SINGLE[variant] = rl_steps(1, "ring", ov)
    recs0, logits0 = _RL_SINGLE[variant]
    for recs, logits in dist_pools.run(2, rl_steps, 2, impl, ov):
        assert set(recs[0]) == set(recs0[0])
        for a, b in zip(recs0, recs):
            for k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), (k, a[k], b[k])
        torch.testing.assert_close(logits, logits0, atol=1e-9, rtol=1e-9)
    assert recs0[1]["kl_mean"] > 0 and recs0[0]["grad_norm"] > 0


@pytest.mark.slow
def test_rl_step_cp2_tp2_sequence_parallel_matches_one_process(dist_pools):
    """cp=2 x tp=2 with Megatron SP inside TP (ring attention, the exact KL, shared prompts): the whole two-step
    run equals the single process."""
    ov = RL_VARIANTS["shared"]
    if "shared" not in _RL_SINGLE:
        _RL_SINGLE["shared"] = rl_steps(1, "ring", ov)
    recs0, logits0 = _RL_SINGLE["shared"]
    for recs, logits in dist_pools.run(4, rl_steps, 2, "ring", ov + ["parallel.sequence_parallel=true"], 2):
        for a, b in zip(recs0, recs):
            for k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), (k, a[k], b[k])
        torch.testing.assert_close(logits, logits0, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("override,named", [
    ("algo.name=ppo", "algo.name='ppo'"), ("algo.fused_loss=false", "algo.fused_loss=false"),
    ("parallel.batch_invariant=true", "parallel.batch_invariant=true"), ("loss.policy=gspo", "loss.policy='gspo'"),
    ("lora.rank=8", "lora.rank > 0"), ("kl_ctl.mode=grad_ratio", "grad_ratio"),
    ("parallel.cp_impl=stripe", "parallel.cp_impl must be"), ("parallel.cp=3", "does not divide the world size 4"),
])
def test_what_cp_does_not_compose_with_is_refused_at_start_up(override, named):
    from core.config import ConfigError, load_config
    from parallel.dims import LayoutError
    from rl.config import RLConfig
    from rl.preflight import check_rl_config

    overrides = ["parallel.cp=2", "rollout.prompts_per_step=4", override]
    if override == "algo.name=ppo":
        overrides.append("kl.where=reward")
    with pytest.raises((ConfigError, LayoutError, ValueError), match=named.replace("(", r"\(").replace("*", r"\*")):
        cfg = load_config(RLConfig, None, overrides)
        check_rl_config(cfg, 4)


def test_cp_layout_from_the_config():
    from core.config import load_config
    from rl.config import RLConfig
    from rl.preflight import check_rl_config

    cfg = load_config(RLConfig, None, ["parallel.cp=2", "parallel.tp=2", "rollout.prompts_per_step=4"])
    dims = check_rl_config(cfg, 8)
    assert (dims.dp, dims.cp, dims.tp) == (2, 2, 2)


# ---------------------------------------------------------------------------------------------
# memory: the update's activations split over the cp ranks


def _update_peak_cp2(tokens: int, impl: str) -> dict:
    import torch.distributed as dist

    from bench.bench_cp import update_peak

    return update_peak(tokens, dist.group.WORLD, impl, repeats=0)


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [4096, 8192])
def test_update_peak_per_rank_at_cp2_is_about_half(dist_pools, tokens):
    """The GRPO update's forward + backward over one sequence (MemTracker, deterministic): each cp=2 rank's
    peak at most 0.55x the single rank's (the fused head in chunks of 256 tokens: bench/bench_cp.py; numbers in
    docs/kl_cost.md "Context parallelism")."""
    from bench.bench_cp import update_peak

    one = update_peak(tokens, None, repeats=0)["peak_bytes"]
    assert abs(_update_budget(tokens, 1, "ring") - one) <= 0.10 * one, (_update_budget(tokens, 1, "ring"), one)
    for impl in ("ring", "ulysses"):
        peaks = [r["peak_bytes"] for r in dist_pools.run(2, _update_peak_cp2, tokens, impl)]
        assert max(peaks) <= 0.55 * one, (impl, peaks, one)
        assert min(peaks) >= 0.4 * one, (impl, peaks, one)  # each rank still holds its half
        want = _update_budget(tokens, 2, impl)  # core/runtime/budget.py's parts of the update, per cp rank
        assert all(abs(want - p) <= 0.10 * p for p in peaks), (impl, want, peaks)


def _update_budget(tokens: int, cp: int, impl: str) -> int:
    """The step budget's update transients (activations, sequence activations, CP attention, KL head) for
    bench/bench_cp.py's shape: one row of `tokens`, a 16-token prompt, the loss-inside head in chunks of 256."""
    import argparse

    from bench.bench_cp import PROMPT, _config
    from core.runtime.budget import Batch, Layout, step_budget

    cfg = _config(argparse.Namespace(hidden=64, layers=2, vocab=256), tokens)
    lay = Layout(1, 1, False, "fp32", False, False, cp, impl)
    parts = step_budget(cfg, lay, Batch(1, 1, tokens, tokens - PROMPT, 256), "tp", "fused_loss")["parts"]
    return sum(parts[k] for k in ("activations", "sequence activations", "CP attention", "KL head"))
