"""KL estimators by exact enumeration on a small categorical policy; masked aggregation vs numpy."""

import math

import numpy as np
import pytest
import torch

from rl.objectives.kl import ESTIMATORS, KLConfig, kl_by_position, kl_estimate, kl_quantiles, masked_mean, masked_sum

K = 5  # outcomes of the categorical policy


def _policy(seed):
    g = torch.Generator().manual_seed(seed)
    theta = (torch.randn(K, generator=g, dtype=torch.float64) * 1.5).requires_grad_(True)
    ref_logp = torch.log_softmax(torch.randn(K, generator=g, dtype=torch.float64), 0)
    return theta, ref_logp


def _expected_grad(theta, ref_logp, estimator, direction="pi_ref"):
    """E_{x~pi}[grad k(x)] by enumerating x, pi held fixed (on-policy sampling)."""
    logp = torch.log_softmax(theta, 0)
    k = kl_estimate(logp[None], ref_logp[None], estimator, direction=direction)[0]  # [K]
    (grad,) = torch.autograd.grad((logp.exp().detach() * k).sum(), theta)
    return grad


def _analytic(theta, ref_logp):
    """Closed forms: KL(pi||ref), KL(ref||pi) and their gradients w.r.t. the logits."""
    logp = torch.log_softmax(theta.detach(), 0)
    p, q = logp.exp(), ref_logp.exp()
    fwd = (p * (logp - ref_logp)).sum()
    rev = (q * (ref_logp - logp)).sum()
    grad_fwd = p * (logp - ref_logp - fwd)  # d/dtheta sum p log(p/q)
    grad_rev = p - q  # d/dtheta -sum q log p
    return fwd, rev, grad_fwd, grad_rev


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradients_as_loss_by_enumeration(seed):
    theta, ref_logp = _policy(seed)
    fwd, rev, grad_fwd, grad_rev = _analytic(theta, ref_logp)
    assert grad_fwd.abs().max() > 1e-2 and (grad_fwd - grad_rev).abs().max() > 1e-2  # distinguishable
    for est in ("k2", "k1+", "k3+"):
        torch.testing.assert_close(_expected_grad(theta, ref_logp, est), grad_fwd, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(_expected_grad(theta, ref_logp, "k1"), torch.zeros(K, dtype=torch.float64),
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(_expected_grad(theta, ref_logp, "k3"), grad_rev, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("seed", [0, 3])
def test_unbiased_values_by_enumeration(seed):
    theta, ref_logp = _policy(seed)
    logp = torch.log_softmax(theta.detach(), 0)
    p = logp.exp()
    fwd, rev, _, _ = _analytic(theta, ref_logp)
    mean = lambda est, d="pi_ref": (p * kl_estimate(logp[None], ref_logp[None], est, direction=d)[0]).sum()
    for est in ("k1", "k3", "k1+", "k3+"):
        torch.testing.assert_close(mean(est), fwd, atol=1e-12, rtol=1e-12)
    assert abs(float(mean("k2") - fwd)) > 1e-4  # k2 is biased
    for est in ("k1", "k3"):
        torch.testing.assert_close(mean(est, "ref_pi"), rev, atol=1e-12, rtol=1e-12)


def test_sampled_mean_within_standard_error():
    theta, ref_logp = _policy(4)
    logp = torch.log_softmax(theta.detach(), 0)
    fwd, _, _, _ = _analytic(theta, ref_logp)
    n = 20000
    x = torch.multinomial(logp.exp(), n, replacement=True, generator=torch.Generator().manual_seed(0))
    for est in ("k1", "k3"):
        vals = kl_estimate(logp[x][None], ref_logp[x][None], est)[0]
        per = kl_estimate(logp[None], ref_logp[None], est)[0]
        sd = math.sqrt(float((logp.exp() * (per - fwd) ** 2).sum()))  # exact std of one sample
        assert abs(float(vals.mean()) - float(fwd)) < 4 * sd / math.sqrt(n), est


def test_signs_and_identical_policies():
    g = torch.Generator().manual_seed(5)
    logp = torch.randn(4, 9, generator=g) * 3
    ref = torch.randn(4, 9, generator=g) * 3
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert (kl_estimate(logp, ref, "k3", direction="ref_pi") >= 0).all()
    assert (kl_estimate(logp, ref, "k1") < 0).any()  # k1 keeps its sign
    same = logp.clone()
    for est in ESTIMATORS:
        assert torch.equal(kl_estimate(logp, same, est), torch.zeros_like(logp)), est
    for est in ("k1", "k3"):
        assert torch.equal(kl_estimate(logp, same, est, direction="ref_pi"), torch.zeros_like(logp))


def test_straight_through_value_of_base_gradient_of_k2_per_token():
    g = torch.Generator().manual_seed(6)
    logp = torch.randn(3, 7, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.randn(3, 7, generator=g, dtype=torch.float64)
    lr = (logp - ref).detach()
    for est, base in (("k1+", lr), ("k3+", torch.exp(-lr) - 1 + lr)):
        val = kl_estimate(logp, ref, est)
        torch.testing.assert_close(val.detach(), base, atol=1e-12, rtol=1e-12)
        (grad,) = torch.autograd.grad(val.sum(), logp)
        torch.testing.assert_close(grad, lr, atol=1e-12, rtol=1e-12)  # d/dlogp of 0.5 * lr**2


def test_clamps_by_hand():
    logp = torch.tensor([[30.0, -30.0, 0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.zeros(1, 3, dtype=torch.float64)
    k1 = kl_estimate(logp, ref, "k1", log_ratio_clamp=20.0)
    assert k1.tolist() == [[20.0, -20.0, 0.5]]
    k3 = kl_estimate(logp, ref, "low_var_kl")  # verl: log-ratio to +-20, value to +-10
    want = [min(math.exp(-lr) - 1 + lr, 10.0) for lr in (20.0, -20.0, 0.5)]
    torch.testing.assert_close(k3[0], torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=1e-12)
    (g,) = torch.autograd.grad(k3.sum(), logp)
    assert g[0, 0] == 0 and g[0, 1] == 0  # clamped tokens pass no gradient
    torch.testing.assert_close(g[0, 2], torch.tensor(1 - math.exp(-0.5), dtype=torch.float64))


def test_dtype_and_errors():
    lp = torch.randn(2, 3).bfloat16()
    assert kl_estimate(lp, lp * 0.5, "k3").dtype == torch.float32
    assert kl_estimate(lp.double(), lp.double(), "k3").dtype == torch.float64
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, lp, "k4")
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
        kl_estimate(lp, lp.t(), "k1")
    with pytest.raises(ValueError, match="ref_pi"):
        kl_estimate(lp, lp, "k2", direction="ref_pi")
    with pytest.raises(ValueError, match="kl.estimator"):
        KLConfig(estimator="k5")
    with pytest.raises(ValueError, match="kl.where"):
        KLConfig(where="both")
    with pytest.raises(ValueError, match="ref_pi"):
        KLConfig(direction="ref_pi", estimator="k3+")
    KLConfig(direction="ref_pi", exact=True, estimator="k3+")  # exact KL has both directions


def _ref_masked(values, mask):
    vs = [float(v) for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]
    return vs


def test_masked_sum_mean_ignore_nan_padding():
    g = torch.Generator().manual_seed(7)
    v = torch.randn(3, 6, generator=g).bfloat16()
    mask = torch.rand(3, 6, generator=g) > 0.4
    v[~mask] = float("nan")
    vs = _ref_masked(v.float(), mask)
    assert abs(float(masked_sum(v, mask)) - sum(vs)) < 1e-5
    assert abs(float(masked_mean(v, mask)) - sum(vs) / len(vs)) < 1e-5
    assert masked_sum(v, mask).dtype == torch.float32
    rows = masked_mean(v, mask, dim=1)
    for b in range(3):
        r = _ref_masked(v[b].float(), mask[b])
        assert abs(float(rows[b]) - (sum(r) / len(r) if r else 0.0)) < 1e-5
    empty = torch.zeros_like(mask)
    assert float(masked_mean(v, empty)) == 0.0 and float(masked_sum(v, empty)) == 0.0


def test_quantiles_vs_numpy_and_positions_vs_loop():
    g = torch.Generator().manual_seed(8)
    v = torch.rand(5, 13, generator=g) * 4
    mask = torch.rand(5, 13, generator=g) > 0.3
    vs = np.array(_ref_masked(v, mask))
    q = kl_quantiles(v, mask, qs=(0.5, 0.9, 0.99, 0.999))
    for key, qq in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999)):
        assert abs(q[key] - float(np.quantile(vs, qq))) < 1e-5, key
    assert q["max"] == pytest.approx(vs.max(), abs=1e-6) and q["count"] == len(vs)
    top = np.sort(vs)[::-1][:int(np.ceil(0.01 * len(vs)))]  # the largest 1% of tokens, float64
    assert q["top1_share"] == pytest.approx(top.sum() / vs.sum(), rel=1e-6)
    spiky = v.clone()
    spiky[0, 0], spiky[1, 1] = -3.0, 500.0  # one token carries most of the KL; a negative one does not count
    sv = np.clip(np.array(_ref_masked(spiky, mask | (torch.arange(13) < 2))), 0, None)
    got = kl_quantiles(spiky, mask | (torch.arange(13) < 2))["top1_share"]
    assert got == pytest.approx(np.sort(sv)[::-1][:int(np.ceil(0.01 * len(sv)))].sum() / sv.sum(), rel=1e-6)
    assert kl_quantiles(v, torch.zeros_like(mask)) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0,
                                                       "top1_share": 0.0, "count": 0}
    mean, count = kl_by_position(v, mask, n_buckets=4, max_len=16)
    sums, cnts = [0.0] * 4, [0] * 4
    for b in range(5):
        for s in range(13):
            if mask[b, s]:
                sums[s * 4 // 16] += float(v[b, s])
                cnts[s * 4 // 16] += 1
    assert count.tolist() == cnts
    for i in range(4):
        assert abs(float(mean[i]) - (sums[i] / cnts[i] if cnts[i] else 0.0)) < 1e-5
    with pytest.raises(ValueError, match="max_len=8"):
        kl_by_position(v, mask, 4, max_len=8)


def _dp_aggregation(seed):
    import torch.distributed as dist

    from parallel import comm

    r = dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    v = torch.rand(4, 10, generator=g) * 3  # same full data on every rank
    mask = torch.rand(4, 10, generator=g) > 0.5
    mask[2:, 7:] = False  # ranks get uneven numbers of valid tokens
    mine = slice(2 * r, 2 * r + 2)
    with comm.count_comm() as c:
        q = kl_quantiles(v[mine], mask[mine], dp_group=dist.group.WORLD)
        mean = masked_mean(v[mine], mask[mine], dp_group=dist.group.WORLD)
        s = masked_sum(v[mine], mask[mine], dp_group=dist.group.WORLD)
        pos, cnt = kl_by_position(v[mine], mask[mine], 3, max_len=10, dp_group=dist.group.WORLD)
    return q, float(mean), float(s), pos.tolist(), cnt.tolist(), c.calls


def test_global_over_dp_two_ranks(dist_pools):
    g = torch.Generator().manual_seed(9)
    v = torch.rand(4, 10, generator=g) * 3
    mask = torch.rand(4, 10, generator=g) > 0.5
    mask[2:, 7:] = False
    vs = np.array(_ref_masked(v, mask))
    pos, cnt = kl_by_position(v, mask, 3, max_len=10)
    res = dist_pools.run(2, _dp_aggregation, 9)
    for q, mean, s, p, c, calls in res:
        assert q["count"] == len(vs)
        for key, qq in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            assert abs(q[key] - float(np.quantile(vs, qq))) < 1e-5
        assert abs(mean - vs.mean()) < 1e-5 and abs(s - vs.sum()) < 1e-4
        torch.testing.assert_close(torch.tensor(p), pos)
        assert c == cnt.tolist()
        assert calls == 5  # quantiles: max + gather; mean; sum; positions
