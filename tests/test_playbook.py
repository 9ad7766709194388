"""The KL playbook: each controller preset against its formula written out by hand, per-algorithm
defaults, reward normalisation from a fixed estimate, the entropy target, the repetition and
correlation signals, and the grad_ratio norms against a float64 hand computation."""

import math

import pytest
import torch

from core.config import load_config
from rl.config import RLConfig
from rl.experience.rewards import RewardConfig, RunningRewardNorm, build_reward
from rl.health.signals import WindowCorr, loss_term_grad_norms, repetition_rate
from rl.objectives.controller import PRESETS, EntropyController, KLController
from rl.objectives.kl import KLConfig
from rl.objectives.losses import PolicyLossConfig


def _ctl(*over):
    return KLController(load_config(RLConfig, None, list(over)).kl_ctl)


@pytest.mark.parametrize("preset,hi,lo", [("band", 1.5, 1 / 1.5), ("band_tight", 1.2, 0.8)])
def test_band_presets_follow_the_rule(preset, hi, lo):
    """Every 10 steps, on the mean of the last 10 KLs: x1.2 above hi * target, x0.8 below lo * target. `band`'s
    edges are PPO's (Schulman et al. 2017, sec. 4): 1.5 target and target / 1.5, so a KL of 0.06 against a
    target of 0.1 (below 0.0667, above half the target) shrinks beta."""
    c = _ctl(f"kl_ctl.preset={preset}", "kl_ctl.beta=0.1", "kl_ctl.target=0.1")
    kls = [0.3] * 10 + [0.01] * 10 + [0.1] * 10 + [0.14] * 10 + [0.06] * 10
    beta, hist = 0.1, []
    for i, k in enumerate(kls, 1):
        hist = (hist + [k])[-10:]
        if i % 10 == 0:
            m = sum(hist) / len(hist)
            beta *= 1.2 if m > hi * 0.1 else (0.8 if m < lo * 0.1 else 1.0)
        assert c.update(k, n_samples=256) == pytest.approx(beta, rel=1e-12)
    assert beta == pytest.approx(0.1 * 1.2 * 0.8 * (1.2 if preset == "band_tight" else 1.0) * 0.8)


def test_band_edges_are_ppos():
    """PPO's rule: beta grows when d > 1.5 d_targ and shrinks when d < d_targ / 1.5 -- the source `band` cites."""
    for kl, factor in ((0.151, 1.2), (0.149, 1.0), (0.0668, 1.0), (0.0666, 0.8)):
        c = _ctl("kl_ctl.preset=band", "kl_ctl.beta=0.1", "kl_ctl.target=0.1", "kl_ctl.every=1", "kl_ctl.window=1")
        assert c.update(kl) == pytest.approx(0.1 * factor, rel=1e-12), kl


def test_ziegler_preset_acts_at_the_default_settings():
    """grpo_tiny's 32 x 8 samples per step: horizon = 10 steps' samples, beta *= 1 + e * 256 / 2560."""
    cfg = load_config(RLConfig, "configs/grpo_tiny.yaml", ["kl_ctl.preset=ziegler", "kl_ctl.horizon=null"])
    assert cfg.kl_ctl.horizon == 2560.0 and cfg.kl_ctl.horizon_steps == 10.0
    c, beta = KLController(cfg.kl_ctl), cfg.kl_ctl.beta
    for k in (2.0 / 10, 0.0, 0.25):  # e clipped to 0.2, -0.2, then 0.25/0.2 - 1
        e = min(max(k / 0.2 - 1, -0.2), 0.2)
        beta = max(beta * (1 + e * 256 / 2560), 0.001)
        assert c.update(k, n_samples=256) == pytest.approx(beta, rel=1e-12)
    # 10 steps at twice the target multiply beta by (1.02)^10, about e^0.2
    for _ in range(10):
        c.update(0.4, n_samples=256)
    assert c.beta == pytest.approx(beta * 1.02 ** 10, rel=1e-12)


def test_ziegler_keeps_a_users_horizon():
    """A horizon the user set -- in samples, or in steps -- is the one used; both, disagreeing, is refused."""
    cfg = load_config(RLConfig, None, ["kl_ctl.preset=ziegler", "kl_ctl.horizon=5000"]).kl_ctl
    assert (cfg.horizon, cfg.horizon_steps) == (5000.0, None) and "kept your horizon=5000" in cfg.preset_summary
    cfg = load_config(RLConfig, None, ["kl_ctl.preset=ziegler", "kl_ctl.horizon=10000"]).kl_ctl  # = the default
    assert cfg.horizon == 10000.0
    cfg = load_config(RLConfig, None, ["kl_ctl.preset=ziegler", "kl_ctl.horizon_steps=20"]).kl_ctl
    assert cfg.horizon == 20 * 32
    with pytest.raises(ValueError, match="kl_ctl.horizon=5000.*horizon_steps=20.*set one of them"):
        load_config(RLConfig, None, ["kl_ctl.preset=ziegler", "kl_ctl.horizon=5000", "kl_ctl.horizon_steps=20"])


def test_target_over_kl_is_withdrawn_with_the_reason():
    with pytest.raises(ValueError, match="target_over_kl was withdrawn: beta = target / KL is positive feedback"):
        _ctl("kl_ctl.preset=target_over_kl", "kl_ctl.target=0.1")


def test_preset_keeps_a_users_key_and_says_so():
    cfg = load_config(RLConfig, None, ["kl_ctl.preset=band", "kl_ctl.every=3"]).kl_ctl
    assert (cfg.mode, cfg.every, cfg.up, cfg.down) == ("threshold", 3, 1.2, 0.8)
    assert "kept your every=3" in cfg.preset_summary and "Schulman" in cfg.preset_summary
    # a key set to the value it has by default is still the user's
    cfg = load_config(RLConfig, None, ["kl_ctl.preset=band", "kl_ctl.up=1.5", "kl_ctl.band_low=0.5"]).kl_ctl
    assert (cfg.up, cfg.band_low, cfg.down) == (1.5, 0.5, 0.8)
    assert "kept your band_low=0.5, up=1.5" in cfg.preset_summary
    assert load_config(RLConfig, None, ["kl_ctl.preset=band", "kl_ctl.mode=threshold"]).kl_ctl.every == 10
    with pytest.raises(ValueError, match="preset=band is kl_ctl.mode=threshold, but kl_ctl.mode=fixed is set.*=null"):
        load_config(RLConfig, None, ["kl_ctl.preset=band", "kl_ctl.mode=fixed"])
    cfg = load_config(RLConfig, "configs/grpo_tiny.yaml", ["kl_ctl.preset=band", "kl_ctl.mode=null"]).kl_ctl
    assert (cfg.mode, cfg.band_low, cfg.beta_min) == ("threshold", 1 / 1.5, 0.001)  # the file's beta_min kept
    with pytest.raises(ValueError, match="kl_ctl.preset must be one of"):
        load_config(RLConfig, None, ["kl_ctl.preset=nope"])
    assert set(PRESETS) == {"band", "band_tight", "ziegler", "grad_ratio"}
    # without a preset an unset key takes the rule's default
    assert load_config(RLConfig, None, []).kl_ctl.up == 1.5


def test_grad_ratio_norms_and_beta_against_float64():
    """Gradient w.r.t. the sampled log-probs: pg at ratio 1 is -A w; k3+'s is the k2 gradient log(pi/ref) w."""
    g = torch.Generator().manual_seed(0)
    B, N = 3, 5
    old, ref = -torch.rand(B, N, generator=g) * 2, -torch.rand(B, N, generator=g) * 2
    adv = torch.randn(B, N, generator=g)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, 3:] = False
    gp, gk = loss_term_grad_norms(PolicyLossConfig(), KLConfig(), old, ref, adv, mask)
    w = mask.double() / mask.sum()
    want_pg = float((adv.double() * w).norm())
    want_kl = float(((old.double() - ref.double()) * w).norm())
    assert gp == pytest.approx(want_pg, rel=1e-5) and gk == pytest.approx(want_kl, rel=1e-5)
    c = _ctl("kl_ctl.preset=grad_ratio")
    assert c.set_from_grad_norms(gp, gk) == pytest.approx(min(0.1 * want_pg / want_kl, 10.0), rel=1e-5)
    assert c.update(0.3) == c.beta  # update only records the KL in this mode
    with pytest.raises(ValueError, match="grad_ratio"):
        load_config(RLConfig, None, ["kl_ctl.preset=grad_ratio", "algo.name=ppo"])


def test_defaults_per_algorithm():
    ppo = load_config(RLConfig, None, ["algo.name=ppo"])
    assert (ppo.kl.where, ppo.kl.estimator) == ("reward", "k1")  # k3+ as a reward follows no KL's gradient
    grpo = load_config(RLConfig, None, [])
    assert (grpo.kl.where, grpo.kl.estimator) == ("loss", "k3+")
    ppo_loss = load_config(RLConfig, None, ["algo.name=ppo", "kl.where=loss"])
    assert (ppo_loss.kl.where, ppo_loss.kl.estimator) == ("loss", "k3+")
    assert load_config(RLConfig, None, []).reference.reset_optimizer is True
    assert load_config(RLConfig, None, ["reference.sync_mode=ema"]).reference.reset_optimizer is False
    assert load_config(RLConfig, None, ["reference.reset_optimizer=false"]).reference.reset_optimizer is False
    assert KLConfig().where == "loss"  # a bare section: the loss


def test_fixed_reward_normalisation_freezes_after_the_first_batch():
    _, _, norm = build_reward(RewardConfig(normalize="fixed"))
    first = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    m, s = 0.6, math.sqrt(0.24)
    torch.testing.assert_close(norm.normalize_(first), (first - m) / (s + 1e-8))
    second = torch.tensor([1.0, 1.0, 1.0, 1.0])
    torch.testing.assert_close(norm.normalize_(second), (second - m) / (s + 1e-8))  # frozen
    running = RunningRewardNorm()
    running.normalize_(first)
    assert running.normalize_(second)[0] != pytest.approx(float((1 - m) / s))
    with pytest.raises(ValueError, match="reward.normalize"):
        RewardConfig(normalize="sometimes")


def test_entropy_controller_formula():
    cfg = PolicyLossConfig(entropy_target=0.8, entropy_lr=0.05, entropy_coef_max=0.02)
    ec, coef = EntropyController(cfg), 0.0
    for h in (0.5, 0.6, 0.9, 1.5, 0.1):
        coef = min(max(coef + 0.05 * (0.8 - h), 0.0), 0.02)
        assert ec.update(h) == pytest.approx(coef)
    assert EntropyController(PolicyLossConfig(entropy_coef=0.01)).update(0.1) == 0.01  # no target: fixed


def test_repetition_rate_and_window_correlation():
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 0], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 0, 0, 0, 0]])
    mask = torch.tensor([[1] * 7 + [0], [1] * 8, [1] * 4 + [0] * 4], dtype=torch.bool)
    # row 0: 3-grams 567 675 756 567 675 -> 3 distinct of 5; row 1: 6 distinct of 6; row 2: 1 of 2
    assert repetition_rate(ids, mask, 3) == pytest.approx(((1 - 3 / 5) + 0 + (1 - 1 / 2)) / 3)
    xs, ys = [0.1, 0.4, 0.2, 0.8, 0.5], [1.0, 2.5, 1.1, 3.9, 3.0]
    wc = WindowCorr(4)
    got = [wc.add(x, y) for x, y in zip(xs, ys)]
    import numpy as np

    assert got[:2] == [None, None]
    assert got[2] == pytest.approx(np.corrcoef(xs[:3], ys[:3])[0, 1])
    assert got[4] == pytest.approx(np.corrcoef(xs[1:], ys[1:])[0, 1])


def _repetition_by_definition(ids, mask, n):
    """The rate written out per response in Python: its valid tokens in order, their n-grams, 1 - distinct/all."""
    rates = []
    for row, m in zip(ids.tolist(), mask.bool().tolist()):
        toks = [t for t, keep in zip(row, m) if keep]
        grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
        if grams:
            rates.append(1.0 - len(set(grams)) / len(grams))
    return sum(rates) / len(rates) if rates else 0.0


@pytest.mark.parametrize("n,vocab", [(3, 5), (3, 151936), (1, 7), (4, 3), (2, 2 ** 33)])
def test_repetition_rate_equals_its_definition(n, vocab):
    """The vectorised rate against the per-response definition on random rows with masked holes, empty and
    short responses; ids up to 2^33 with n=2 take the exact path for codes that would overflow int64."""
    g = torch.Generator().manual_seed(n * 7 + vocab % 97)
    for _ in range(20):
        B, N = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(0, 12, (1,), generator=g))
        hi = min(vocab, 4)  # few distinct ids, so n-grams repeat
        ids = torch.randint(0, hi, (B, N), generator=g) * (vocab // hi)
        mask = torch.rand(B, N, generator=g) < 0.8
        assert repetition_rate(ids, mask, n) == pytest.approx(_repetition_by_definition(ids, mask, n), abs=1e-12)
