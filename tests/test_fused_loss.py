"""fused_head_loss (gradient formed in forward) against fused_head followed by the same token loss
and an ordinary .backward() (float64, vocab padded and not, temperature != 1, both KL directions),
tp = 2 against a single process, constant memory in the number of tokens, and an exact-zero KL."""

import pytest
import torch

from parallel import comm
from parallel.fused import fused_head
from parallel.fused_loss import fused_head_loss
from tests.memory import peak_bytes

FIELDS = ("logprobs", "entropy", "kl", "ref_logprobs")


def _inputs(T, H, Hr, Vp, V, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g, dtype=dtype)
    w = torch.randn(Vp, H, generator=g, dtype=dtype) / H**0.5 * 3
    hr = torch.randn(T, Hr, generator=g, dtype=dtype)
    wr = torch.randn(Vp, Hr, generator=g, dtype=dtype) / Hr**0.5 * 3
    t = torch.randint(0, V, (T,), generator=g)
    old = torch.randn(T, generator=g, dtype=dtype) - 4  # "old" log-probs, near the policy's
    adv = torch.randn(T, generator=g, dtype=dtype)
    wts = torch.rand(T, generator=g, dtype=dtype)
    return h, w, hr, wr, t, (old, adv, wts)


def _ppo_like(old, adv, wts, beta=0.3, coef=0.05, eps=0.2):
    """A clipped-surrogate-like per-token loss: min of the clipped and unclipped ratio terms
    (torch.where / clamp of log-probs) + beta * kl - coef * entropy, per token."""
    def token_loss(logprobs, entropy, kl, tokens):
        o, a, m = old[tokens], adv[tokens], wts[tokens]
        log_ratio = (logprobs - o).clamp(-5.0, 5.0)
        ratio = torch.exp(log_ratio)
        surr = torch.where(a >= 0, torch.minimum(ratio, torch.full_like(ratio, 1 + eps)),
                           torch.maximum(ratio, torch.full_like(ratio, 1 - eps))) * a
        out = -surr * m
        if kl is not None:
            out = out + beta * kl * m
        if entropy is not None:
            out = out - coef * entropy * m
        return out
    return token_loss


def _reference(h, w, hr, wr, t, token_loss, group=None, **kw):
    """fused_head, then the token loss over all tokens, then .backward(): loss, grads, outputs."""
    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = fused_head(comm.copy_to_tp(hl, group), wl, t, group, ref_hidden=hr, ref_weight_local=wr, **kw)
    loss = token_loss(out.logprobs, out.entropy, out.kl, slice(None)).sum()
    loss.backward()
    return loss.detach(), hl.grad, wl.grad, out


@pytest.mark.parametrize("V,Vp", [(131, 192), (1000, 1000)])
@pytest.mark.parametrize("kl", ["forward", "reverse"])
def test_loss_and_grads_equal_fused_head_then_backward(V, Vp, kl):
    T, H, Hr, tau = 45, 12, 10, 0.8
    h, w, hr, wr, t, (old, adv, wts) = _inputs(T, H, Hr, Vp, V, 0)
    # the old log-probs sit where the clip is active for some tokens and not for others
    old = fused_head(h, w, t, vocab_size=V, temperature=tau).logprobs + 0.3 * adv.sign() * torch.rand(T)
    tl = _ppo_like(old, adv, wts)
    kw = dict(vocab_size=V, temperature=tau, kl=kl, entropy=True)
    loss_ref, gh_ref, gw_ref, out_ref = _reference(h, w, hr, wr, t, tl, chunk_size=45, **kw)

    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    hrl, wrl = hr.clone().requires_grad_(True), wr.clone().requires_grad_(True)  # must stay frozen
    loss, stats = fused_head_loss(hl, wl, t, ref_hidden=hrl, ref_weight_local=wrl, chunk_size=8, token_loss=tl, **kw)
    assert loss.shape == () and loss.requires_grad
    (2.5 * loss).backward()  # the saved gradients are scaled by the upstream gradient
    torch.testing.assert_close(loss, loss_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(hl.grad, 2.5 * gh_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(wl.grad, 2.5 * gw_ref, atol=1e-10, rtol=0)
    for name, a, b in zip(FIELDS, stats, out_ref):
        assert not a.requires_grad, name
        torch.testing.assert_close(a, b.detach(), atol=1e-10, rtol=0, msg=name)
    assert hrl.grad is None and wrl.grad is None
    assert torch.all(wl.grad[V:] == 0)  # padded head rows
    clipped = (stats.logprobs - old).abs() > 0.2  # crude: the clip branch was exercised
    assert 0 < int(clipped.sum()) < T


def test_identical_policy_and_reference_give_exact_zero_kl():
    T, H, V = 9, 5, 40
    h, w, _, _, t, (old, adv, wts) = _inputs(T, H, H, V, V, 1)
    for kl in ("forward", "reverse"):
        hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss, stats = fused_head_loss(hl, wl, t, ref_weight_local=w.clone(), kl=kl, chunk_size=4,
                                      temperature=1.3, token_loss=lambda lp, ent, k, s: k)
        assert torch.equal(stats.kl, torch.zeros(T, dtype=h.dtype))
        assert torch.equal(stats.logprobs, stats.ref_logprobs)
        loss.backward()
        assert float(loss.detach()) == 0.0


def _tp2_vs_single(kl, seed):
    import torch.distributed as dist

    group = dist.group.WORLD
    tp, r = comm.group_size(group), comm.group_rank(group)
    T, H, Hr, V, Vp, tau, chunk = 21, 8, 6, 131, 192, 0.9, 5
    h, w, hr, wr, t, (old, adv, wts) = _inputs(T, H, Hr, Vp, V, seed)
    tl = _ppo_like(old, adv, wts)
    kw = dict(vocab_size=V, temperature=tau, kl=kl, entropy=True)
    loss_ref, gh_ref, gw_ref, out_ref = _reference(h, w, hr, wr, t, tl, chunk_size=T, **kw)  # one process

    rows = slice(r * (Vp // tp), (r + 1) * (Vp // tp))
    hl, wl = h.clone().requires_grad_(True), w[rows].clone().requires_grad_(True)
    with comm.count_comm() as c_fwd:
        loss, stats = fused_head_loss(comm.copy_to_tp(hl, group), wl, t, group, ref_hidden=hr,
                                      ref_weight_local=wr[rows], chunk_size=chunk, token_loss=tl, **kw)
    with comm.count_comm() as c_bwd:
        loss.backward()
    torch.testing.assert_close(loss, loss_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(hl.grad, gh_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(wl.grad, gw_ref[rows], atol=1e-10, rtol=0)
    for name, a, b in zip(FIELDS, stats, out_ref):
        torch.testing.assert_close(a, b.detach(), atol=1e-10, rtol=0, msg=name)
    # forward: per chunk one max all-reduce [c, 2] and one all-gather [c, 6]: O(T) floats in total;
    # backward: only copy_to_tp's all-reduce of grad_hidden [T, H]
    n = -(-T // chunk)
    kinds = c_fwd.by_kind()
    assert kinds == {"all_reduce:max": (n, T * 2 * 8), "all_gather": (n, T * 6 * 8)}, kinds
    assert [rec.shape for rec in c_bwd.records] == [(T, H)]
    return True


def test_tp2_matches_single_process(dist_pools):
    for kl in ("forward", "reverse"):
        assert dist_pools.run(2, _tp2_vs_single, kl, 5) == [True, True]


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_tokens():
    H, V, chunk = 16, 2048, 32

    def run(T):
        h, w, hr, wr, t, (old, adv, wts) = _inputs(T, H, H, V, V, 3, torch.float32)
        h.requires_grad_(True)
        w.requires_grad_(True)
        tl = _ppo_like(old, adv, wts)

        def step():
            loss, _ = fused_head_loss(h, w, t, ref_hidden=hr, ref_weight_local=wr, chunk_size=chunk,
                                      kl="forward", token_loss=tl)
            loss.backward()
        return peak_bytes(step, h, w, hr, wr, t, old, adv, wts)

    T = 256
    peaks = [run(T), run(2 * T)]
    assert peaks[0] > chunk * V * 4  # sanity: the tracker saw the chunk's logits
    # the extra T tokens cost only O(T * H) (grad_hidden) and O(T) values, not O(T * V)
    assert peaks[1] - peaks[0] <= T * 4 * (H + 64), peaks
    # a handful of [chunk, V] temporaries, while one [2T, V] logits tensor would be 32 of them
    assert peaks[1] <= 8 * chunk * V * 4, peaks


def test_bad_token_loss():
    h, w, hr, wr, t, _ = _inputs(6, 4, 4, 16, 16, 2)
    with pytest.raises(ValueError, match=r"token_loss must return a \[4\] tensor"):
        fused_head_loss(h.requires_grad_(True), w, t, chunk_size=4, token_loss=lambda lp, ent, kl, s: lp.sum())
    with pytest.raises(TypeError, match="token_loss must be callable"):
        fused_head_loss(h, w, t, token_loss=None)
    with pytest.raises(ValueError, match="needs ref_weight_local"):
        fused_head_loss(h, w, t, kl="forward", token_loss=lambda lp, ent, kl, s: lp)


@pytest.mark.parametrize("kl", ["forward", "reverse"])
def test_fp32_gradient_error_far_apart_policy_and_reference(kl):
    """fp32, a policy and a reference whose logits differ by thousands (the KL's factor
    log p - log q - KL cancels to a small number where p is large): the gradient's error against
    torch.log_softmax autograd in float64 stays at fp32 rounding of the cancelling terms, as in the
    recomputing head (a formulation that multiplies by p before the cancellation is ~25x worse here)."""
    T, H, V = 24, 8, 300
    h, w, hr, wr, t, _ = _inputs(T, H, H, V, V, 5)
    w[7], wr[5] = 1e3, -1e3  # p and q each far from uniform, and far apart
    token_loss = lambda lp, ent, k, s: lp * 0.5 + k * 0.3 + ent * 0.1  # noqa: E731
    h32, w32 = h.float().requires_grad_(True), w.float().requires_grad_(True)
    fused_head_loss(h32, w32, t, ref_hidden=hr.float(), ref_weight_local=wr.float(), kl=kl, entropy=True,
                    chunk_size=8, token_loss=token_loss)[0].backward()
    h64, w64 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, lq = torch.log_softmax(h64 @ w64.T, -1), torch.log_softmax(hr @ wr.T, -1)
    p, q = lp.exp(), lq.exp()
    kl_v = (p * (lp - lq)).sum(-1) if kl == "forward" else (q * (lq - lp)).sum(-1)
    (token_loss(lp.gather(1, t[:, None])[:, 0], -(p * lp).sum(-1), kl_v, None)).sum().backward()
    for got, want in ((h32.grad, h64.grad), (w32.grad, w64.grad)):
        err = float((got.double() - want).abs().max() / want.abs().max())
        assert err < 2e-5, err  # 4e-6 here; 1e-4 with p d and p (b - a - KL) summed after multiplying
