"""The fused head against (a) the unfused vocab-parallel functions on materialised logits, (b)
single-process float64 autograd of the full head with torch.distributions, at tp = 1, 2, 4, and
(c) MemTracker: its peak memory does not grow with the number of tokens at a fixed chunk size."""

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from parallel import comm
from parallel.fused import fused_head
from parallel.vocab import vocab_parallel_entropy, vocab_parallel_kl, vocab_parallel_logprobs
from tests.memory import peak_bytes

FIELDS = ("logprobs", "entropy", "kl", "ref_logprobs")


def _head_inputs(T, H, Hr, Vp, V, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g, dtype=dtype)
    w = torch.randn(Vp, H, generator=g, dtype=dtype) / H**0.5 * 3
    hr = torch.randn(T, Hr, generator=g, dtype=dtype)
    wr = torch.randn(Vp, Hr, generator=g, dtype=dtype) / Hr**0.5 * 3
    t = torch.randint(0, V, (T,), generator=g)
    coef = torch.randn(4, T, generator=g, dtype=dtype)  # upstream weights of the four outputs
    return h, w, hr, wr, t, coef


@pytest.mark.parametrize("kl", ["forward", "reverse"])
def test_fused_equals_unfused_fp32(kl):
    T, H, Hr, V, Vp, tau = 45, 12, 10, 131, 192, 0.8
    h, w, hr, wr, t, coef = _head_inputs(T, H, Hr, Vp, V, 0, torch.float32)
    leaves = [x.clone().requires_grad_(True) for x in (h, w, hr, wr)]
    out = fused_head(*leaves[:2], t, vocab_size=V, ref_hidden=leaves[2], ref_weight_local=leaves[3],
                     temperature=tau, chunk_size=8, kl=kl)
    grads = torch.autograd.grad(sum((o * c).sum() for o, c in zip(out, coef)), leaves)

    leaves2 = [x.clone().requires_grad_(True) for x in (h, w, hr, wr)]
    zp, zq = leaves2[0] @ leaves2[1].T, leaves2[2] @ leaves2[3].T  # materialised [T, Vp] logits
    kw = dict(vocab_size=V, temperature=tau)
    ref = (vocab_parallel_logprobs(zp, t, **kw), vocab_parallel_entropy(zp, **kw),
           vocab_parallel_kl(zp, zq, direction=kl, grad_q=True, **kw), vocab_parallel_logprobs(zq, t, **kw))
    grads2 = torch.autograd.grad(sum((o * c).sum() for o, c in zip(ref, coef)), leaves2)
    for name, a, b in zip(FIELDS, out, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    for name, a, b in zip(("hidden", "weight", "ref_hidden", "ref_weight"), grads, grads2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert torch.all(grads[1][V:] == 0) and torch.all(grads[3][V:] == 0)  # padded head rows


def test_fused_fields_and_frozen_reference():
    T, H, V = 7, 3, 12
    h, w, hr, wr, t, _ = _head_inputs(T, H, H, V, V, 1)
    hg, wg = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = fused_head(hg, wg, None, ref_weight_local=wr, entropy=False, kl="forward", chunk_size=4)
    assert out.logprobs is None and out.entropy is None and out.ref_logprobs is None
    # ref_hidden=None: the reference reads `hidden` as a constant; identical heads give exactly 0
    same = fused_head(hg, wg, t, ref_weight_local=w.clone(), kl="reverse", chunk_size=4)
    assert torch.equal(same.kl, torch.zeros(T, dtype=h.dtype))
    assert torch.equal(same.logprobs, same.ref_logprobs)
    gh, gw = torch.autograd.grad(out.kl.sum(), [hg, wg])
    P = Categorical(logits=hg @ wg.T)
    Q = Categorical(logits=h @ wr.T)
    gh2, gw2 = torch.autograd.grad(kl_divergence(P, Q).sum(), [hg, wg])
    torch.testing.assert_close(gh, gh2)
    torch.testing.assert_close(gw, gw2)
    assert torch.autograd.gradcheck(
        lambda h, w, hr, wr: fused_head(h, w, t.clamp(max=V - 4), ref_hidden=hr, ref_weight_local=wr, kl="forward",
                                        vocab_size=V - 3, temperature=1.2, chunk_size=4),
        tuple(x.clone().requires_grad_(True) for x in (h, w, hr, wr)))


_SUBGROUPS = {}


def _group(tp):
    import torch.distributed as dist

    if tp == dist.get_world_size():
        return dist.group.WORLD
    if tp not in _SUBGROUPS:  # every rank creates every subgroup, in the same order
        _SUBGROUPS[tp] = dist.new_group(list(range(tp)))
    return _SUBGROUPS[tp] if dist.get_rank() < tp else False


def _tp_head_vs_full_autograd(tp, kl, seed):
    """hidden replicated (caller wraps it with copy_to_tp), head weights sharded by rows."""
    group = _group(tp)
    if group is False:
        return None
    r = comm.group_rank(group)
    T, H, Hr, V, tau = 21, 8, 6, 131, 0.9
    Vp = 192  # ModelConfig(vocab_size=131).padded_vocab_size(tp) for tp in {1, 2, 4}
    h, w, hr, wr, t, coef = _head_inputs(T, H, Hr, Vp, V, seed)
    width = Vp // tp
    rows = slice(r * width, (r + 1) * width)

    # single-process reference: the full head, float64 autograd through torch.distributions
    hf, wf = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    P, Q = Categorical(logits=(hf @ wf.T)[:, :V] / tau), Categorical(logits=(hr @ wr.T)[:, :V] / tau)
    ref = (P.log_prob(t), P.entropy(), kl_divergence(P, Q) if kl == "forward" else kl_divergence(Q, P),
           Q.log_prob(t))
    gh_ref, gw_ref = torch.autograd.grad(sum((o * c).sum() for o, c in zip(ref, coef)), [hf, wf])

    hl, wl = h.clone().requires_grad_(True), w[rows].clone().requires_grad_(True)
    with comm.count_comm() as c_fwd:
        out = fused_head(comm.copy_to_tp(hl, group), wl, t, group, vocab_size=V, ref_hidden=hr,
                         ref_weight_local=wr[rows], temperature=tau, chunk_size=5, kl=kl)
    with comm.count_comm() as c_bwd:
        gh, gw = torch.autograd.grad(sum((o * c).sum() for o, c in zip(out, coef)), [hl, wl])
    for name, a, b in zip(FIELDS, out, ref):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)
    torch.testing.assert_close(gh, gh_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(gw, gw_ref[rows], atol=1e-10, rtol=1e-10)
    # forward: one max and one gather of O(T) floats for all 5 chunks; backward: only copy_to_tp's
    # all-reduce of grad_hidden [T, H] (the caller's), nothing from the fused head itself
    kinds = c_fwd.by_kind()
    assert kinds == {"all_reduce:max": (1, T * 2 * 8), "all_gather": (1, T * 6 * 8)}, kinds
    assert [rec.shape for rec in c_bwd.records] == [(T, H)]
    return True


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_fused_tp_matches_full_head(dist_pools, tp):
    for kl in ("forward", "reverse"):
        res = dist_pools.run(4, _tp_head_vs_full_autograd, tp, kl, 7)
        assert res[:tp] == [True] * tp


@pytest.mark.slow
def test_fused_peak_memory_does_not_grow_with_tokens():
    H, V, chunk = 16, 2048, 32

    def run(T, fused):
        h, w, hr, wr, t, coef = _head_inputs(T, H, H, V, V, 3, torch.float32)
        h.requires_grad_(True)
        w.requires_grad_(True)

        def step():
            if fused:
                out = fused_head(h, w, t, ref_hidden=hr, ref_weight_local=wr, chunk_size=chunk, kl="forward")
            else:
                zp, zq = h @ w.T, hr @ wr.T
                out = (vocab_parallel_logprobs(zp, t, chunk_size=chunk), vocab_parallel_entropy(zp, chunk_size=chunk),
                       vocab_parallel_kl(zp, zq, chunk_size=chunk))
            sum((o * c).sum() for o, c in zip(out, coef)).backward()
        return peak_bytes(step, h, w, hr, wr, t, coef)

    T = 256
    fused = [run(T, True), run(2 * T, True)]
    plain = [run(T, False), run(2 * T, False)]
    # fused: the extra T tokens cost only O(T * H) (grad_hidden) and O(T) values, not O(T * V)
    assert fused[0] > chunk * V * 4  # sanity: the tracker saw the chunk's logits
    assert fused[1] - fused[0] <= T * 4 * (H + 64), fused
    # the materialised path grows by at least one [T, V] fp32 tensor: the test can tell them apart
    assert plain[1] - plain[0] >= T * V * 4, plain
    assert fused[1] < plain[0] / 4, (fused, plain)


def test_fused_bad_input():
    h, w, hr, wr, t, _ = _head_inputs(4, 6, 5, 16, 16, 2)
    with pytest.raises(ValueError, match="needs ref_weight_local"):
        fused_head(h, w, t, kl="forward")
    with pytest.raises(ValueError, match="ref_weight_local has shape"):
        fused_head(h, w, t, ref_hidden=hr, ref_weight_local=wr[:, :4])
    with pytest.raises(ValueError, match="weight_local has shape"):
        fused_head(h, w[:, :5], t)
    with pytest.raises(ValueError, match="asked for nothing"):
        fused_head(h, w, None, entropy=False)
    with pytest.raises(ValueError, match="target id 16"):
        fused_head(h, w, torch.tensor([0, 1, 2, 16]))


@pytest.mark.parametrize("rows", [1, 5, 32, 64, 65])
def test_head_matmul_few_rows_blocked_equals_float64(rows):
    # a decode step's few rows take the vocabulary-blocked CPU path (parallel/fused.py `_FEW_ROWS`); every
    # column block written, each logit the float64 product's to fp32 rounding, the temperature applied
    from parallel.fused import _FEW_ROWS_BLOCK, HeadMatmul
    from parallel.vocab_stats import vocab_shard

    g = torch.Generator().manual_seed(rows)
    V, H = 2 * _FEW_ROWS_BLOCK + 37, 48
    w, h = torch.randn(V, H, generator=g), torch.randn(rows, H, generator=g)
    z = HeadMatmul(w, vocab_shard(V, None, None, 0.7, w.dtype, fp32=True))(h)
    want = (h.double() @ w.double().T) / 0.7
    assert z.shape == (rows, V) and z.dtype == torch.float32
    torch.testing.assert_close(z.double(), want, rtol=1e-5, atol=1e-4)
