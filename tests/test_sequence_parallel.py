"""Sequence parallelism (parallel.sequence_parallel) against references it did not produce.

A GRPO-style loss through the fused vocab-parallel head at tp=2 with SP on, policy and reference both
sequence-parallel, against a single-process float64 model whose logits, log-softmax, exact KL and
loss are plain torch: logits, per-token log-probs, exact KL, loss and every gradient within 1e-10.
S = 7 (odd: the model pads to a multiple of tp) with left-padded rows, and S = 8 unpadded. Also: the
collectives a forward issues, the batch-invariant mode's bits unchanged by SP, KV-cache forwards
unchanged, and the errors for what does not split or compose."""

from __future__ import annotations

import pytest
import torch

from core.config import ConfigError, ModelConfig, ParallelConfig, check_parallel
from core.model import KVCache, build_model, local_shard
from parallel import comm
from parallel.dims import ParallelDims, init_parallel, kv_replica_group
from parallel.fused import fused_head
from parallel.seq_comm import SequenceSplitError, scatter_seq

CFG = ModelConfig(vocab_size=131, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                  max_seq_len=16, tie_embeddings=False, qkv_bias=True)
B, BETA, TOL = 3, 0.3, dict(atol=1e-10, rtol=1e-10)


def _batch(S: int):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, CFG.vocab_size, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :2] = 0  # left padding on one row, right padding on another
    mask[2, -1] = 0
    adv = torch.randn(B, S - 1, generator=g, dtype=torch.float64)
    return ids, mask, adv


def _grpo(logp, kl, adv, m):
    """A GRPO-style per-token loss: -ratio * A + beta * KL, masked mean (ratio 1 on-policy, gradient live)."""
    ratio = torch.exp(logp - logp.detach())
    return ((-ratio * adv + BETA * kl) * m).sum() / m.sum()


def _reference(S: int) -> dict:
    """tp=1, float64, plain torch: F.log_softmax over the full vocabulary, the KL as sum p (log p - log q)."""
    ids, mask, adv = _batch(S)
    pol = build_model(CFG, seed=3, dtype=torch.float64)
    ref = build_model(CFG, seed=4, dtype=torch.float64)
    V = CFG.vocab_size
    logits = pol(ids, attention_mask=mask)[..., :V]
    with torch.no_grad():
        ref_logits = ref(ids, attention_mask=mask)[..., :V]
    lp_all = torch.log_softmax(logits[:, :-1], -1)
    lq_all = torch.log_softmax(ref_logits[:, :-1], -1)
    logp = lp_all.gather(-1, ids[:, 1:, None])[..., 0]
    kl = (lp_all.exp() * (lp_all - lq_all)).sum(-1)
    m = (mask[:, 1:] * mask[:, :-1]).double()  # a real token predicted from a real one
    loss = _grpo(logp, kl, adv, m)
    loss.backward()
    return {"logits": logits.detach(), "logp": logp.detach(), "kl": kl.detach(), "loss": loss.detach(),
            "grads": {n: (p.grad[:V] if n in ("embed.weight", "lm_head.weight") else p.grad).clone()
                      for n, p in pol.named_parameters()}}


def _sp_run(S: int, want: dict, sp: bool = True) -> int:
    """tp=2 on this rank, SP on: compare with `want` (`_reference`); returns the number of compared tensors."""
    state = init_parallel(ParallelDims(1, 2), "cpu", CFG.n_heads, CFG.n_kv_heads)
    g, kv = state.tp_group, kv_replica_group(state, CFG.n_kv_heads)
    pol = build_model(CFG, g, kv, seed=3, dtype=torch.float64)
    ref = build_model(CFG, g, kv, seed=4, dtype=torch.float64)
    pol.sequence_parallel = ref.sequence_parallel = sp
    ids, mask, adv = _batch(S)
    V, m = CFG.vocab_size, (mask[:, 1:] * mask[:, :-1]).double()
    with torch.no_grad():
        logits = comm.gather_from_tp(pol(ids, attention_mask=mask), g)[..., :V]
        rh, rw = ref(ids, attention_mask=mask, head=lambda h, w: (h[:, :-1].clone(), w.clone()))
    real = mask.bool()  # padded positions: the two layouts treat them differently, and nothing reads them
    torch.testing.assert_close(logits[real], want["logits"][real], **TOL, msg=lambda s: f"logits: {s}")

    def head(h, w):
        hr = comm.copy_to_tp(h[:, :-1], g).reshape(-1, CFG.hidden_size)
        out = fused_head(hr, w, ids[:, 1:].reshape(-1), g, vocab_size=V, ref_hidden=rh.reshape(-1, CFG.hidden_size),
                         ref_weight_local=rw, kl="forward", entropy=False, chunk_size=5)
        return out.logprobs.view(B, S - 1), out.kl.view(B, S - 1)

    logp, kl = pol(ids, attention_mask=mask, head=head)
    loss = _grpo(logp, kl, adv, m)
    loss.backward()
    real = m.bool()  # padded positions: the plain reference's values there are meaningless
    torch.testing.assert_close(logp[real], want["logp"][real], **TOL, msg=lambda s: f"log-probs: {s}")
    torch.testing.assert_close(kl[real], want["kl"][real], **TOL, msg=lambda s: f"exact KL: {s}")
    torch.testing.assert_close(loss.detach(), want["loss"], **TOL, msg=lambda s: f"loss: {s}")
    n = 0
    for name, p in pol.named_parameters():
        w = local_shard(want["grads"][name], name, CFG, state.tp_rank, 2)
        torch.testing.assert_close(p.grad, w, **TOL, msg=lambda s, k=name: f"grad {k}: {s}")
        n += 1
    return n


@pytest.mark.parametrize("S", [7, 8])
def test_fused_grpo_loss_tp2_sp_matches_float64_reference(dist_pools, S):
    want = _reference(S)
    n = dist_pools.run(2, _sp_run, S, want)
    assert n[0] == len(want["grads"]) == 3 + 2 * 12  # embed, norm, lm_head; per layer 2 norms, 7 weights, 3 biases


def _count_forward(S: int) -> dict:
    state = init_parallel(ParallelDims(1, 2), "cpu", CFG.n_heads, CFG.n_kv_heads)
    model = build_model(CFG, state.tp_group, kv_replica_group(state, CFG.n_kv_heads), seed=3)
    model.sequence_parallel = True
    ids = torch.arange(B * S).view(B, S) % CFG.vocab_size
    with comm.count_comm() as c:
        model(ids, head=lambda h, w: h.sum())
    return {k: n for k, (n, _) in c.by_kind().items()}


def test_forward_collectives(dist_pools):
    """Per layer one all-gather and one reduce-scatter for attention and for the MLP, one reduce-scatter for the
    embedding, one all-gather for the head; no all-reduce."""
    L = CFG.n_layers
    got = dist_pools.run(2, _count_forward, 8)[0]
    assert got == {"reduce_scatter:sum": 2 * L + 1, "all_gather": 2 * L + 1}, got


def _invariant_and_cache() -> None:
    state = init_parallel(ParallelDims(1, 2), "cpu", CFG.n_heads, CFG.n_kv_heads)
    model = build_model(CFG, state.tp_group, kv_replica_group(state, CFG.n_kv_heads), seed=3)
    ids, mask, _ = _batch(7)
    model.batch_invariant = True
    with torch.no_grad():
        off = model(ids, attention_mask=mask)
        model.sequence_parallel = True
        on = model(ids, attention_mask=mask)
        assert torch.equal(on[mask.bool()], off[mask.bool()]), "batch-invariant bits changed by SP"
        model.batch_invariant = False
        outs = []
        for sp in (False, True):  # a KV-cache forward runs without SP: the same results either way
            model.sequence_parallel = sp
            cache = KVCache.empty(CFG, B, 16, 2, "cpu", torch.float32)
            outs.append(torch.cat([model(ids[:, :5], kv_cache=cache), model(ids[:, 5:6], kv_cache=cache)], 1))
        assert torch.equal(outs[0], outs[1])


def test_batch_invariant_bits_and_kv_cache_unchanged(dist_pools):
    dist_pools.run(2, _invariant_and_cache)


def _lora_grads(sp: bool) -> dict:
    from core.lora import init_adapters
    from parallel.lora import LoRAConfig, apply_lora

    state = init_parallel(ParallelDims(1, 2), "cpu", CFG.n_heads, CFG.n_kv_heads)
    model = build_model(CFG, state.tp_group, kv_replica_group(state, CFG.n_kv_heads), seed=3, dtype=torch.float64)
    init_adapters(apply_lora(model, LoRAConfig(rank=2)), 0, b_std=0.1)  # B != 0: A's gradient is not zero
    model.sequence_parallel = sp
    ids, mask, _ = _batch(7)
    model(ids, attention_mask=mask, head=lambda h, w: (h * mask[..., None]).pow(2).sum()).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_lora_adapters_same_gradients_with_sp(dist_pools):
    """LoRA's own collectives (parallel/lora.py) sit inside the TP pairs: SP changes none of its gradients."""
    off, on = (dist_pools.run(2, _lora_grads, sp)[0] for sp in (False, True))
    assert len(off) == 2 * 2 * 7
    for n in off:
        torch.testing.assert_close(on[n], off[n], **TOL, msg=lambda s, k=n: f"{k}: {s}")


def _bf16_grads(sp: bool) -> dict:
    state = init_parallel(ParallelDims(1, 2), "cpu", CFG.n_heads, CFG.n_kv_heads)
    model = build_model(CFG, state.tp_group, kv_replica_group(state, CFG.n_kv_heads), seed=3)
    model.set_mixed_precision("bf16")
    model.sequence_parallel = sp
    ids, mask, _ = _batch(8)
    out = model(ids, attention_mask=mask)
    (out.float().pow(2) * mask[..., None]).sum().backward()
    assert out.dtype == torch.bfloat16
    return {"logits": out.detach().float(), **{n: p.grad for n, p in model.named_parameters()}}


def test_bf16_autocast_sp_matches_without(dist_pools):
    """Under bf16 autocast (fp32 weights) the gathered q/k/v and gate/up inputs are cast before the gather and
    the products run in bf16, as F.linear's autocast does without SP: the same bf16 products, so logits and
    gradients agree to fp32 summation order (1e-5 of each tensor's largest entry; measured 1.4e-7)."""
    off, on = (dist_pools.run(2, _bf16_grads, sp)[0] for sp in (False, True))
    for n in off:
        scale = float(off[n].abs().max())
        assert scale > 0, n
        assert float((on[n] - off[n]).abs().max()) <= 1e-5 * scale, n


def _uneven() -> str:
    init_parallel(ParallelDims(1, 2), "cpu")
    with pytest.raises(SequenceSplitError) as e:
        scatter_seq(torch.zeros(1, 5, 4), comm.dist.group.WORLD)
    return str(e.value)


def test_uneven_split_names_s_and_tp(dist_pools):
    msg = dist_pools.run(2, _uneven)[0]
    assert "S=5" in msg and "tp=2" in msg


def test_config_flag_checked():
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        check_parallel(ParallelConfig(tp=2, sequence_parallel="yes"), 2)
    check_parallel(ParallelConfig(tp=2, sequence_parallel=True), 2)
    check_parallel(ParallelConfig(tp=2, cp=2, sequence_parallel=True), 4)
