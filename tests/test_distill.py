"""Distillation divergences from the fused heads (parallel/distill_head.py) against float64 formulas
on full materialised logits written here, student and teacher of different hidden widths, at tp 1, 2
(and 4, slow); padded vocabulary columns (NaN in the student's and teacher's head) and masked tokens
(NaN hidden states) never reach a value or a gradient."""

import pytest
import torch

from parallel import comm
from parallel.distill_head import distill_divergence

V, VP, HS, HT = 37, 48, 6, 11  # vocabulary, padded (divisible by 4), student and teacher widths


def _inputs(T, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, HS, generator=g, dtype=torch.float64)
    w = torch.randn(VP, HS, generator=g, dtype=torch.float64) * 0.8
    ht = torch.randn(T, HT, generator=g, dtype=torch.float64)
    wt = torch.randn(VP, HT, generator=g, dtype=torch.float64) * 0.6
    coef = torch.rand(T, generator=g, dtype=torch.float64) + 0.5
    mask = torch.ones(T, dtype=torch.bool)
    mask[T // 3] = False
    return h, w, ht, wt, coef, mask


def reference(h, w, ht, wt, kind, beta, tau, tau_t):
    """The divergence [T] from full [T, V] float64 logits (padded columns cut off first)."""
    ls = torch.log_softmax((h @ w[:V].T) / tau, -1)
    lt = torch.log_softmax((ht @ wt[:V].T) / tau_t, -1)
    S, P = ls.exp(), lt.exp()
    if kind == "reverse_kl":
        return (S * (ls - lt)).sum(-1)
    if kind == "forward_kl":
        return (P * (lt - ls)).sum(-1)
    M = beta * P + (1 - beta) * S
    return beta * (P * (lt - M.log())).sum(-1) + (1 - beta) * (S * (ls - M.log())).sum(-1)


def _poison(h, w, ht, wt, mask):
    """NaN in padded head rows and in masked tokens' hidden states."""
    h, w, ht, wt = h.clone(), w.clone(), ht.clone(), wt.clone()
    w[V:], wt[V:] = float("nan"), float("nan")
    h[~mask], ht[~mask] = float("nan"), float("nan")
    return h, w, ht, wt


CASES = [("reverse_kl", 0.5, 1.0, 1.0), ("forward_kl", 0.5, 0.7, 1.3), ("jsd", 0.5, 1.0, 1.0),
         ("jsd", 0.1, 0.8, 2.0), ("jsd", 0.9, 1.2, 0.6)]


def _check(tp, group, rank, seed):
    T = 13
    h, w, ht, wt, coef, mask = _inputs(T, seed)
    width = VP // tp
    rows = slice(rank * width, (rank + 1) * width)
    for kind, beta, tau, tau_t in CASES:
        hf, wf = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ref = reference(hf, wf, ht, wt, kind, beta, tau, tau_t) * mask
        gh_ref, gw_ref = torch.autograd.grad((ref * coef).sum(), [hf, wf])
        ph, pw, pht, pwt = _poison(h, w, ht, wt, mask)
        hl, wl = ph.clone().requires_grad_(True), pw[rows].clone().requires_grad_(True)
        htl = pht.clone().requires_grad_(True)
        out = distill_divergence(comm.copy_to_tp(hl, group), wl, htl, pwt[rows], group, kind=kind, beta=beta,
                                 vocab_size=V, temperature=tau, teacher_temperature=tau_t, chunk_size=4, mask=mask)
        gh, gw = torch.autograd.grad((out * coef).sum(), [hl, wl])
        msg = f"{kind} beta={beta} tau={tau} tau_t={tau_t} tp={tp}"
        torch.testing.assert_close(out, ref.detach(), atol=1e-11, rtol=1e-10, msg=msg)
        assert (out[mask] > 0).all(), msg
        torch.testing.assert_close(gh, gh_ref, atol=1e-11, rtol=1e-10, msg=msg)
        gw_exp = gw_ref[rows].clone()
        torch.testing.assert_close(gw, gw_exp, atol=1e-11, rtol=1e-10, msg=msg)
        assert htl.grad is None
    return True


def test_divergences_tp1():
    assert _check(1, None, 0, 3)


def test_teacher_identical_gives_zero():
    h, w, _, _, _, _ = _inputs(7, 1)
    for kind in ("reverse_kl", "forward_kl", "jsd"):
        out = distill_divergence(h, w, h, w, kind=kind, vocab_size=V)
        assert out.abs().max() < 1e-12, kind


def _tp_worker(tp, seed):
    import torch.distributed as dist

    group = dist.group.WORLD if tp == dist.get_world_size() else None
    return _check(tp, group, dist.get_rank(), seed)


def test_divergences_tp2(dist_pools):
    assert dist_pools.run(2, _tp_worker, 2, 5) == [True, True]


@pytest.mark.slow
def test_divergences_tp4(dist_pools):
    assert dist_pools.run(4, _tp_worker, 4, 6) == [True] * 4


def test_bad_inputs():
    h, w, ht, wt, _, _ = _inputs(5, 0)
    with pytest.raises(ValueError, match="kind"):
        distill_divergence(h, w, ht, wt, kind="tvd")
    with pytest.raises(ValueError, match="beta"):
        distill_divergence(h, w, ht, wt, kind="jsd", beta=1.0)
    with pytest.raises(ValueError, match="vocabulary rows"):
        distill_divergence(h, w, ht, wt[:40])


def _check_topk(tp, group, rank, seed):
    """teacher_topk and topk_cross_entropy against torch.topk / log_softmax on the full float64 logits."""
    from parallel.distill_topk import teacher_topk, topk_cross_entropy

    T, k, tau, tau_t = 9, 5, 0.9, 1.4
    h, w, ht, wt, coef, mask = _inputs(T, seed)
    width = VP // tp
    rows = slice(rank * width, (rank + 1) * width)
    zt = (ht @ wt[:V].T) / tau_t
    top, ids_ref = zt.topk(k, dim=1)
    probs_ref = torch.softmax(top, 1)
    ph, pw, pht, pwt = _poison(h, w, ht, wt, torch.ones(T, dtype=torch.bool))
    ids, probs = teacher_topk(pht, pwt[rows], k, group, vocab_size=V, temperature=tau_t, chunk_size=4)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(probs, probs_ref, atol=1e-12, rtol=1e-12)
    hf, wf = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = -(probs_ref * torch.log_softmax((hf @ wf[:V].T) / tau, -1).gather(1, ids_ref)).sum(1) * mask
    gh_ref, gw_ref = torch.autograd.grad((ref * coef).sum(), [hf, wf])
    ph[~mask] = float("nan")
    hl, wl = ph.clone().requires_grad_(True), pw[rows].clone().requires_grad_(True)
    out = topk_cross_entropy(comm.copy_to_tp(hl, group), wl, ids, probs, group, vocab_size=V, temperature=tau,
                             chunk_size=4, mask=mask)
    gh, gw = torch.autograd.grad((out * coef).sum(), [hl, wl])
    torch.testing.assert_close(out, ref.detach(), atol=1e-11, rtol=1e-10)
    torch.testing.assert_close(gh, gh_ref, atol=1e-11, rtol=1e-10)
    torch.testing.assert_close(gw, gw_ref[rows], atol=1e-11, rtol=1e-10)
    return True


def _topk_worker(tp, seed):
    import torch.distributed as dist

    return _check_topk(tp, dist.group.WORLD, dist.get_rank(), seed)


def test_topk_tp1():
    assert _check_topk(1, None, 0, 2)


def test_topk_tp2(dist_pools):
    assert dist_pools.run(2, _topk_worker, 2, 4) == [True, True]


def test_kl_memory_distillation_rows():
    """tools.kl_memory's distillation methods compute what they claim (against the float64 formulas above, a
    teacher of another width), and project at a small shape without allocating."""
    from tools.klcost.distill_methods import TOP_K
    from tools.klcost.methods import Inputs, outputs
    from tools.klcost.project import project

    x = Inputs(16, 8, 50, 1, 0, torch.float64, 0, True, ref_hidden=12)
    ls = torch.log_softmax(x.h.detach() @ x.w.detach()[:50].T, -1)
    lt = torch.log_softmax(x.hr @ x.wr[:50].T, -1)
    S, P = ls.exp(), lt.exp()
    M = (0.5 * P + 0.5 * S).log()
    top, ids = lt.topk(TOP_K, dim=1)
    jsd = 0.5 * (P * (lt - M)).sum(-1) + 0.5 * (S * (ls - M)).sum(-1)
    want = {"distill_fused_loss": (S * (ls - lt)).sum(-1), "distill_jsd_call": jsd,
            "distill_jsd": jsd,
            "distill_topk": -(torch.softmax(top, 1) * ls.gather(1, ids)).sum(1)}
    for name, ref in want.items():
        (logp, _, term), loss = outputs(name, x, None, 4, True)
        torch.testing.assert_close(term.detach(), ref, atol=1e-12, rtol=1e-10, msg=name)
        torch.testing.assert_close(logp.detach(), ls.gather(1, x.t[:, None])[:, 0], atol=1e-12, rtol=1e-10)
        loss.backward()
        assert torch.isfinite(x.h.grad).all()
        x.h.grad = x.w.grad = None
    peaks = {n: project(n, "forward+backward", 512, 64, 4096, 1, "bf16", None, ref_hidden=128)["peak_bytes"]
             for n in ("gather", "distill_fused_loss", "distill_jsd", "distill_jsd_call")}
    assert 0 < max(peaks["distill_fused_loss"], peaks["distill_jsd"]) < peaks["gather"]
    assert peaks["distill_jsd"] <= 1.05 * peaks["distill_fused_loss"], peaks  # the JSD costs what the fused KL does
    # the JSD as the loss head's chunk term holds no second weight-gradient buffer (fp32 [4096, 64], 1 MiB)
    assert peaks["distill_jsd_call"] - peaks["distill_jsd"] >= 4096 * 64 * 4, peaks


def _check_in_loss_head(tp, group, rank, seed):
    """Every distillation term folded into the loss-inside head (parallel/distill_chunk.py through
    fused_head_loss's `extra`), beside a policy-gradient loss and (kl_q) an exact reference KL in the same
    head: the loss and the gradients of hidden and head weight against float64 autograd on full logits."""
    from parallel.distill_chunk import DistillChunkTerm
    from parallel.distill_topk import teacher_topk
    from parallel.fused_loss import fused_head_loss

    T, k = 13, 5
    h, w, ht, wt, coef, mask = _inputs(T, seed)
    g = torch.Generator().manual_seed(seed + 100)
    t = torch.randint(0, V, (T,), generator=g)
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    hq, wq = torch.randn(T, HS, generator=g, dtype=torch.float64), torch.randn(VP, HS, generator=g, dtype=torch.float64)
    width = VP // tp
    rows = slice(rank * width, (rank + 1) * width)
    cases = CASES + [("topk_forward_kl", 0.5, 0.9, 1.4)]
    for (kind, beta, tau, tau_t), kl_q in [(c, q) for c in cases for q in (None, "forward")]:
        hf, wf = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp = torch.log_softmax((hf @ wf[:V].T) / tau, -1)
        pol = -(adv * lp.gather(1, t[:, None])[:, 0])
        if kl_q:  # 0.3 KL(pi || ref) per token
            lq = torch.log_softmax((hq @ wq[:V].T) / tau, -1)
            pol = pol + 0.3 * (lp.exp() * (lp - lq)).sum(-1)
        if kind == "topk_forward_kl":
            top, ids = ((ht @ wt[:V].T) / tau_t).topk(k, dim=1)
            div = -(torch.softmax(top, 1) * lp.gather(1, ids)).sum(1)
        else:
            div = reference(hf, wf, ht, wt, kind, beta, tau, tau_t)
        ref = ((pol + coef * div) * mask).sum()
        gh_ref, gw_ref = torch.autograd.grad(ref, [hf, wf])
        ph, pw, pht, pwt = _poison(h, w, ht, wt, mask)
        topk = None
        if kind == "topk_forward_kl":
            topk = teacher_topk(torch.where(mask[:, None], pht, 0.0), pwt[rows], k, group, vocab_size=V,
                                temperature=tau_t, chunk_size=4)
        term = DistillChunkTerm(kind, coef / 2, pht * (tau / tau_t), pwt[rows], topk=topk, beta=beta, coef=2.0)
        hl, wl = ph.clone().requires_grad_(True), pw[rows].clone().requires_grad_(True)

        def token_loss(logp, entropy, kl, tokens):
            out = -(adv[tokens] * logp)
            return out if kl is None else out + 0.3 * kl

        loss, _ = fused_head_loss(comm.copy_to_tp(hl, group), wl, t, group, token_loss=token_loss, vocab_size=V,
                                  temperature=tau, chunk_size=4, entropy=False, mask=mask, extra=term, kl=kl_q,
                                  ref_hidden=hq if kl_q else None, ref_weight_local=wq[rows] if kl_q else None)
        loss.backward()
        msg = f"{kind} beta={beta} tau={tau} tau_t={tau_t} tp={tp} kl={kl_q}"
        torch.testing.assert_close(loss.detach(), ref.detach(), atol=1e-11, rtol=1e-10, msg=msg)
        torch.testing.assert_close(term.values, (div * mask).detach(), atol=1e-11, rtol=1e-10, msg=msg)
        torch.testing.assert_close(hl.grad, gh_ref, atol=1e-11, rtol=1e-10, msg=msg)
        torch.testing.assert_close(wl.grad, gw_ref[rows], atol=1e-11, rtol=1e-10, msg=msg)
    return True


def _in_loss_head_worker(tp, seed):
    import torch.distributed as dist

    return _check_in_loss_head(tp, dist.group.WORLD, dist.get_rank(), seed)


def test_terms_in_the_loss_head_tp1():
    assert _check_in_loss_head(1, None, 0, 7)


def test_terms_in_the_loss_head_tp2(dist_pools):
    assert dist_pools.run(2, _in_loss_head_worker, 2, 8) == [True, True]
