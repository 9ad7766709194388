"""The KL table under staleness (docs/off_policy.md), by exact enumeration over a small vocabulary in float64: for
every KL estimator x place (loss / reward) x kl.is_weight x staleness k in {0, 1, 2, 4}, what the expected gradient
of kltron's own per-token loss (rl/objectives/losses.py's TokenPolicyLoss, its inputs from
rl/objectives/off_policy.py's loss_inputs) follows when the tokens come from mu = the policy k versions old.

Versions are a sequence of parameter updates theta_0 .. theta_4 of a categorical policy; the update starts from
the current version theta_4: pi_old = softmax(theta_4) (the old-log-prob pass recomputes it under the current
weights), mu = softmax(theta_{4-k}), and pi = softmax(theta) with theta = theta_4 (epoch 0's first mini-batch) or
theta_4 + a drift (a later mini-batch). The expectation over x ~ mu is the sum over the vocabulary weighted by
mu(x). Closed forms (w.r.t. the logits of pi): grad KL(pi||q) = p * (log(p/q) - KL(p||q)), grad KL(ref||pi) = p - q.
"""

from types import SimpleNamespace

import pytest
import torch

from rl.objectives.kl import ESTIMATORS, KLConfig, kl_from_config, loss_gradient
from rl.objectives.losses import PolicyLossConfig, TokenPolicyLoss
from rl.objectives.off_policy import CORRECTIONS, OffPolicyConfig, loss_inputs

K, V = 6, 4  # vocabulary, current version
D = torch.float64
STALENESS = (0, 1, 2, 4)
F, R, Z, FOLD = "grad KL(pi||ref)", "grad KL(ref||pi)", "zero", "grad KL(pi||pi_old)"
BIASED = "biased"
ONES = torch.ones(K, 1, dtype=torch.bool)
NO_CLIP = PolicyLossConfig(clip_low=0.999, clip_high=1e6)  # the clip never acts: what the weights alone do


def _versions(seed):
    g = torch.Generator().manual_seed(seed)
    thetas = [torch.randn(K, generator=g, dtype=D) * 1.2]
    for _ in range(V):  # one parameter update per version
        thetas.append(thetas[-1] + 0.3 * torch.randn(K, generator=g, dtype=D))
    ref_logp = torch.log_softmax(thetas[0] + 0.8 * torch.randn(K, generator=g, dtype=D), 0)
    drift = 0.25 * torch.randn(K, generator=g, dtype=D)
    return thetas, ref_logp, drift


def _setup(seed, k, drifted):
    thetas, ref_logp, drift = _versions(seed)
    theta = (thetas[V] + (drift if drifted else 0.0)).requires_grad_(True)
    old = torch.log_softmax(thetas[V], 0)
    mu = torch.log_softmax(thetas[V - k], 0)
    return theta, old, mu, ref_logp


def _targets(theta, old, ref_logp):
    logp = torch.log_softmax(theta.detach(), 0)
    p, q = logp.exp(), ref_logp.exp()
    kl = lambda a, b: (a.exp() * (a - b)).sum()  # noqa: E731
    return {F: p * (logp - ref_logp - kl(logp, ref_logp)), R: p - q, Z: torch.zeros(K, dtype=D),
            FOLD: p * (logp - old - kl(logp, old))}


def _inputs(correction, max_staleness, k, old, mu, cap=None):
    algo = SimpleNamespace(off_policy=OffPolicyConfig(correction, cap), max_staleness=max_staleness)
    cfg = SimpleNamespace(algo=algo)
    # one response per vocabulary entry ([K, 1]): a response-level weight is that token's
    data = SimpleNamespace(old_logp=old[:, None], rollout_sampled_logprobs=mu[:, None], mask=ONES,
                           policy_version=torch.full((K,), V - k), current_version=V)
    return loss_inputs(cfg, data)


def _code_grad(kl_cfg, correction, max_staleness, k, theta, old, mu, ref_logp, advantages=None, loss_cfg=NO_CLIP,
               cap=None):
    """E_{x~mu}[grad of TokenPolicyLoss at x] with beta = 1: the trainer's loss on one token drawn by mu."""
    inp = _inputs(correction, max_staleness, k, old, mu, cap)
    logp = torch.log_softmax(theta, 0)
    on_policy = bool(torch.equal(logp.detach(), old)) and inp.on_policy_ok  # epoch 0's first mini-batch
    adv = torch.zeros(K, 1, dtype=D) if advantages is None else advantages[:, None]
    fn = TokenPolicyLoss(loss_cfg, mu.exp()[:, None], ONES, inp.old_logp, adv,
                         kl_cfg=kl_cfg, beta=1.0, ref_logp=ref_logp[:, None], on_policy=on_policy,
                         is_weights=inp.weights, kl_old=inp.kl_old)
    (grad,) = torch.autograd.grad(fn(logp, None, None, slice(None)).sum(), theta)
    return grad


def _loss_rows():
    rows = []
    for est in ESTIMATORS:
        for w in ("none", "detached", "live"):
            try:
                KLConfig(estimator=est, is_weight=w, where="loss")
            except ValueError:
                continue
            rows.append((est, "pi_ref", w))
    return rows + [("k1", "ref_pi", "none"), ("k1", "ref_pi", "detached"), ("k3", "ref_pi", "none"),
                   ("k3", "ref_pi", "detached")]


@pytest.mark.parametrize("row", _loss_rows(), ids=str)
@pytest.mark.parametrize("k", STALENESS)
def test_kl_in_the_loss_under_staleness(row, k):
    """Weighted (detached or live), the KL term follows its on-policy gradient at every staleness, first mini-batch
    or later, whatever the correction: the loss weighs it by pi/mu. Unweighted it does so only when mu = pi_old =
    pi (staleness 0, first mini-batch); with algo.max_staleness > 0 it is refused at start-up."""
    est, direction, w = row
    cfg = KLConfig(estimator=est, direction=direction, is_weight=w, where="loss")
    claim = loss_gradient(est, direction, w) if w != "none" else loss_gradient(est, direction, "detached")
    for seed, drifted in ((0, False), (1, True)):
        theta, old, mu, ref_logp = _setup(seed, k, drifted)
        tg = _targets(theta, old, ref_logp)
        assert (tg[F] - tg[R]).abs().max() > 1e-2
        assert float((torch.log_softmax(theta.detach(), 0) - mu).max()) < 2.0  # pi/mu below kl.is_ratio_max
        for correction in CORRECTIONS:
            for max_staleness in {k, 4}:
                if correction == "none" and max_staleness == 0 and k > 0:
                    continue  # a stale batch in a synchronous run: refused (test_off_policy.py)
                got = _code_grad(cfg, correction, max_staleness, k, theta, old, mu, ref_logp)
                exact = w != "none" or (k == 0 and not drifted)
                if exact:
                    torch.testing.assert_close(got, tg[claim], atol=1e-12, rtol=1e-10)
                else:
                    assert min(float((got - tg[t]).abs().max()) for t in (F, R, Z)) > 1e-3, (correction, seed)


def _reward_advantage(est, old, ref_logp):
    """KL in the reward, one token: computed once, before the update, from pi_old's log-probs (StepData.kl), the
    return is -k."""
    cfg = KLConfig(estimator=est, where="reward")
    return -kl_from_config(cfg, old[None], ref_logp[None])[0].detach()


@pytest.mark.parametrize("est", ["k1", "k1+"])
@pytest.mark.parametrize("k", STALENESS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_kl_in_the_reward_under_staleness(est, k, correction):
    """The reward's k1 (k1+) with samples from mu: every correction whose weights do not bite (cap 1e6) gives
    grad KL(pi||ref) - grad KL(pi||pi_old), the stale-penalty gradient of the synchronous off-policy row, at every
    staleness (exactly grad KL(pi||ref) on the first mini-batch, where pi = pi_old). No importance weight applies
    to the value: the correction's c_t and the ratio pi/pi_old (or pi/mu for `none`) carry it."""
    cap = None if correction in ("none", "decoupled") else 1e6
    for seed, drifted in ((2, False), (3, True)):
        theta, old, mu, ref_logp = _setup(seed, k, drifted)
        tg = _targets(theta, old, ref_logp)
        adv = _reward_advantage(est, old, ref_logp)
        got = _code_grad(KLConfig(estimator=est, where="reward"), correction, 4, k, theta, old, mu, ref_logp,
                         advantages=adv, cap=cap)
        torch.testing.assert_close(got, tg[F] - tg[FOLD], atol=1e-12, rtol=1e-10)
        if not drifted:
            torch.testing.assert_close(got, tg[F], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_without_a_weight_the_reward_kl_is_biased_at_staleness(k):
    """What the correction is for: the same reward with the clip on pi/pi_old and no weight (the recomputed anchor,
    c = 1) follows E_mu, not E_pi_old: no KL's gradient."""
    theta, old, mu, ref_logp = _setup(2, k, False)
    tg = _targets(theta, old, ref_logp)
    adv = _reward_advantage("k1", old, ref_logp)
    logp = torch.log_softmax(theta, 0)
    fn = TokenPolicyLoss(NO_CLIP, mu.exp()[:, None], ONES, old[:, None], adv[:, None], on_policy=True)
    (got,) = torch.autograd.grad(fn(logp, None, None, slice(None)).sum(), theta)
    assert min(float((got - tg[t]).abs().max()) for t in (F, R, FOLD)) > 1e-3


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("correction", ["tis", "seq_tis", "mis", "geo_rs", "decoupled"])
def test_a_biting_cap_biases_as_its_formula_says(k, correction):
    """With the cap biting, the gradient is E_mu[c_t (-A) grad pi/pi_old] with c_t the truncated, masked or
    rejected weight, computed here by hand in float64: the truncation bias is the correction's own, and
    `off_policy_truncated_share` / `off_policy_dropped_share` count where it acts."""
    theta, old, mu, ref_logp = _setup(4, k, True)
    rho = (old - mu).exp()
    assert float(rho.max()) > 1.1
    cap = float(rho.max()) ** 0.5  # above 1, below the largest ratio
    adv = torch.linspace(-1, 1, K, dtype=D)
    got = _code_grad(KLConfig(estimator="k1", where="reward"), correction, 4, k, theta, old, mu, ref_logp,
                     advantages=adv, cap=cap)
    c = {"tis": rho.clamp(max=cap), "seq_tis": rho.clamp(max=cap),
         "mis": torch.where((rho >= 1 / cap) & (rho <= cap), rho, 0.0),
         "geo_rs": torch.where((rho >= 1 / cap) & (rho <= cap), rho.clamp(max=cap), 0.0),
         "decoupled": torch.where(rho <= cap, rho, 0.0)}[correction]
    assert (c != rho).any()  # the cap acts on some token
    logp = torch.log_softmax(theta, 0)
    (want,) = torch.autograd.grad((mu.exp() * c * -adv * (logp - old).exp()).sum(), theta)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_what_each_correction_keeps_of_the_gradient_at_staleness(capsys):
    """The numbers docs/off_policy.md quotes (`pytest -s -k keeps_of_the_gradient`): on epoch 0's first mini-batch
    (pi = pi_old), the expected policy gradient of each correction against the on-policy one E_pi_old[A grad log pi]
    (cosine, norm ratio), averaged over 20 random categorical policies whose versions are 0.5-sized updates apart,
    PPO's clip 0.2. Naive PPO (`none`: the clip on pi/mu) loses the tokens whose pi/mu left [0.8, 1.2]; decoupled
    keeps the gradient exactly, tis / mis lose only where their cap acts."""
    rows = {}
    for k in STALENESS:
        for correction in ("none", "tis", "mis", "decoupled"):
            cos, norm = [], []
            for seed in range(20):
                g = torch.Generator().manual_seed(1000 + seed)
                theta = torch.randn(K, generator=g, dtype=D) * 1.2
                thetas = [theta]
                for _ in range(V):
                    thetas.append(thetas[-1] + 0.5 * torch.randn(K, generator=g, dtype=D))
                th = thetas[V].clone().requires_grad_(True)
                old, mu = torch.log_softmax(thetas[V], 0), torch.log_softmax(thetas[V - k], 0)
                adv = torch.randn(K, generator=g, dtype=D)
                got = -_code_grad(None, correction, 4, k, th, old, mu, old, advantages=adv,
                                  loss_cfg=PolicyLossConfig(clip_low=0.2))
                p = old.exp()
                want = p * (adv - (p * adv).sum())  # E_pi_old[A grad log pi] w.r.t. the logits
                cos.append(float(got @ want / (got.norm() * want.norm()).clamp(min=1e-300)))
                norm.append(float(got.norm() / want.norm()))
            rows[k, correction] = (sum(cos) / len(cos), sum(norm) / len(norm))
    with capsys.disabled():
        print("\nstaleness | " + " | ".join(f"{c}: cos, norm" for c in ("none", "tis", "mis", "decoupled")))
        for k in STALENESS:
            print(f"{k} | " + " | ".join(f"{rows[k, c][0]:.3f}, {rows[k, c][1]:.3f}"
                                         for c in ("none", "tis", "mis", "decoupled")))
    for k in STALENESS:
        assert rows[k, "decoupled"] == pytest.approx((1.0, 1.0), abs=1e-12)
    assert rows[0, "none"] == pytest.approx((1.0, 1.0), abs=1e-12)
    assert rows[4, "none"][0] < rows[1, "none"][0] < 1.0  # the naive clip loses more the staler the samples
