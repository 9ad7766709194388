"""KLController update rules against hand-computed numbers, bounds, state round-trip."""

import json

import pytest
import torch

from rl.objectives.controller import KLController, KLControllerConfig


def test_fixed_keeps_beta():
    c = KLController(KLControllerConfig(mode="fixed", beta=0.3))
    for kl in (0.0, 5.0, -1.0):
        assert c.update(kl) == 0.3
    assert c.beta == 0.3


def test_adaptive_ziegler_by_hand():
    c = KLController(KLControllerConfig(mode="adaptive", beta=0.1, target=0.6, horizon=10000))
    # kl=0.9: error = clip(0.9/0.6 - 1, -.2, .2) = 0.2; beta = 0.1 * (1 + 0.2 * 256 / 10000)
    assert c.update(0.9, n_samples=256) == pytest.approx(0.1 * 1.00512, rel=1e-15)
    # kl=0.66: error = 0.1; beta *= 1 + 0.1 * 100 / 10000
    assert c.update(0.66, n_samples=100) == pytest.approx(0.1 * 1.00512 * 1.001, rel=1e-12)
    # kl=0: error = -0.2 (clipped from -1); beta *= 1 - 0.2 * 1e4 / 1e4 = 0.8
    assert c.update(0.0, n_samples=10000) == pytest.approx(0.1 * 1.00512 * 1.001 * 0.8, rel=1e-15)


def test_adaptive_accepts_a_tensor():
    c = KLController(KLControllerConfig(mode="adaptive", beta=1.0, target=1.0, horizon=10))
    assert c.update(torch.tensor(1.05), n_samples=1) == pytest.approx(1.0 + 0.05 * 0.1, rel=1e-6)


def test_threshold_by_hand():
    cfg = KLControllerConfig(mode="threshold", beta=1.0, target=0.1, band_low=0.5, band_high=1.5,
                             up=2.0, down=0.5)
    c = KLController(cfg)
    assert c.update(0.2) == 2.0  # 0.2 > 0.15
    assert c.update(0.1) == 2.0  # inside the band
    assert c.update(0.15) == 2.0  # equal to the edge: no change
    assert c.update(0.01) == 1.0  # < 0.05
    assert c.update(0.04) == 0.5


def test_window_averages_recent_values():
    cfg = KLControllerConfig(mode="threshold", beta=1.0, target=1.0, up=2.0, down=0.5, window=3)
    c = KLController(cfg)
    assert c.update(3.0) == 2.0  # recent 3.0
    assert c.update(0.0) == 2.0  # recent 1.5: edge
    assert c.update(0.0) == 2.0  # recent 1.0
    assert c.update(0.0) == 1.0  # recent (0+0+0)/3 = 0, the 3.0 left the window


def test_normalized_by_hand():
    c = KLController(KLControllerConfig(mode="normalized", beta=0.1, target=0.02, window=2))
    assert c.update(0.4) == pytest.approx(0.05, rel=1e-15)  # 0.02 / 0.4
    assert c.update(0.1) == pytest.approx(0.08, rel=1e-15)  # 0.02 / mean(0.4, 0.1)
    assert c.update(-0.5) == pytest.approx(0.08, rel=1e-15)  # mean -0.2 <= 0: unchanged


def test_bounds_all_modes():
    c = KLController(KLControllerConfig(mode="normalized", beta=0.1, target=1.0, beta_min=0.05, beta_max=2.0))
    assert c.update(1e-9) == 2.0
    assert c.update(100.0) == 0.05
    c = KLController(KLControllerConfig(mode="threshold", beta=1.0, target=1.0, up=10.0, beta_max=3.0))
    assert c.update(5.0) == 3.0
    c = KLController(KLControllerConfig(mode="adaptive", beta=1.0, target=1.0, horizon=1.0, beta_min=0.9))
    assert c.update(0.0, n_samples=1) == 0.9  # 1 * (1 - 0.2) = 0.8 -> 0.9


def test_state_round_trip_exact():
    cfg = KLControllerConfig(mode="adaptive", beta=0.123456789, target=0.3, horizon=77, window=3)
    a = KLController(cfg)
    for kl in (0.31, 0.7, 0.01, 0.5):
        a.update(kl, n_samples=5)
    state = json.loads(json.dumps(a.state_dict()))  # plain python numbers survive JSON
    b = KLController(cfg)
    b.load_state_dict(state)
    assert b.beta == a.beta
    for kl in (0.2, 0.9):
        assert a.update(kl, n_samples=3) == b.update(kl, n_samples=3)
    with pytest.raises(ValueError, match="expected keys"):
        b.load_state_dict({"beta": 1.0})


def test_bad_input():
    c = KLController(KLControllerConfig(mode="adaptive"))
    with pytest.raises(ValueError, match="nan"):
        c.update(float("nan"))
    with pytest.raises(ValueError, match="kl_ctl.mode"):
        KLControllerConfig(mode="pid")
    with pytest.raises(ValueError, match="kl_ctl.beta=5"):
        KLControllerConfig(beta=5.0, beta_max=1.0)
    with pytest.raises(ValueError, match="kl_ctl.target"):
        KLControllerConfig(mode="normalized", target=0.0)
