"""The KL table of docs/kl_playbook.md, row by row, by exact enumeration over a small vocabulary: for every KL
estimator x place (loss / reward) x importance weight, what its expected gradient is, on-policy
(samples from pi) and off-policy (samples from pi_old != pi). Closed forms in float64:
grad KL(pi||ref) = p * (log(p/q) - KL), grad KL(ref||pi) = p - q (w.r.t. the logits of pi)."""

import re

import pytest
import torch

from rl.objectives.kl import KLConfig, kl_estimate, kl_loss_term, loss_gradient
from rl.objectives.losses import clipped_surrogate

K = 6
D = torch.float64


def _setup(seed):
    g = torch.Generator().manual_seed(seed)
    theta = (torch.randn(K, generator=g, dtype=D) * 1.2).requires_grad_(True)
    old_logp = torch.log_softmax(theta.detach() + 0.7 * torch.randn(K, generator=g, dtype=D), 0)  # pi_old != pi
    ref_logp = torch.log_softmax(torch.randn(K, generator=g, dtype=D), 0)
    return theta, old_logp, ref_logp


def _targets(theta, ref_logp, old_logp):
    logp = torch.log_softmax(theta.detach(), 0)
    p, q = logp.exp(), ref_logp.exp()
    kl = lambda a, b: (a.exp() * (a - b)).sum()
    return {"grad KL(pi||ref)": p * (logp - ref_logp - kl(logp, ref_logp)),
            "grad KL(ref||pi)": p - q,
            "zero": torch.zeros(K, dtype=D),
            "grad KL(pi||pi_old)": p * (logp - old_logp - kl(logp, old_logp))}


def _loss_grad(cfg, theta, ref_logp, old_logp):
    """E_{x~pi_old}[grad term(x)], term = the code's KL loss term with samples from pi_old."""
    logp = torch.log_softmax(theta, 0)
    term = kl_loss_term(cfg, logp[None], ref_logp[None], old_logp[None])[0]
    (grad,) = torch.autograd.grad((old_logp.exp() * term).sum(), theta)
    return grad


def _reward_grad(estimator, theta, ref_logp, old_logp):
    """KL in the reward: computed once at rollout (from pi_old, detached), it enters the advantage
    -k; the clipped surrogate (never clipping here) carries it: E_old[grad -A * pi/pi_old]."""
    logp = torch.log_softmax(theta, 0)
    k_old = kl_estimate(old_logp[None], ref_logp[None], estimator)[0].detach()
    pg, _ = clipped_surrogate(logp[None], old_logp[None], -k_old[None], torch.ones(1, K, dtype=torch.bool),
                              clip_low=0.99, clip_high=100.0)
    (grad,) = torch.autograd.grad((old_logp.exp() * pg[0]).sum(), theta)
    return grad


F, R, Z = "grad KL(pi||ref)", "grad KL(ref||pi)", "zero"
BIASED = "biased"
# (estimator, direction, is_weight): (on-policy gradient, off-policy gradient)
LOSS_TABLE = {
    ("k1", "pi_ref", "none"): (Z, BIASED), ("k1", "pi_ref", "detached"): (Z, Z), ("k1", "pi_ref", "live"): (F, F),
    ("k2", "pi_ref", "none"): (F, BIASED), ("k2", "pi_ref", "detached"): (F, F),
    ("k3", "pi_ref", "none"): (R, BIASED), ("k3", "pi_ref", "detached"): (R, R), ("k3", "pi_ref", "live"): (F, F),
    ("low_var_kl", "pi_ref", "detached"): (R, R), ("low_var_kl", "pi_ref", "live"): (F, F),
    ("k1+", "pi_ref", "none"): (F, BIASED), ("k1+", "pi_ref", "detached"): (F, F),
    ("k3+", "pi_ref", "none"): (F, BIASED), ("k3+", "pi_ref", "detached"): (F, F),
    ("k1", "ref_pi", "none"): (R, BIASED), ("k1", "ref_pi", "detached"): (R, R),
    ("k3", "ref_pi", "none"): (R, BIASED), ("k3", "ref_pi", "detached"): (R, R),
}
REFUSED = [("k2", "pi_ref", "live"), ("k1+", "pi_ref", "live"), ("k3+", "pi_ref", "live"),
           ("k1", "ref_pi", "live"), ("k3", "ref_pi", "live")]


@pytest.mark.parametrize("row", sorted(LOSS_TABLE))
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_table_by_enumeration(row, seed):
    est, direction, w = row
    cfg = KLConfig(estimator=est, direction=direction, is_weight=w, where="loss")
    theta, old_logp, ref_logp = _setup(seed)
    on_t, off_t = LOSS_TABLE[row]
    assert loss_gradient(est, direction, w) == on_t  # what the config logs for k1/k3 in the loss
    tg = _targets(theta, ref_logp, old_logp)
    assert (tg[F] - tg[R]).abs().max() > 1e-2  # the two KLs' gradients are distinguishable here
    on = _loss_grad(cfg, theta, ref_logp, torch.log_softmax(theta.detach(), 0))
    torch.testing.assert_close(on, tg[on_t], atol=1e-12, rtol=1e-10)
    off = _loss_grad(cfg, theta, ref_logp, old_logp)
    if off_t == BIASED:
        assert min(float((off - tg[t]).abs().max()) for t in (F, R, Z)) > 1e-3
    else:
        torch.testing.assert_close(off, tg[off_t], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("row", REFUSED)
def test_biased_live_weight_is_refused(row):
    est, direction, w = row
    with pytest.raises(ValueError, match="kl.is_weight='live'.*kl.estimator"):
        KLConfig(estimator=est, direction=direction, is_weight=w)


# place = reward (one token; tests/test_kl_sequence.py for whole responses): on-policy, k1 (and k1+,
# same value) gives exactly grad KL(pi||ref); k3 (k3+) would give grad KL(pi||ref) - grad KL(ref||pi)
# and k2 no KL's gradient, so KLConfig refuses them there; off-policy the penalty is stale: k1 gives
# grad KL(pi||ref) - grad KL(pi||pi_old). No importance weight applies (the surrogate's ratio reweights).
@pytest.mark.parametrize("est", ["k1", "k1+", "k3", "k3+", "k2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_reward_table_by_enumeration(est, seed):
    if est in ("k1", "k1+"):
        assert KLConfig(estimator=est, where="reward").estimator == est
    else:
        with pytest.raises(ValueError, match=re.escape(f"kl.estimator='{est}' with kl.where='reward'") + ".*use kl"):
            KLConfig(estimator=est, where="reward")
    theta, old_logp, ref_logp = _setup(seed)
    tg = _targets(theta, ref_logp, old_logp)
    on = _reward_grad(est, theta, ref_logp, torch.log_softmax(theta.detach(), 0))
    off = _reward_grad(est, theta, ref_logp, old_logp)
    if est in ("k1", "k1+"):
        torch.testing.assert_close(on, tg[F], atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(off, tg[F] - tg["grad KL(pi||pi_old)"], atol=1e-12, rtol=1e-10)
    elif est in ("k3", "k3+"):
        torch.testing.assert_close(on, tg[F] - tg[R], atol=1e-12, rtol=1e-10)
    else:  # k2: E_pi[0.5 log^2(pi/ref) grad log pi], no KL's gradient
        assert min(float((on - tg[t]).abs().max()) for t in (F, R)) > 1e-3


def test_default_loss_estimator_follows_kl_pi_ref():
    """KLConfig() in the loss: gradient of KL(pi||ref), on- and off-policy (was k3: KL(ref||pi))."""
    cfg = KLConfig()
    theta, old_logp, ref_logp = _setup(3)
    tg = _targets(theta, ref_logp, old_logp)
    for old in (torch.log_softmax(theta.detach(), 0), old_logp):
        torch.testing.assert_close(_loss_grad(cfg, theta, ref_logp, old), tg[F], atol=1e-12, rtol=1e-10)


def test_plain_k3_in_the_loss_is_logged_once(caplog):
    from rl.objectives import kl as klmod

    klmod._LOGGED.clear()
    with caplog.at_level("WARNING", logger="rl.objectives.kl"):
        KLConfig(estimator="k3", where="loss")
        KLConfig(estimator="k3", where="loss")
        KLConfig(estimator="k3", where="auto")  # the place is not known yet: nothing logged
        KLConfig(estimator="k3+", where="loss")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "grad KL(ref||pi)" in msgs[0] and "kl.estimator='k3'" in msgs[0], msgs


def test_is_ratio_max_clamps_the_weight():
    logp = torch.tensor([[0.0, -1.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[-5.0, -1.2]], dtype=D)  # ratios e^5 (clamped to 10) and e^0.2
    ref = torch.tensor([[-0.5, -0.4]], dtype=D)
    cfg = KLConfig(estimator="k1", is_weight="live", is_ratio_max=10.0)
    term = kl_loss_term(cfg, logp, ref, old)
    lr = (logp - ref).detach()
    want = torch.tensor([[10.0, torch.exp(torch.tensor(0.2, dtype=D))]], dtype=D) * lr
    torch.testing.assert_close(term.detach(), want, atol=1e-12, rtol=1e-12)
    (g,) = torch.autograd.grad(term.sum(), logp)
    # clamped token: weight constant, gradient of k1 only (10 * 1); the other: w * (lr + 1)
    torch.testing.assert_close(g, torch.stack([torch.tensor(10.0, dtype=D), want[0, 1] + want[0, 1] / lr[0, 1]])[None],
                               atol=1e-12, rtol=1e-12)
