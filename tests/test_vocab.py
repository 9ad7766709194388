"""Vocab-parallel log-probs / entropy / KL against float64 torch.distributions on gathered logits.

Each rank builds the same full [B, S, Vp] float64 logits, keeps its vocabulary shard, and compares
values and gradients with Categorical / kl_divergence on the full, unpadded logits."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence

from core.config import ModelConfig
from parallel import comm
from parallel.vocab import (
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_kl,
    vocab_parallel_log_softmax,
    vocab_parallel_logprobs,
    vocab_parallel_logsumexp,
)

FUNCS = ["logsumexp", "log_softmax", "logprobs", "cross_entropy", "entropy", "kl_forward", "kl_reverse"]
B, S = 3, 5  # leading dims [B, S, V/tp]; T = 15 tokens, chunks of 4 (uneven)


_SUBGROUPS = {}


def _group(tp=None):
    """The TP group of this test: None in-process, else the first `tp` ranks of the 4-rank pool
    (one pool serves tp=2 and tp=4; ranks outside the group return None from the checks)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    if tp is None or tp == dist.get_world_size():
        return dist.group.WORLD
    if tp not in _SUBGROUPS:  # every rank creates every subgroup, in the same order
        _SUBGROUPS[tp] = dist.new_group(list(range(tp)))
    return _SUBGROUPS[tp] if dist.get_rank() < tp else False


def _ours(name, x, y, t, group, V, tau, chunk, fp32=True):
    kw = dict(vocab_size=V, fp32=fp32)
    if name == "logsumexp":
        return vocab_parallel_logsumexp(x, group, temperature=tau, chunk_size=chunk, **kw)
    if name == "log_softmax":
        return vocab_parallel_log_softmax(x, group, temperature=tau, **kw)
    if name == "logprobs":
        return vocab_parallel_logprobs(x, t, group, temperature=tau, chunk_size=chunk, **kw)
    if name == "cross_entropy":
        return vocab_parallel_cross_entropy(x, t, group, chunk_size=chunk, **kw)
    if name == "entropy":
        return vocab_parallel_entropy(x, group, temperature=tau, chunk_size=chunk, **kw)
    return vocab_parallel_kl(x, y, group, direction=name[3:], temperature=tau, chunk_size=chunk, grad_q=True,
                             **kw)


def _ref(name, X, Y, t, V, tau):
    """float64 reference from the gathered logits X, Y [B, S, Vp] (padding dropped)."""
    P, Q = Categorical(logits=X[..., :V] / tau), Categorical(logits=Y[..., :V] / tau)
    if name == "logsumexp":
        return torch.logsumexp(X[..., :V] / tau, -1)
    if name == "log_softmax":
        return F.pad(torch.log_softmax(X[..., :V] / tau, -1), (0, X.shape[-1] - V), value=float("-inf"))
    if name == "logprobs":
        return P.log_prob(t)
    if name == "cross_entropy":
        return F.cross_entropy(X[..., :V].reshape(-1, V), t.reshape(-1), ignore_index=-100,
                               reduction="none").reshape(t.shape)
    if name == "entropy":
        return P.entropy()
    return kl_divergence(P, Q) if name == "kl_forward" else kl_divergence(Q, P)


def _loss(name, out, w, nv):
    """A weighted sum of the outputs; log_softmax's -inf padding is left out of it."""
    if name == "log_softmax":
        return (out[..., :nv] * w[..., :nv]).sum()
    return (out * w).sum()


def _inputs(V, tp, seed, pad_value=None):
    Vp = ModelConfig(vocab_size=V).padded_vocab_size(tp)
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, S, Vp, generator=g, dtype=torch.float64) * 2
    Y = X + torch.randn(B, S, Vp, generator=g, dtype=torch.float64)
    X[0, 1] += 30.0  # a confident row
    t = torch.randint(0, V, (B, S), generator=g)
    t_ce = torch.where(torch.rand(B, S, generator=g) < 0.3, -100, t)
    if pad_value is not None:  # garbage in the padded columns must change nothing
        X[..., V:], Y[..., V:] = pad_value, -pad_value
    return Vp, X, Y, t, t_ce


def _check_against_reference(V, seed, tp=None):
    group = _group(tp)
    if group is False:
        return None
    tp, r = comm.group_size(group), comm.group_rank(group)
    Vp, X, Y, t, t_ce = _inputs(V, tp, seed)
    width = Vp // tp
    cols = slice(r * width, (r + 1) * width)
    nv = max(0, min(width, V - r * width))
    tau, chunk = 0.7, 4
    comm_by_func = {}
    for name in FUNCS:
        tgt = t_ce if name == "cross_entropy" else t
        Xr, Yr = X.clone().requires_grad_(True), Y.clone().requires_grad_(True)
        ref = _ref(name, Xr, Yr, tgt, V, tau)
        w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        gX, gY = torch.autograd.grad(_loss(name, ref, w, V), [Xr, Yr], allow_unused=True)

        x = X[..., cols].clone().requires_grad_(True)
        y = Y[..., cols].clone().requires_grad_(True)
        with comm.count_comm() as c:
            out = _ours(name, x, y, tgt, group, V, tau, chunk)
            wl = w[..., cols] if name == "log_softmax" else w
            gx, gy = torch.autograd.grad(_loss(name, out, wl, nv), [x, y], allow_unused=True)
        comm_by_func[name] = (c.bytes, c.max_numel())
        want = ref[..., cols] if name == "log_softmax" else ref
        assert out.shape == want.shape, name
        torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10, msg=name)
        torch.testing.assert_close(gx, gX[..., cols], atol=1e-10, rtol=1e-10, msg=name)
        assert torch.all(gx[..., nv:] == 0), f"{name}: gradient leaked into padded columns"
        if name.startswith("kl"):
            torch.testing.assert_close(gy, gY[..., cols], atol=1e-10, rtol=1e-10, msg=name)

        # padded columns never change any value or gradient, whatever they hold
        _, X2, Y2, _, _ = _inputs(V, tp, seed, pad_value=1e4)
        x2 = X2[..., cols].clone().requires_grad_(True)
        out2 = _ours(name, x2, Y2[..., cols], tgt, group, V, tau, chunk)
        (gx2,) = torch.autograd.grad(_loss(name, out2, wl, nv), [x2])
        assert torch.equal(out2[..., :nv], out[..., :nv]) and torch.equal(gx2, gx), name
    return comm_by_func


def _check_identical_and_masked(V, seed, tp=None):
    group = _group(tp)
    if group is False:
        return True
    tp, r = comm.group_size(group), comm.group_rank(group)
    Vp, X, _, t, _ = _inputs(V, tp, seed)
    width = Vp // tp
    cols = slice(r * width, (r + 1) * width)
    # identical logits: exactly 0 KL and exactly 0 gradient, both directions, fp32 and bf16
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for direction in ("forward", "reverse"):
            x = X[..., cols].to(dtype).requires_grad_(True)
            kl = vocab_parallel_kl(x, x.detach().clone(), group, vocab_size=V, direction=direction,
                                   chunk_size=4)
            (gx,) = torch.autograd.grad(kl.sum(), [x])
            assert torch.equal(kl, torch.zeros_like(kl)), (dtype, direction, kl)
            assert torch.equal(gx, torch.zeros_like(gx)), (dtype, direction)

    # the caller's masked aggregation: a fully masked sequence (with extreme logits) is finite and
    # contributes exactly zero gradient; the rest matches the float64 reference
    mask = torch.ones(B, S)
    mask[1] = 0
    mask[2, 3:] = 0
    X[1] = X[1] * 1e3
    Xr = X.clone().requires_grad_(True)
    Pr = Categorical(logits=Xr[..., :V])
    ref = (Pr.log_prob(t) - Pr.entropy()) * mask
    ref_loss = (ref.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    (gX,) = torch.autograd.grad(ref_loss, [Xr])
    x = X[..., cols].clone().requires_grad_(True)
    vals = (vocab_parallel_logprobs(x, t, group, vocab_size=V, chunk_size=4)
            - vocab_parallel_entropy(x, group, vocab_size=V, chunk_size=4))
    loss = ((vals * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    (gx,) = torch.autograd.grad(loss, [x])
    assert torch.isfinite(vals).all() and torch.isfinite(loss) and torch.isfinite(gx).all()
    assert torch.equal(gx[1], torch.zeros_like(gx[1]))
    torch.testing.assert_close(loss, ref_loss, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(gx, gX[..., cols], atol=1e-10, rtol=1e-10)
    return True


@pytest.mark.parametrize("V", [131, 1000])
def test_single_process_matches_float64_reference(V):
    _check_against_reference(V, 0)
    _check_identical_and_masked(V, 1)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_matches_float64_reference(dist_pools, tp):
    per_vocab = {}
    for V in (131, 1000):  # V=131 at tp=4 leaves rank 3 with padding only
        per_vocab[V] = dist_pools.run(4, _check_against_reference, V, 2, tp)
        assert all(dist_pools.run(4, _check_identical_and_masked, V, 3, tp))
    # the counter: no collective grows with V (same bytes for 131 and 1000), each at most 6T floats
    T = B * S
    for name in FUNCS:
        assert per_vocab[131][0][name] == per_vocab[1000][0][name], name
        nbytes, numel = per_vocab[1000][0][name]
        assert 0 < nbytes <= 8 * T * 8 and numel <= 6 * T, (name, nbytes, numel)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 10, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, 10, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 9, (2, 3), generator=g)
    t_ce = t.clone()
    t_ce[0, 1] = -100
    kw = dict(vocab_size=9, chunk_size=4)  # one padded column, uneven chunks
    cases = {
        "logsumexp": lambda x: vocab_parallel_logsumexp(x, temperature=0.9, **kw),
        "log_softmax": lambda x: vocab_parallel_log_softmax(x, vocab_size=9, temperature=1.3)[..., :9],
        "logprobs": lambda x: vocab_parallel_logprobs(x, t, temperature=0.9, **kw),
        "cross_entropy": lambda x: vocab_parallel_cross_entropy(x, t_ce, **kw),
        "entropy": lambda x: vocab_parallel_entropy(x, temperature=1.3, **kw),
    }
    for name, fn in cases.items():
        assert torch.autograd.gradcheck(fn, (x,)), name
    for d in ("forward", "reverse"):
        fn = lambda x, y, d=d: vocab_parallel_kl(x, y, direction=d, temperature=0.8, grad_q=True, **kw)
        assert torch.autograd.gradcheck(fn, (x, y)), d


def test_bf16_fp32_path_beats_plain_bf16():
    g = torch.Generator().manual_seed(5)
    T, V = 64, 1000
    xp = (torch.randn(T, V, generator=g) * 3 + 20).bfloat16()  # an offset, as real logits have
    xq = (xp.double() + torch.randn(T, V, generator=g, dtype=torch.float64) * 0.3).bfloat16()
    t = torch.randint(0, V, (T,), generator=g)
    P, Q = Categorical(logits=xp.double()), Categorical(logits=xq.double())
    refs = {"logprobs": P.log_prob(t), "entropy": P.entropy(), "kl": kl_divergence(P, Q)}

    def run(fp32):
        return {"logprobs": vocab_parallel_logprobs(xp, t, fp32=fp32, chunk_size=16),
                "entropy": vocab_parallel_entropy(xp, fp32=fp32),
                "kl": vocab_parallel_kl(xp, xq, fp32=fp32, chunk_size=16)}

    fast, slow = run(True), run(False)
    for k, ref in refs.items():
        assert fast[k].dtype == torch.float32 and slow[k].dtype == torch.bfloat16
        err32 = ((fast[k].double() - ref).abs() / ref.abs()).max().item()
        err16 = ((slow[k].double() - ref).abs() / ref.abs()).max().item()
        assert err32 < 1e-3, (k, err32)
        assert err16 > 2e-3 and err16 > 100 * err32, (k, err16, err32)  # the fp32 path earns its keep
    xg = xp.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(vocab_parallel_kl(xg, xq).sum(), [xg])
    assert gx.dtype == torch.bfloat16 and torch.isfinite(gx).all()


def test_bad_input_names_the_culprit():
    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match="target id 12"):
        vocab_parallel_logprobs(x, torch.tensor([0, 1, 12, 3]))
    with pytest.raises(ValueError, match="targets have shape"):
        vocab_parallel_logprobs(x, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="vocab_size=11"):
        vocab_parallel_entropy(x, vocab_size=11)
    with pytest.raises(ValueError, match="direction"):
        vocab_parallel_kl(x, x, direction="sideways")
    with pytest.raises(ValueError, match="differ in shape"):
        vocab_parallel_kl(x, x[:2])
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_entropy(x, chunk_size=0)
