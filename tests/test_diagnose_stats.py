"""The statistics under the symptom detectors (tools/trend.py) against scipy and against simulations
whose truth is known, and the per-step extremes of log(pi/ref) the trainer logs (rl/update/update_stats.py)
against the masked values gathered on one process."""

import math

import numpy as np
import pytest
import torch

from rl.update.update_stats import masked_range
from tools.trend import fit, gain, noise_sd, number


def test_fit_matches_scipy_linregress_without_autocorrelation():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x = np.arange(40)
    alt = np.where(x % 2 == 0, 1.0, -1.0) * np.abs(rng.normal(0, 0.1, 40))  # residuals alternate: rho < 0, clamped
    ys = list(0.3 + 0.01 * x + alt)
    tr, ref = fit(ys), scipy_stats.linregress(x, ys)
    assert tr.slope == pytest.approx(ref.slope, rel=1e-12)
    assert tr.se == pytest.approx(ref.stderr, rel=1e-9)
    assert tr.start == pytest.approx(ref.intercept, rel=1e-12)
    assert tr.end == pytest.approx(ref.intercept + 39 * ref.slope, rel=1e-12)
    assert fit([1.0, 2.0, 3.0]) is None


def test_widened_standard_error_covers_a_drifting_series():
    """AR(1) noise (phi 0.7, a policy that drifts for a few steps) around a known line: the slope's +-2 se
    interval holds the true slope about 95% of the time with the autocorrelation correction; the plain
    least-squares error (scipy's) would miss it far more often."""
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    miss = miss_plain = 0
    trials = 400
    for _ in range(trials):
        e = np.zeros(60)
        for i in range(1, 60):
            e[i] = 0.7 * e[i - 1] + rng.normal(0, 0.05)
        ys = 0.2 + 0.002 * np.arange(60) + e
        tr, ref = fit(list(ys)), scipy_stats.linregress(np.arange(60), ys)
        miss += abs(tr.slope - 0.002) > 2 * tr.se
        miss_plain += abs(ref.slope - 0.002) > 2 * ref.stderr
    assert miss / trials <= 0.12 and miss_plain / trials >= 0.2, (miss, miss_plain)


def test_noise_sd_and_gain_recover_sampling_noise():
    """The mean of 256 0/1 rewards at p ~ 0.35 has sd sqrt(0.35 * 0.65 / 256) = 0.030 a step; noise_sd
    finds it under a trend (p 0.3 -> 0.4), and gain's standard error follows from it."""
    rng = np.random.default_rng(2)
    p = 0.3 + 0.00025 * np.arange(400)
    ys = list(rng.binomial(256, p) / 256)
    assert noise_sd(ys) == pytest.approx(math.sqrt(0.35 * 0.65 / 256), rel=0.15)
    d, se, head, tail = gain(ys, 80)
    assert d == pytest.approx(0.00025 * 320, abs=4 * se)
    assert se == pytest.approx(noise_sd(ys) * math.sqrt(2 / 80), rel=1e-12)


def test_number_reads_strings_that_spell_numbers():
    assert math.isnan(number("nan")) and math.isnan(number("NaN"))
    assert number("inf") == math.inf and number("-Infinity") == -math.inf and number(" 1e-3 ") == 1e-3
    assert number(True) is None and number("beta") is None and number([1.0]) is None and number(3) == 3.0


def _ratios():
    g = torch.Generator().manual_seed(3)
    lr = torch.randn(6, 7, generator=g, dtype=torch.float64) * 3
    m = torch.rand(6, 7, generator=g) > 0.4
    m[3:] = False  # rank 1 of 2 has no valid token at all
    return lr, m


def test_masked_range_is_the_extremes_of_the_valid_tokens():
    lr, m = _ratios()
    assert masked_range(lr, m, None) == (float(lr[m].min()), float(lr[m].max()))
    assert masked_range(lr, torch.zeros_like(m), None) == (0.0, 0.0)
    lr[~m] = 1e9  # masked positions never count, whatever they hold
    assert masked_range(lr, m, None) == (float(lr[m].min()), float(lr[m].max()))


def _range_on_rank():
    import torch.distributed as dist

    rank = dist.get_rank()
    lr, m = _ratios()
    rows = slice(0, 3) if rank == 0 else slice(3, 6)
    return masked_range(lr[rows], m[rows], dist.group.WORLD)


def test_masked_range_over_two_dp_ranks(dist_pools):
    lr, m = _ratios()
    res = dist_pools.run(2, _range_on_rank)
    assert res[0] == res[1] == (float(lr[m].min()), float(lr[m].max()))


@pytest.mark.slow
def test_trainer_logs_the_extremes_of_log_pi_over_ref():
    """A real step's `ref_log_ratio_min`/`_max` are the extremes of log(pi/ref) at the sampled tokens: k3's value
    (r - 1) - log r, r = ref/pi, is convex in log(pi/ref) with its minimum at 0, so the step's largest per-token
    KL (`kl_max`, from kl_quantiles) is k3 at one of the two extremes."""
    from tests.test_playbook_trainer import _trainer

    tr = _trainer(["kl_ctl.beta=0.05"])  # k3+ (the default): the value of k3
    for s in range(2):
        rec = tr.step(s)
        lo, hi = rec["ref_log_ratio_min"], rec["ref_log_ratio_max"]
        assert lo < 0 < hi  # policy and reference differ (different seeds)
        k3 = max(math.expm1(-x) + x for x in (lo, hi))
        assert rec["kl_max"] == pytest.approx(k3, rel=1e-4)
        assert rec["beta_min"] == tr.cfg.kl_ctl.beta_min
