"""Numerics on the RL side: padding (NaN, inf, huge log-ratios) reaches no value or gradient in the
KL term, the policy loss, the per-token fused loss, the value loss or GAE; the value_clamp of
k1+/k3+ bounds their gradient; the adaptive controller's clock; the direction names."""

import math

import pytest
import torch

from rl.objectives.advantages import gae
from rl.objectives.controller import KLController, KLControllerConfig
from rl.objectives.kl import ESTIMATORS, KLConfig, kl_estimate
from rl.objectives.losses import (
    LossScale,
    PolicyLossConfig,
    clipped_value_loss,
    policy_loss,
    token_policy_loss,
    token_weights,
)

D = torch.float64
GARBAGE = {"nan": math.nan, "-inf": -math.inf, "inf": math.inf, "lr-200": -200.0}


def _batch(seed=0, B=3, S=5):
    """A batch whose last column is padding (mask false everywhere)."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(B, S, generator=g, dtype=D) - 1.0
    old = lp + 0.2 * torch.randn(B, S, generator=g, dtype=D)
    ref = lp + 0.5 * torch.randn(B, S, generator=g, dtype=D)
    adv = torch.randn(B, S, generator=g, dtype=D)
    m = torch.ones(B, S, dtype=torch.bool)
    m[:, -1] = False
    m[1, 2:] = False
    return lp, old, ref, adv, m


def _plant(t, kind, ref_side):
    """Garbage at padded position [0, -1]; "lr-200" makes log(pi/ref) = -200 there."""
    t = t.clone()
    t[0, -1] = (t[0, -1] + 200.0 if ref_side else t[0, -1]) if kind == "lr-200" else GARBAGE[kind]
    return t


@pytest.mark.parametrize("kind", sorted(GARBAGE))
@pytest.mark.parametrize("est", ESTIMATORS)
def test_policy_loss_padding_reaches_no_gradient(est, kind):
    lp, old, ref, adv, m = (t if t.dtype == torch.bool else t.float() for t in _batch())  # fp32, as in training
    cfg, kl_cfg = PolicyLossConfig(), KLConfig(estimator=est, where="loss")
    a = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(a, _plant(old, kind if kind != "lr-200" else "nan", False), _plant(adv, "nan", False), m,
                          cfg, kl_cfg=kl_cfg, beta=0.3, ref_logp=_plant(ref, kind, True))
    loss.backward()
    # reference: the padding column removed altogether
    b = lp[:, :-1].clone().requires_grad_(True)
    want, _ = policy_loss(b, old[:, :-1], adv[:, :-1], m[:, :-1], cfg, kl_cfg=kl_cfg, beta=0.3,
                          ref_logp=ref[:, :-1])
    want.backward()
    assert torch.isfinite(a.grad).all() and torch.isfinite(loss)
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.grad[:, :-1], b.grad, atol=1e-7, rtol=1e-6)
    assert (a.grad[:, -1] == 0).all()


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_token_loss_and_estimates_ignore_padding(kind):
    """The per-token loss of the fused head: garbage in what rl/ binds (ref, old, advantages, weights)
    and in the head's own values (log-prob, entropy, exact KL) at padding."""
    lp, old, ref, adv, m = _batch(1)
    scale = LossScale(int(m.sum()), int(m.any(-1).sum()))
    w = token_weights(m, "token-mean", scale)
    cfg = PolicyLossConfig(entropy_coef=0.01)
    ent = torch.rand(lp.shape, dtype=D)
    got = []
    for plant in (True, False):
        x = (_plant(lp, "nan", False) if plant else lp).clone().requires_grad_(True)
        e = _plant(ent, "inf", False) if plant else ent
        fn = token_policy_loss(cfg, _plant(w.double(), "nan", False) if plant else w.double(), m,
                               _plant(old, "nan", False) if plant else old, _plant(adv, "inf", False) if plant else adv,
                               kl_cfg=KLConfig(estimator="k3"), beta=0.2,
                               ref_logp=_plant(ref, kind, True) if plant else ref)
        loss = fn(x.reshape(-1), e.reshape(-1), None, slice(None)).sum()
        loss.backward()
        got.append((loss.detach(), x.grad, fn.stats()))
    assert torch.isfinite(got[0][1]).all()
    torch.testing.assert_close(got[0][0], got[1][0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got[0][1], got[1][1], atol=1e-12, rtol=1e-12)
    assert got[0][2] == pytest.approx(got[1][2], rel=1e-12)
    for est in ESTIMATORS:
        x = lp.clone().requires_grad_(True)
        k = kl_estimate(x, _plant(ref, kind, True), est, mask=m)
        k.sum().backward()
        assert torch.isfinite(k).all() and torch.isfinite(x.grad).all() and (x.grad[:, -1] == 0).all()


def test_gae_ignores_a_nan_value_in_the_padding():
    lp, _, _, rew, m = _batch(2)
    values = torch.randn(lp.shape, dtype=D)
    bad = values.clone()
    bad[0, -1], bad[1, 3] = math.nan, math.inf
    adv, ret = gae(rew, bad, m.to(D), 1.0, 0.95)
    adv0, ret0 = gae(rew[:, :-1], values[:, :-1], m[:, :-1].to(D), 1.0, 0.95)  # padding removed
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    torch.testing.assert_close(adv[0, :-1], adv0[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(adv[1, :2], adv0[1, :2], atol=1e-12, rtol=1e-12)  # row 1's own padding at 2..


def test_value_loss_ignores_padding():
    lp, _, _, ret, m = _batch(3)
    v = torch.randn(lp.shape, dtype=D)
    a = _plant(v, "nan", False).requires_grad_(True)
    loss, _ = clipped_value_loss(a, _plant(v + 0.1, "inf", False), _plant(ret, "nan", False), m, 0.2)
    loss.sum().backward()
    b = v[:, :-1].clone().requires_grad_(True)
    want, _ = clipped_value_loss(b, v[:, :-1] + 0.1, ret[:, :-1], m[:, :-1], 0.2)
    want.sum().backward()
    assert torch.isfinite(a.grad).all()
    torch.testing.assert_close(a.grad[:, :-1], b.grad, atol=1e-12, rtol=1e-12)


def test_value_clamp_bounds_the_straight_through_gradient():
    lr = torch.tensor([[-6.0, -1.0, 0.5, 4.0]], dtype=D)
    ref = torch.zeros_like(lr)
    for est in ("k1+", "k3+"):
        x = lr.clone().requires_grad_(True)
        val = kl_estimate(x, ref, est, value_clamp=2.0)
        (g,) = torch.autograd.grad(val.sum(), x)
        base = lr if est == "k1+" else torch.expm1(-lr) + lr
        torch.testing.assert_close(val.detach(), base.clamp(-2.0, 2.0), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(g, lr.clamp(-2.0, 2.0), atol=1e-12, rtol=1e-12)  # d/dlogp of k2, bounded


# ---------------------------------------------------------------------------------------------
# the controller's clock


def test_controller_refuses_a_factor_that_can_reach_zero():
    c = KLController(KLControllerConfig(mode="adaptive", beta=0.1, target=1.0, horizon=100.0))
    with pytest.raises(ValueError, match="horizon"):
        c.update(0.0, n_samples=500)  # 1 - 0.2 * 5 = 0
    assert c.update(0.0, n_samples=499) > 0
    from core.config import load_config
    from rl.config import RLConfig

    with pytest.raises(ValueError, match="kl_ctl.horizon.*rollout.prompts_per_step"):
        load_config(RLConfig, None, ["kl_ctl.mode=adaptive", "kl_ctl.horizon=6", "rollout.prompts_per_step=8",
                                     "rollout.group_size=4"])


def test_normalized_beta_is_bounded():
    c = KLController(KLControllerConfig(mode="normalized", beta=0.1, target=0.1))
    assert c.update(1e-6) == 10.0  # target / KL would be 1e5
    assert c.update(0.05) == pytest.approx(2.0, rel=1e-15)  # below the bound: target / KL
    c2 = KLController(KLControllerConfig(mode="normalized", beta=0.1, target=0.1, normalized_max=100.0))
    assert c2.update(1e-6) == 100.0


def test_direction_names():
    with pytest.raises(ValueError, match="'pi_ref'"):
        KLConfig(direction="forward")
    with pytest.raises(ValueError, match="'ref_pi'"):
        KLConfig(direction="reverse", exact=True)
    with pytest.raises(ValueError, match="'ref_pi'"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k1", direction="reverse")
    assert KLConfig().direction == "pi_ref" and KLConfig(direction="ref_pi", estimator="k3").direction == "ref_pi"
