"""Advantages (GRPO, GAE, whitening, KL shaping) and clipped losses vs float64 python references;
DP-split invariance simulated on one process and on two real gloo ranks."""

import statistics

import pytest
import torch

from rl.objectives.advantages import broadcast_to_tokens, gae, grpo_advantages, kl_shaped_rewards, whiten
from rl.objectives.kl import KLConfig, kl_estimate
from rl.objectives.losses import (
    AGG_MODES,
    LossScale,
    PolicyLossConfig,
    aggregate,
    clipped_surrogate,
    clipped_value_loss,
    loss_scale,
    policy_loss,
)

D = torch.float64

# ---------------------------------------------------------------------------------------------
# GRPO


def test_grpo_vs_python_reference():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(12, generator=g, dtype=D)
    for scale in (True, False):
        adv = grpo_advantages(r, 4, scale_by_std=scale, eps=1e-6)
        for i in range(3):
            grp = r[4 * i: 4 * i + 4].tolist()
            mu, sd = statistics.mean(grp), statistics.stdev(grp)
            for j in range(4):
                want = (grp[j] - mu) / (sd + 1e-6) if scale else grp[j] - mu
                assert abs(float(adv[4 * i + j]) - want) < 1e-12


def test_grpo_zero_variance_and_singleton_groups_are_exactly_zero():
    r = torch.tensor([0.01] * 6 + [1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    assert (r[:6] - r[:6].mean()).abs().max() > 0  # fp32 rounding: naive r - mean is not 0 here
    adv = grpo_advantages(r, 6)
    assert torch.equal(adv[:6], torch.zeros(6))
    assert (adv[6:] != 0).all()
    assert torch.equal(grpo_advantages(torch.tensor([0.3, 1.0, -2.0]), 1), torch.zeros(3))
    assert torch.equal(grpo_advantages(torch.tensor([0.3, 1.0, -2.0]), 1, scale_by_std=False),
                       torch.zeros(3))


def test_grpo_errors():
    with pytest.raises(ValueError, match="prompt 1, sample 2"):
        grpo_advantages(torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, float("nan")]), 3)
    with pytest.raises(ValueError, match="groups of 4"):
        grpo_advantages(torch.zeros(6), 4)


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


# ---------------------------------------------------------------------------------------------
# GAE, whitening, shaping


def _gae_reference(r, v, m, gamma, lam):
    """Plain GAE over each row's valid tokens only, episode ends after the last one."""
    B, S = len(r), len(r[0])
    adv = [[0.0] * S for _ in range(B)]
    ret = [[0.0] * S for _ in range(B)]
    for b in range(B):
        idx = [s for s in range(S) if m[b][s]]
        a_next, v_next = 0.0, 0.0
        for s in reversed(idx):
            delta = r[b][s] + gamma * v_next - v[b][s]
            a_next = delta + gamma * lam * a_next
            adv[b][s], ret[b][s] = a_next, a_next + v[b][s]
            v_next = v[b][s]
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)])
def test_gae_vs_python_loop(gamma, lam):
    g = torch.Generator().manual_seed(1)
    r = torch.randn(4, 7, generator=g, dtype=D)
    v = torch.randn(4, 7, generator=g, dtype=D)
    m = torch.ones(4, 7, dtype=torch.bool)
    m[0, 5:] = False  # right padding of different lengths
    m[1, 2:] = False
    m[2, 3] = False  # a hole (e.g. tool output) inside a response
    m[3, :] = False  # empty row
    adv, ret = gae(r, v, m, gamma, lam)
    want_adv, want_ret = _gae_reference(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=D), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=D), atol=1e-12, rtol=1e-12)


def test_whiten_vs_statistics():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, generator=g, dtype=D) * 3 + 1
    m = torch.rand(3, 5, generator=g) > 0.3
    vals = x[m].tolist()
    mu, sd = statistics.mean(vals), statistics.stdev(vals)
    out = whiten(x, m, eps=0.0)
    torch.testing.assert_close(out[m], (x[m] - mu) / sd, atol=1e-12, rtol=1e-12)
    assert torch.equal(out[~m], torch.zeros(int((~m).sum()), dtype=D))
    torch.testing.assert_close(whiten(x, m, shift_mean=False, eps=0.0)[m], (x[m] - mu) / sd + mu)


def test_kl_shaped_rewards_by_hand():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 9.0, 9.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    out = kl_shaped_rewards(torch.tensor([1.0, 2.0]), kl, m, beta=0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.05, -0.1, -0.15 + 1.0], [-0.25 + 2.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        kl_shaped_rewards(torch.tensor([1.0, 2.0]), kl, torch.tensor([[1, 0, 0], [0, 0, 0]]).bool(), 0.5)


# ---------------------------------------------------------------------------------------------
# surrogate and value losses


def test_on_policy_ratio_is_exactly_one():
    g = torch.Generator().manual_seed(3)
    logp = (torch.randn(3, 6, generator=g) - 2).requires_grad_(True)
    adv = torch.randn(3, 6, generator=g)
    m = torch.rand(3, 6, generator=g) > 0.3
    loss_tok, st = clipped_surrogate(logp, logp.detach(), adv, m)
    assert float(st["ratio_min"]) == 1.0 and float(st["ratio_max"]) == 1.0 and float(st["ratio_mean"]) == 1.0
    assert float(st["clipfrac"]) == 0.0 and float(st["approx_kl_old"]) == 0.0
    loss = aggregate(loss_tok, m)
    loss.backward()
    n = int(m.sum())
    torch.testing.assert_close(logp.grad, torch.where(m, -adv / n, torch.zeros(())))  # d(-A r)/dlogp = -A


def test_clipping_engages_on_crafted_ratios():
    ratios = torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.1, 5.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0]], dtype=D)
    logp = torch.log(ratios).requires_grad_(True)
    old = torch.zeros_like(ratios)
    m = torch.ones_like(ratios, dtype=torch.bool)
    loss, st = clipped_surrogate(logp, old, adv, m, clip_low=0.2)
    # -A*r vs -A*clip(r, .8, 1.2), take the max
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 1.5, 0.8, -1.1, 5.0]], dtype=D))
    assert float(st["clipfrac"]) == pytest.approx(2 / 6)
    (gr,) = torch.autograd.grad(loss.sum(), logp)
    # clipped tokens pass no gradient; others d(-A r)/dlogp = -A r
    torch.testing.assert_close(gr, torch.tensor([[0.0, -0.5, 1.5, 0.0, -1.1, 5.0]], dtype=D))
    # asymmetric clip-higher: 1.5 is inside [0.8, 1.6]
    loss_h, st_h = clipped_surrogate(logp, old, adv, m, clip_low=0.2, clip_high=0.6)
    assert float(loss_h[0, 0].detach()) == pytest.approx(-1.5) and float(st_h["clipfrac"]) == pytest.approx(1 / 6)
    # dual clip c=3: A<0 tokens capped at 3|A|
    loss_d, st_d = clipped_surrogate(logp, old, adv, m, clip_low=0.2, dual_clip=3.0)
    torch.testing.assert_close(loss_d, torch.tensor([[-1.2, -0.5, 1.5, 0.8, -1.1, 3.0]], dtype=D))
    assert float(st_d["dual_clipfrac"]) == pytest.approx(1 / 6)
    (gd,) = torch.autograd.grad(loss_d.sum(), logp)
    assert float(gd[0, 5]) == 0.0
    assert float(st["ratio_max"]) == pytest.approx(5.0) and float(st["ratio_min"]) == pytest.approx(0.5)


def test_value_loss_by_hand():
    v = torch.tensor([[1.0, 1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0]])
    ret = torch.tensor([[2.0, -1.0, 5.0]])
    m = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, st = clipped_value_loss(v, old, ret, m, clip=0.2)
    # token 0: unclipped (1-2)^2=1, clipped (0.2-2)^2=3.24 -> 1.62; token 1: 4 vs 1.44 -> 2.0
    torch.testing.assert_close(loss, torch.tensor([[1.62, 2.0, 0.0]]))
    assert float(st["vf_clipfrac"]) == pytest.approx(0.5)
    loss_u, _ = clipped_value_loss(v, old, ret, m, clip=None)
    torch.testing.assert_close(loss_u, torch.tensor([[0.5, 2.0, 0.0]]))


# ---------------------------------------------------------------------------------------------
# aggregation and DP-split invariance


def _agg_reference(x, m, mode, norm_len):
    rows = [[x[b][s] for s in range(len(x[b])) if m[b][s]] for b in range(len(x))]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        n = sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / max(n, 1)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / max(len(nonempty), 1)
    return sum(sum(r) / norm_len for r in nonempty) / max(len(nonempty), 1)


def _batch(seed, B=8, S=6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, generator=g, dtype=D)
    m = torch.rand(B, S, generator=g) > 0.4
    m[3] = False  # an empty row
    m[5] = True
    return x, m


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_vs_reference(mode):
    x, m = _batch(4)
    x[~m] = float("nan")  # padding may hold anything
    got = aggregate(x, m, mode, norm_len=10.0)
    assert abs(float(got) - _agg_reference(x.tolist(), m.tolist(), mode, 10.0)) < 1e-12


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("n_splits", [1, 2, 4])
def test_split_invariance_simulated(mode, n_splits):
    x, m = _batch(5)
    xf = x.clone().requires_grad_(True)
    full = aggregate(xf, m, mode, norm_len=6.0)
    full.backward()
    scale = loss_scale(list(m.chunk(n_splits)))  # global counts, as all ranks would all-reduce
    grads, losses = [], []
    for xs, ms in zip(x.chunk(n_splits), m.chunk(n_splits)):
        xs = xs.clone().requires_grad_(True)
        loss = aggregate(xs, ms, mode, scale, norm_len=6.0)
        loss.backward()
        grads.append(xs.grad)
        losses.append(loss)
    # kltron's FSDP sums the ranks' gradients: the per-split grads together are the full grad
    torch.testing.assert_close(torch.cat(grads), xf.grad, atol=1e-14, rtol=1e-12)
    torch.testing.assert_close(sum(losses), full.detach(), atol=1e-14, rtol=1e-12)


def test_empty_masks_finite_zero_gradient():
    logp = torch.full((2, 4), float("nan"), requires_grad=True)  # padding garbage everywhere
    none = torch.zeros(2, 4, dtype=torch.bool)
    for mode in AGG_MODES:
        loss, st = policy_loss(logp, logp.detach(), torch.ones(2, 4), none,
                               PolicyLossConfig(agg=mode, norm_len=4.0))
        assert float(loss.detach()) == 0.0 and float(st["valid_tokens"]) == 0.0
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.equal(g, torch.zeros(2, 4))
    # some rows empty: they get zero gradient, the others the usual one
    lp = torch.randn(3, 4).requires_grad_(True)
    lp_data = lp.detach().clone()
    lp_data[1] = float("nan")
    lp2 = lp_data.requires_grad_(True)
    m = torch.ones(3, 4, dtype=torch.bool)
    m[1] = False
    loss, _ = policy_loss(lp2, lp2.detach(), torch.ones(3, 4), m)
    (g,) = torch.autograd.grad(loss, lp2)
    assert torch.isfinite(loss) and torch.equal(g[1], torch.zeros(4))
    torch.testing.assert_close(g[[0, 2]], torch.full((2, 4), -1 / 8))


def test_policy_loss_combines_terms():
    g = torch.Generator().manual_seed(6)
    logp = (torch.randn(2, 5, generator=g, dtype=D) - 1).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(2, 5, generator=g, dtype=D)
    ref = logp.detach() + 0.3 * torch.randn(2, 5, generator=g, dtype=D)
    adv = torch.randn(2, 5, generator=g, dtype=D)
    ent = torch.rand(2, 5, generator=g, dtype=D).requires_grad_(True)
    m = torch.ones(2, 5, dtype=torch.bool)
    m[1, 3:] = False
    cfg = PolicyLossConfig(entropy_coef=0.01, agg="seq-mean-token-mean")
    loss, st = policy_loss(logp, old, adv, m, cfg, kl_cfg=KLConfig(estimator="k3+"), beta=0.2,
                           ref_logp=ref, entropy=ent)
    pg, _ = clipped_surrogate(logp, old, adv, m)
    w = torch.exp(logp.detach() - old)  # kl.is_weight="detached" (default): importance weight pi/pi_old
    want = (aggregate(pg, m, cfg.agg) + 0.2 * aggregate(w * kl_estimate(logp, ref, "k3+"), m, cfg.agg)
            - 0.01 * aggregate(ent, m, cfg.agg))
    torch.testing.assert_close(loss, want, atol=1e-12, rtol=1e-12)
    assert set(st) >= {"pg_loss", "kl_loss", "entropy", "clipfrac", "ratio_mean", "approx_kl_old"}
    # KL in the reward: reported, not added
    loss_r, st_r = policy_loss(logp, old, adv, m, cfg, kl_cfg=KLConfig(where="reward"), beta=0.2,
                               ref_logp=ref, entropy=ent)
    torch.testing.assert_close(loss_r, want - 0.2 * aggregate(w * kl_estimate(logp, ref, "k3+"), m, cfg.agg))
    # exact KL passed in directly
    kl_exact = torch.rand(2, 5, dtype=D, requires_grad=True)
    loss_e, _ = policy_loss(logp, old, adv, m, kl_cfg=KLConfig(exact=True), beta=0.5, kl=kl_exact)
    torch.testing.assert_close(loss_e, aggregate(pg, m) + 0.5 * aggregate(kl_exact, m))
    # exact KL in the reward: its current-token (pathwise) part enters the loss (kl_place.py); it needs the KL
    loss_x, _ = policy_loss(logp, old, adv, m, kl_cfg=KLConfig(exact=True, where="reward"), beta=0.5, kl=kl_exact)
    torch.testing.assert_close(loss_x, aggregate(pg, m) + 0.5 * aggregate(kl_exact, m))
    with pytest.raises(ValueError, match="kl.where='reward' needs the per-token `kl`.*exact"):
        policy_loss(logp, old, adv, m, kl_cfg=KLConfig(exact=True, where="reward"), beta=0.5, ref_logp=ref)
    with pytest.raises(ValueError, match="exact KL"):
        policy_loss(logp, old, adv, m, kl_cfg=KLConfig(exact=True), beta=0.5, ref_logp=ref)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, m, kl_cfg=KLConfig(), beta=0.1)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, old, adv, m, cfg)
    with pytest.raises(ValueError, match="norm_len"):
        PolicyLossConfig(agg="seq-mean-token-sum-norm")


# ---------------------------------------------------------------------------------------------
# two real gloo ranks


def _dp_rank_step(mode):
    import torch.distributed as dist

    from parallel import comm

    r = dist.get_rank()
    lp, old, adv, m = _loss_batch()
    mine = slice(4 * r, 4 * r + 4)
    micro = [(mine.start, mine.start + 1), (mine.start + 1, mine.stop)]  # two uneven micro-batches
    with comm.count_comm() as c:
        scale = loss_scale([m[a:b] for a, b in micro], dist.group.WORLD)
    grads, total = [], 0.0
    for a, b in micro:
        x = lp[a:b].clone().requires_grad_(True)
        loss, _ = policy_loss(x, old[a:b], adv[a:b], m[a:b], PolicyLossConfig(agg=mode, norm_len=6.0),
                              scale=scale)
        loss.backward()
        grads.append(x.grad)
        total += float(loss)
    w = whiten(adv[mine], m[mine], dp_group=dist.group.WORLD)
    return torch.cat(grads), total, scale, c.calls, w


def _loss_batch():
    g = torch.Generator().manual_seed(7)
    lp = torch.randn(8, 6, generator=g, dtype=D) - 1
    old = lp + 0.3 * torch.randn(8, 6, generator=g, dtype=D)
    adv = torch.randn(8, 6, generator=g, dtype=D)
    m = torch.rand(8, 6, generator=g) > 0.3
    m[1] = False
    m[4:, 4:] = False  # rank 1 holds fewer tokens
    return lp, old, adv, m


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_dp_two_ranks_gradient_equals_full_batch(dist_pools, mode):
    lp, old, adv, m = _loss_batch()
    x = lp.clone().requires_grad_(True)
    full, _ = policy_loss(x, old, adv, m, PolicyLossConfig(agg=mode, norm_len=6.0))
    full.backward()
    res = dist_pools.run(2, _dp_rank_step, mode)
    # FSDP's sum over the two ranks' gradients
    torch.testing.assert_close(torch.cat([res[0][0], res[1][0]]), x.grad, atol=1e-14, rtol=1e-12)
    assert abs(res[0][1] + res[1][1] - float(full.detach())) < 1e-12
    assert res[0][2] == LossScale(int(m.sum()), int(m.any(-1).sum())) and res[0][3] == 1
    torch.testing.assert_close(torch.cat([res[0][4], res[1][4]]), whiten(adv, m), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_token_weights_and_token_loss_match_aggregate(mode):
    from rl.objectives.kl import KLConfig
    from rl.objectives.losses import token_policy_loss, token_weights

    lp, old, adv, m = _loss_batch()
    ref = lp - 0.2
    ent = torch.rand(lp.shape, dtype=D)
    scale = LossScale(int(m.sum()) + 7, int(m.any(-1).sum()) + 2)  # counts of a larger global batch
    x = torch.randn(lp.shape, dtype=D)
    w = token_weights(m, mode, scale, norm_len=6.0)
    assert abs(float((w.double() * x).sum()) - float(aggregate(x, m, mode, scale, norm_len=6.0))) < 1e-6
    cfg = PolicyLossConfig(agg=mode, norm_len=6.0, entropy_coef=0.01, dual_clip=3.0)
    kl_cfg = KLConfig(estimator="k3+", where="loss")
    a = lp.clone().requires_grad_(True)
    want, _ = policy_loss(a, old, adv, m, cfg, kl_cfg=kl_cfg, beta=0.1, ref_logp=ref, entropy=ent, scale=scale)
    want.backward()
    b = lp.clone().requires_grad_(True)
    fn = token_policy_loss(cfg, w.double(), m, old, adv, kl_cfg=kl_cfg, beta=0.1, ref_logp=ref)
    tokens = torch.arange(lp.numel())
    got = sum(fn(b.reshape(-1)[c], ent.reshape(-1)[c], None, c).sum() for c in tokens.chunk(3))
    got.backward()
    # the weights are fp32 (as the fp32 log-probs they multiply): agreement to fp32 rounding
    assert abs(float(got.detach()) - float(want.detach())) < 1e-6
    torch.testing.assert_close(b.grad, a.grad, atol=1e-8, rtol=1e-6)
