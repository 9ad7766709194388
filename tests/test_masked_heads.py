"""Masked tokens reach no value and no gradient: garbage planted at padded
positions (NaN hidden rows, out-of-range target ids, NaN / -inf reference log-probs, a log-ratio
of -100 under k3) leaves every gradient finite and equal to the one computed with those tokens
removed from the batch -- in the fused head, the fused loss and the vocab-parallel functions."""

import pytest
import torch

from parallel.fused import fused_head
from parallel.fused_loss import fused_head_loss
from parallel.vocab import (
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_kl,
    vocab_parallel_logprobs,
    vocab_parallel_logsumexp,
)

T, H, V, VP = 12, 8, 37, 40


def _batch(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g, dtype=dtype)
    w = torch.randn(VP, H, generator=g, dtype=dtype) / H**0.5 * 3
    hr = torch.randn(T, H, generator=g, dtype=dtype)
    wr = torch.randn(VP, H, generator=g, dtype=dtype) / H**0.5 * 3
    t = torch.randint(0, V, (T,), generator=g)
    adv = torch.randn(T, generator=g, dtype=dtype)
    wts = torch.rand(T, generator=g, dtype=dtype) + 0.1
    keep = torch.ones(T, dtype=torch.bool)
    keep[[2, 5, 6, 11]] = False
    ref_lp = torch.randn(T, generator=g, dtype=dtype) - 4
    return h, w, hr, wr, t, adv, wts, keep, ref_lp


def _plant(h, hr, t, ref_lp, keep):
    """Garbage at every masked position; the kept ones are untouched."""
    h, hr, t, ref_lp = h.clone(), hr.clone(), t.clone(), ref_lp.clone()
    h[2], hr[5] = float("nan"), float("inf")
    t[2], t[6] = -100, V + 7  # an ignore id and an id outside the vocabulary
    ref_lp[2], ref_lp[5], ref_lp[11] = float("nan"), float("-inf"), 100.0  # log-ratio ~ -100 at 11
    ref_lp[6] = float("inf")
    assert not keep[[2, 5, 6, 11]].any()
    return h, hr, t, ref_lp


def _rl_token_loss(adv, wts, ref_lp, keep, beta=0.1):
    """The trainer's pattern: surrogate + beta * k3 per token, masked with torch.where afterwards
    (so the garbage's own gradient is 0 * inf = NaN unless the head drops it)."""
    def fn(lp, ent, kl, tok):
        lr = ref_lp[tok] - lp
        k3 = torch.exp(lr) - lr - 1
        total = -torch.exp(lp - lp.detach()) * adv[tok] + beta * k3 - 0.01 * ent
        return torch.where(keep[tok], total * wts[tok], torch.zeros((), dtype=total.dtype))
    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_loss_with_garbage_equals_tokens_removed(dtype):
    h, w, hr, wr, t, adv, wts, keep, ref_lp = _batch(dtype)
    hg, tg, rg, hrg = h, t, ref_lp, hr
    h, hr, t, ref_lp = _plant(h, hr, t, ref_lp, keep)
    kw = dict(vocab_size=V, ref_weight_local=wr, kl="forward", chunk_size=5, temperature=0.9)

    leaves = [h.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    loss, st = fused_head_loss(*leaves, t, ref_hidden=hr, token_loss=_rl_token_loss(adv, wts, ref_lp, keep),
                               mask=keep, **kw)
    gh, gw = torch.autograd.grad(loss, leaves)
    assert torch.isfinite(loss) and torch.isfinite(gh).all() and torch.isfinite(gw).all()
    assert torch.equal(gh[~keep], torch.zeros_like(gh[~keep]))
    for field in ("logprobs", "entropy", "kl"):
        v = getattr(st, field)
        assert torch.isfinite(v).all() and torch.equal(v[~keep], torch.zeros_like(v[~keep])), field

    k = keep
    kept = [hg[k].clone().requires_grad_(True), w.clone().requires_grad_(True)]
    loss2, st2 = fused_head_loss(*kept, tg[k], ref_hidden=hrg[k],
                                 token_loss=_rl_token_loss(adv[k], wts[k], rg[k], keep[k]), **kw)
    gh2, gw2 = torch.autograd.grad(loss2, kept)
    # float64: equal to 1e-6; float32: to its rounding (the two batches are summed in other orders)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, loss2, **tol)
    torch.testing.assert_close(gw, gw2, **tol)
    torch.testing.assert_close(gh[k], gh2, **tol)
    torch.testing.assert_close(st.kl[k], st2.kl, **tol)

    # the planted garbage is harmful: without the mask the same call has a non-finite gradient
    with pytest.raises(ValueError, match="target id"):
        fused_head_loss(*leaves, t, ref_hidden=hr, token_loss=_rl_token_loss(adv, wts, ref_lp, keep), **kw)
    t_ok = torch.where(keep, t, 0)
    bad, _ = fused_head_loss(*leaves, t_ok, ref_hidden=hr, token_loss=_rl_token_loss(adv, wts, ref_lp, keep), **kw)
    assert not torch.isfinite(torch.autograd.grad(bad, leaves[1])[0]).all()


@pytest.mark.parametrize("kl", ["forward", "reverse"])
def test_fused_head_with_garbage_equals_tokens_removed(kl):
    h, w, hr, wr, t, adv, wts, keep, ref_lp = _batch(torch.float32, 1)
    hg, tg, hrg = h, t, hr
    h, hr, t, _ = _plant(h, hr, t, ref_lp, keep)
    coef = torch.randn(4, T, generator=torch.Generator().manual_seed(3))
    coef[:, ~keep] = float("nan")  # the caller's upstream gradient is garbage there too

    def run(h, hr, t, m, c):
        leaves = [x.clone().requires_grad_(True) for x in (h, w, hr, wr)]
        out = fused_head(leaves[0], leaves[1], t, vocab_size=V, ref_hidden=leaves[2], ref_weight_local=leaves[3],
                         kl=kl, chunk_size=4, mask=m)
        k = keep if m is not None else torch.ones(len(t), dtype=torch.bool)
        loss = sum(torch.where(k, o * ci, 0.0).sum() for o, ci in zip(out, c))
        return out, torch.autograd.grad(loss, leaves)

    out, grads = run(h, hr, t, keep, coef)
    out2, grads2 = run(hg[keep], hrg[keep], tg[keep], None, coef[:, keep])
    for a, b in zip(out, out2):
        assert torch.equal(a[~keep], torch.zeros_like(a[~keep]))
        torch.testing.assert_close(a[keep], b, atol=1e-6, rtol=1e-6)
    for i, (a, b) in enumerate(zip(grads, grads2)):
        assert torch.isfinite(a).all(), i
        torch.testing.assert_close(a[keep] if i in (0, 2) else a, b, atol=1e-6, rtol=1e-6)


def test_vocab_parallel_functions_with_garbage_equal_tokens_removed():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, VP, generator=g, dtype=torch.float64) * 2
    y = x + torch.randn(T, VP, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (T,), generator=g)
    keep = torch.ones(T, dtype=torch.bool)
    keep[[0, 7]] = False
    xb, yb, tb = x.clone(), y.clone(), t.clone()
    xb[0], yb[7], tb[7] = float("nan"), float("-inf"), 10**6
    coef = torch.randn(T, generator=g, dtype=torch.float64)
    coef[~keep] = float("inf")
    funcs = {
        "lse": lambda a, b, t, m: vocab_parallel_logsumexp(a, vocab_size=V, chunk_size=5, mask=m),
        "logprobs": lambda a, b, t, m: vocab_parallel_logprobs(a, t, vocab_size=V, chunk_size=5, mask=m),
        "ce": lambda a, b, t, m: vocab_parallel_cross_entropy(a, t, vocab_size=V, chunk_size=5, mask=m),
        "entropy": lambda a, b, t, m: vocab_parallel_entropy(a, vocab_size=V, chunk_size=5, mask=m),
        "kl_forward": lambda a, b, t, m: vocab_parallel_kl(a, b, vocab_size=V, grad_q=True, mask=m),
        "kl_reverse": lambda a, b, t, m: vocab_parallel_kl(a, b, vocab_size=V, direction="reverse", grad_q=True,
                                                           mask=m),
    }
    for name, fn in funcs.items():
        a, b = xb.clone().requires_grad_(True), yb.clone().requires_grad_(True)
        out = fn(a, b, tb, keep)
        ga, gb = torch.autograd.grad(torch.where(keep, out * coef, 0.0).sum(), [a, b], allow_unused=True)
        a2, b2 = x[keep].clone().requires_grad_(True), y[keep].clone().requires_grad_(True)
        out2 = fn(a2, b2, t[keep], None)
        ga2, gb2 = torch.autograd.grad((out2 * coef[keep]).sum(), [a2, b2], allow_unused=True)
        assert torch.equal(out[~keep], torch.zeros_like(out[~keep])), name
        torch.testing.assert_close(out[keep], out2, atol=1e-12, rtol=1e-12, msg=name)
        assert torch.equal(ga[~keep], torch.zeros_like(ga[~keep])), name
        torch.testing.assert_close(ga[keep], ga2, atol=1e-12, rtol=1e-12, msg=name)
        if name.startswith("kl"):
            torch.testing.assert_close(gb[keep], gb2, atol=1e-12, rtol=1e-12, msg=name)


def test_bad_mask_names_the_culprit():
    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match="mask has shape"):
        vocab_parallel_entropy(x, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask has shape"):
        fused_head(torch.randn(4, 3), torch.randn(10, 3), mask=torch.ones(5, dtype=torch.bool))


def _tp2_masked_vs_single(seed):
    """tp = 2 with garbage at masked positions equals one process with those tokens removed."""
    import torch.distributed as dist

    from parallel import comm

    group = dist.group.WORLD
    tp, r = comm.group_size(group), comm.group_rank(group)
    h, w, hr, wr, t, adv, wts, keep, ref_lp = _batch(torch.float64, seed)
    hg, tg, rg, hrg = h, t, ref_lp, hr
    h, hr, t, ref_lp = _plant(h, hr, t, ref_lp, keep)
    kw = dict(vocab_size=V, kl="forward", chunk_size=5, temperature=0.9)
    rows = slice(r * (VP // tp), (r + 1) * (VP // tp))
    leaves = [h.clone().requires_grad_(True), w[rows].clone().requires_grad_(True)]
    loss, st = fused_head_loss(comm.copy_to_tp(leaves[0], group), leaves[1], t, group, ref_hidden=hr,
                               ref_weight_local=wr[rows], token_loss=_rl_token_loss(adv, wts, ref_lp, keep),
                               mask=keep, **kw)
    gh, gw = torch.autograd.grad(loss, leaves)
    k = keep
    kept = [hg[k].clone().requires_grad_(True), w.clone().requires_grad_(True)]
    loss2, st2 = fused_head_loss(*kept, tg[k], ref_hidden=hrg[k], ref_weight_local=wr,
                                 token_loss=_rl_token_loss(adv[k], wts[k], rg[k], keep[k]), **kw)
    gh2, gw2 = torch.autograd.grad(loss2, kept)
    tol = dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(loss, loss2, **tol)
    torch.testing.assert_close(gh[k], gh2, **tol)
    assert torch.equal(gh[~k], torch.zeros_like(gh[~k]))
    torch.testing.assert_close(gw, gw2[rows], **tol)
    torch.testing.assert_close(st.logprobs[k], st2.logprobs, **tol)
    return True


def test_tp2_masked_garbage_equals_single_process_without_it(dist_pools):
    assert dist_pools.run(2, _tp2_masked_vs_single, 7) == [True, True]
