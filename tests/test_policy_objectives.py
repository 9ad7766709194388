"""GSPO, GSPO-token and CISPO (rl/objectives/policy_objectives.py) against their papers' formulas written here in
float64: values and gradients (autograd through a tiny softmax policy) on-policy and with pi_old != pi, through
the unfused path and through the fused head (chunks smaller than a response, the sequence ratio from its no-grad
pre-pass), to 1e-12; and with every KL estimator x place x importance weight and the exact KL, the KL part
equals PPO's (which tests/test_kl_table.py proves by enumeration)."""

import itertools

import pytest
import torch

from rl.objectives.kl import ESTIMATORS, HEAD_DIRECTION, IS_WEIGHTS, KLConfig
from rl.objectives.losses import PolicyLossConfig, token_weights
from rl.objectives.policy_objectives import make_token_loss
from rl.update.logprobs import _loss_head

B, S, V, H = 3, 4, 5, 3
LENS = (3, 2, 4)


def _case(seed=0, off_policy=True):
    """(h [B*S, H], w [V, H], targets [B*S], mask [B, S], old log-probs [B, S] or None (on-policy)); padding
    holds garbage targets."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B * S, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (B * S,), generator=g)
    mask = torch.arange(S)[None, :] < torch.tensor(LENS)[:, None]
    old = None
    if off_policy:
        w_old = w + 0.15 * torch.randn(V, H, generator=g, dtype=torch.float64)
        old = torch.log_softmax(h @ w_old.T, -1).gather(1, t[:, None])[:, 0].view(B, S)
    return h, w, t, mask, old


def _logp(h, w, t):
    return torch.log_softmax(h @ w.T, -1).gather(1, t[:, None])[:, 0].view(B, S)


def _weights(mask, agg, norm_len=None):
    """token_weights' weights in float64 (token_weights gives fp32, whose 1/3 is not float64's)."""
    m = mask.bool()
    n = m.sum(1, keepdim=True).double()
    if agg == "token-mean":
        w = torch.ones(m.shape, dtype=torch.float64) / m.sum()
    elif agg == "seq-mean-token-mean":
        w = 1.0 / (n * B) * torch.ones(m.shape, dtype=torch.float64)
    else:
        w = torch.full(m.shape, 1.0 / (norm_len * B), dtype=torch.float64)
    torch.testing.assert_close(w.float() * m, token_weights(mask, agg, norm_len=norm_len))  # the same weights
    return torch.where(m, w, torch.zeros((), dtype=torch.float64))


def _clip(x, lo, hi):
    return torch.minimum(torch.maximum(x, torch.full_like(x, lo)), torch.full_like(x, hi))


# ---- the papers' objectives, written from their equations (J to maximise; the loss is -J) ----

def gspo_paper(logp, old, adv_seq, mask, el, eh):
    """GSPO eq. (5)-(7): s_i = (pi(y_i)/pi_old(y_i))^(1/|y_i|) = exp(mean_t log r_t);
    J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - el, 1 + eh) A_i)."""
    terms = []
    for i in range(B):
        n = int(mask[i].sum())
        s = torch.exp((logp[i, :n] - old[i, :n]).sum() / n)
        terms.append(torch.minimum(s * adv_seq[i], _clip(s, 1 - el, 1 + eh) * adv_seq[i]))
    return -torch.stack(terms).mean()


def gspo_token_paper(logp, old, adv_tok, mask, el, eh):
    """GSPO-token eq. (13)-(14): s_{i,t} = sg[s_i] pi(y_t)/sg[pi(y_t)];
    J = 1/G sum_i 1/|y_i| sum_t min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t})."""
    terms = []
    for i in range(B):
        n = int(mask[i].sum())
        s_seq = torch.exp((logp[i, :n] - old[i, :n]).sum() / n).detach()
        s = s_seq * torch.exp(logp[i, :n] - logp[i, :n].detach())
        a = adv_tok[i, :n]
        terms.append(torch.minimum(s * a, _clip(s, 1 - el, 1 + eh) * a).sum() / n)
    return -torch.stack(terms).mean()


def cispo_paper(logp, old, adv_seq, mask, el, eh):
    """MiniMax-M1 eq. (4): J = 1/sum_i |o_i| sum_i sum_t sg(clip(r_t, 1 - el, 1 + eh)) A_i log pi(o_t)."""
    total, n_all = 0.0, int(mask.sum())
    for i in range(B):
        n = int(mask[i].sum())
        r = torch.exp(logp[i, :n] - old[i, :n]).detach()
        total = total + (_clip(r, 1 - el, 1 + eh) * adv_seq[i] * logp[i, :n]).sum()
    return -total / n_all


CASES = {  # policy -> (paper formula, aggregation of its paper, clip_low, clip_high, per-token advantages)
    "gspo": (gspo_paper, "seq-mean-token-mean", 0.02, 0.03, False),
    "gspo_token": (gspo_token_paper, "seq-mean-token-mean", 0.02, 0.03, True),
    "cispo": (cispo_paper, "token-mean", 0.1, 0.05, False),
}


def _advantages(per_token, seed=1):
    """[B, S] advantages, per token or one per response (signs mixed: [0.66, -0.45, -1.03] at seed 1)."""
    a = torch.randn(B, S, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return a if per_token else a[:, :1].expand(B, S).clone()


def _exact_kl(hl, wl, w_ref, direction):
    """The full-vocabulary KL per position [B*S], in float64 with autograd (the reference's head frozen)."""
    lp, lq = torch.log_softmax(hl @ wl.T, -1), torch.log_softmax(hl.detach() @ w_ref.T, -1)
    if direction == "pi_ref":
        return (lp.exp() * (lp - lq)).sum(-1)
    return (lq.exp() * (lq - lp)).sum(-1)


def _ours(policy, agg, el, eh, h, w, t, mask, old, adv, fused, kl_cfg=None, beta=0.0, ref=None, chunk=2,
          w_ref=None):
    """(loss, grad h, grad w) of the implementation: unfused (log-probs with grad, prepare, the loss once) or
    the fused head (rl/update/logprobs.py's head: the no-grad pre-pass, then fused_head_loss). `w_ref`: the
    reference head of the exact KL (kl.exact)."""
    cfg = PolicyLossConfig(policy=policy, agg=agg, clip_low=el, clip_high=eh)
    on = old is None
    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    wts = _weights(mask, agg)
    old_b = torch.zeros(B, S, dtype=torch.float64) if on else old
    fn = make_token_loss(cfg, wts, mask, old_b, adv, on_policy=on, kl_cfg=kl_cfg, beta=beta, ref_logp=ref)
    exact = kl_cfg is not None and kl_cfg.exact
    if fused:
        kl_dir = HEAD_DIRECTION[kl_cfg.direction] if exact else None
        loss, _ = _loss_head(fn, None, V, 1.0, chunk, False, kl_dir, w_ref)(hl, wl, t, h if exact else None,
                                                                           mask.reshape(-1))
    else:
        lp = torch.log_softmax(hl @ wl.T, -1).gather(1, t[:, None])[:, 0]
        if getattr(fn, "needs_logprobs", False):
            fn.prepare(lp.detach())
        loss = fn(lp, None, _exact_kl(hl, wl, w_ref, kl_cfg.direction) if exact else None, slice(None)).sum()
    loss.backward()
    return loss.detach(), hl.grad, wl.grad, fn


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("policy", list(CASES))
def test_objective_equals_paper_formula(policy, off_policy, fused):
    paper, agg, el, eh, per_token = CASES[policy]
    h, w, t, mask, old = _case(seed=6, off_policy=off_policy)  # ratios 1.21, 0.88, 1.29: two of three clipped
    adv = _advantages(per_token)
    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp = _logp(hl, wl, t)
    ref_loss = paper(lp, lp.detach() if old is None else old, adv if per_token else adv[:, 0], mask, el, eh)
    ref_loss.backward()
    loss, gh, gw, fn = _ours(policy, agg, el, eh, h, w, t, mask, old, adv, fused)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, wl.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, hl.grad, rtol=1e-12, atol=1e-12)
    assert gw.abs().sum() > 0
    if off_policy and policy != "cispo":  # the case clips some responses and not others: both branches audited
        st = fn.stats()
        assert 0.0 < st["seq_clipfrac"] < 1.0, st


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_gspo_is_the_sequence_ratio_gradient_under_any_aggregation(agg):
    """With weights constant along a response, sum_t w_t f(s_{i,t}) has the gradient of W_i f(s_i) through
    s_i = exp(mean_t log r_t): the sequence-level objective weighted by the aggregation."""
    h, w, t, mask, old = _case(seed=5)
    adv = _advantages(False, seed=2)
    el, eh = 0.02, 0.03
    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp = _logp(hl, wl, t)
    n = mask.sum(1).double()
    W = n / n.sum() if agg == "token-mean" else n / 4.0 / B  # the weights' sum along each response
    terms = []
    for i in range(B):
        k = int(n[i])
        s = torch.exp((lp[i, :k] - old[i, :k]).sum() / k)
        terms.append(W[i] * -torch.minimum(s * adv[i, 0], _clip(s, 1 - el, 1 + eh) * adv[i, 0]))
    ref = torch.stack(terms).sum()
    ref.backward()
    cfg = PolicyLossConfig(policy="gspo", agg=agg, clip_low=el, clip_high=eh, norm_len=4.0)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    fn = make_token_loss(cfg, _weights(mask, agg, norm_len=4.0), mask, old, adv)
    lp2 = torch.log_softmax(hh @ ww.T, -1).gather(1, t[:, None])[:, 0]
    fn.prepare(lp2.detach())
    loss = fn(lp2, None, None, slice(None)).sum()
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ww.grad, wl.grad, rtol=1e-12, atol=1e-12)


def _kl_configs():
    for est, isw, where in itertools.product(ESTIMATORS, IS_WEIGHTS, ("loss", "reward")):
        try:
            k = KLConfig(estimator=est, is_weight=isw, where=where)
            k.place(where, warn=False)
        except ValueError:
            continue
        yield k
    for direction, where in (("pi_ref", "loss"), ("ref_pi", "loss"), ("pi_ref", "reward")):
        k = KLConfig(exact=True, direction=direction, where=where)
        k.place(where, warn=False)
        yield k


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("policy", list(CASES))
def test_kl_part_is_ppos_for_every_estimator_place_and_weight(policy, fused):
    """objective + beta KL minus the objective alone is the same KL term as under the PPO clip, value and
    gradient, for every allowed estimator x place x kl.is_weight, off-policy."""
    _, agg, el, eh, per_token = CASES[policy]
    h, w, t, mask, old = _case(seed=7)
    adv = _advantages(per_token)
    ref = old - 0.3 + 0.1 * torch.arange(B * S, dtype=torch.float64).view(B, S).sin()
    w_ref = w + 0.4 * torch.randn(V, H, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    n = 0
    for k in _kl_configs():
        parts = {}
        for pol in (policy, "ppo"):
            with_kl = _ours(pol, agg, el, eh, h, w, t, mask, old, adv, fused, kl_cfg=k, beta=0.3, ref=ref,
                            w_ref=w_ref)
            without = _ours(pol, agg, el, eh, h, w, t, mask, old, adv, fused)
            parts[pol] = [a - b for a, b in zip(with_kl[:3], without[:3])]
        for a, b in zip(parts[policy], parts["ppo"]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        if k.in_loss:  # the KL in the loss, or the exact KL's pathwise part with the KL in the reward
            assert parts["ppo"][0].abs() > 0
        else:
            assert parts["ppo"][0].abs() == 0  # a sampled KL in the reward adds nothing to the loss
        n += 1
    assert n >= 13


def test_gspo_refuses_a_split_response_and_token_advantages():
    h, w, t, mask, old = _case()
    cfg = PolicyLossConfig(policy="gspo", agg="seq-mean-token-mean")
    ids = torch.arange(B)[:, None].expand(B, S)
    with pytest.raises(ValueError, match="whole in one micro-batch"):
        make_token_loss(cfg, token_weights(mask), mask, old, _advantages(False), seq_ids=ids,
                          seq_len=mask.sum(1) + torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="gspo_token"):
        make_token_loss(cfg, token_weights(mask), mask, old, _advantages(True))
    fn = make_token_loss(cfg, token_weights(mask), mask, old, _advantages(False))
    with pytest.raises(RuntimeError, match="prepare"):
        fn(old.reshape(-1).clone(), None, None, slice(None))
