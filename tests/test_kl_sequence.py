"""Which KL's gradient each (estimator, direction, place, kl.gradient) follows, by exact enumeration of
every response of 2 and 3 tokens over a 3-token vocabulary, in float64 (rl/objectives/kl_place.py).

The policy is a table: one row of logits per prefix (every node of the K-ary tree of depth L is a
parameter), the reference a fixed random table. The references are autograd gradients of closed forms
the code does not compute:
- sequence-level KL(pi||ref) = sum_x P(x) sum_t log(pi/ref)(x_t | x_<t) (what `kl_mean` reports per token);
- per-token KL with the prefix held fixed = sum_x P(x).detach() sum_t KL_t(x_<t) (either direction).
The code's side is the expected gradient of kltron's own objective: P(x) times the per-token loss of
`TokenPolicyLoss` (on-policy, advantages from `kl_shaped_rewards` + `gae` with gamma = lambda = 1 and
no critic, i.e. the return-to-go, for the KL in the reward; the loss term, plus the future-KL return of
kl.gradient=sequence, for the KL in the loss)."""

import itertools

import pytest
import torch

from rl.objectives.advantages import gae, kl_shaped_rewards
from rl.objectives.kl import KLConfig, kl_from_config
from rl.objectives.kl_place import future_kl
from rl.objectives.losses import PolicyLossConfig, TokenPolicyLoss

K = 3
D = torch.float64


class Tree:
    """A tabular autoregressive policy over responses of length L: `theta[t]` [K^t, K] are the logits
    at each prefix of length t; `ref[t]` likewise for the reference."""

    def __init__(self, L, seed, scale=0.8, ref_gap=0.6):
        g = torch.Generator().manual_seed(seed)
        self.L = L
        self.theta = [(torch.randn(K ** t, K, generator=g, dtype=D) * scale).requires_grad_(True) for t in range(L)]
        self.ref = [th.detach() + ref_gap * torch.randn(K ** t, K, generator=g, dtype=D) for t, th in
                    enumerate(self.theta)]
        self.seqs = torch.tensor(list(itertools.product(range(K), repeat=L)))  # [B, L], every response
        B = self.seqs.shape[0]
        self.prefix = torch.stack([torch.arange(B) // K ** (L - t) for t in range(L)], 1)  # [B, L] node index

    def dists(self, tables):
        """[B, L, K] log-probs of the next token at each position of each response."""
        return torch.stack([torch.log_softmax(tables[t][self.prefix[:, t]], -1) for t in range(self.L)], 1)

    def stats(self):
        lp_all, lq_all = self.dists(self.theta), self.dists(self.ref)
        x = self.seqs[..., None]
        logp, ref_logp = lp_all.gather(-1, x)[..., 0], lq_all.gather(-1, x)[..., 0]  # [B, L]
        kl_pr = (lp_all.exp() * (lp_all - lq_all)).sum(-1)  # per-position KL(pi||ref) [B, L]
        kl_rp = (lq_all.exp() * (lq_all - lp_all)).sum(-1)  # per-position KL(ref||pi)
        prob = logp.sum(1).exp()  # [B]
        return logp, ref_logp, kl_pr, kl_rp, prob

    def grad(self, objective):
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(objective, self.theta, retain_graph=True)])


def _targets(tree):
    logp, ref_logp, kl_pr, kl_rp, prob = tree.stats()
    pd = prob.detach()[:, None]
    return {"sequence KL(pi||ref)": tree.grad((prob * (logp - ref_logp).sum(1)).sum()),
            "per-token KL(pi||ref)": tree.grad((pd * kl_pr).sum()),
            "per-token KL(ref||pi)": tree.grad((pd * kl_rp).sum()),
            "zero": torch.zeros(sum(t.numel() for t in tree.theta), dtype=D)}


def _code_grad(tree, cfg):
    """E_{x~pi}[grad of kltron's per-token policy loss summed over the response], on-policy, beta = 1,
    no task reward: the expected gradient of the KL penalty as the trainer applies it."""
    logp, ref_logp, kl_pr, kl_rp, prob = tree.stats()
    exact_kl = kl_pr if cfg.direction == "pi_ref" else kl_rp
    mask = torch.ones_like(logp, dtype=torch.bool)
    # the rollout's per-token KL: detached, from the behaviour policy (= pi here)
    kl = exact_kl.detach() if cfg.exact else kl_from_config(cfg, logp.detach(), ref_logp, mask).detach()
    B = logp.shape[0]
    if cfg.where == "reward":
        rewards = kl_shaped_rewards(torch.zeros(B, dtype=D), kl, mask, beta=1.0)
        adv, _ = gae(rewards, torch.zeros_like(kl), mask.to(D), gamma=1.0, lam=1.0)  # return-to-go
    else:
        adv = torch.zeros_like(kl)
    fut = future_kl(kl, mask) if cfg.where == "loss" and cfg.gradient == "sequence" else None
    weights = prob.detach()[:, None].expand(B, tree.L).to(D)  # E_x ~ pi: each response's probability
    fn = TokenPolicyLoss(PolicyLossConfig(), weights, mask, logp.detach(), adv, kl_cfg=cfg, beta=1.0,
                         ref_logp=ref_logp, on_policy=True, kl_future=fut)
    total = fn(logp.reshape(-1), None, exact_kl.reshape(-1) if cfg.exact else None, slice(None)).sum()
    return tree.grad(total)


SEQ, TOK_F, TOK_R, ZERO = "sequence KL(pi||ref)", "per-token KL(pi||ref)", "per-token KL(ref||pi)", "zero"
# (estimator or "exact", direction, where, gradient, is_weight): the KL whose gradient the code follows
ALLOWED = {
    ("k1", "pi_ref", "reward", None, "detached"): SEQ,
    ("k1+", "pi_ref", "reward", None, "detached"): SEQ,
    ("exact", "pi_ref", "reward", None, "detached"): SEQ,
    (None, "pi_ref", "reward", None, "detached"): SEQ,  # the reward's default estimator (k1)
    (None, "pi_ref", "loss", None, "detached"): TOK_F,  # the loss's default (k3+)
    ("k2", "pi_ref", "loss", None, "detached"): TOK_F,
    ("k1+", "pi_ref", "loss", None, "detached"): TOK_F,
    ("k3+", "pi_ref", "loss", None, "none"): TOK_F,
    ("exact", "pi_ref", "loss", None, "detached"): TOK_F,
    ("k1", "pi_ref", "loss", None, "live"): TOK_F,
    ("k3", "pi_ref", "loss", None, "live"): TOK_F,
    ("k3", "pi_ref", "loss", None, "detached"): TOK_R,
    ("low_var_kl", "pi_ref", "loss", None, "detached"): TOK_R,
    ("k1", "pi_ref", "loss", None, "detached"): ZERO,
    ("k1", "ref_pi", "loss", None, "detached"): TOK_R,
    ("k3", "ref_pi", "loss", None, "detached"): TOK_R,
    ("exact", "ref_pi", "loss", None, "detached"): TOK_R,
    (None, "pi_ref", "loss", "sequence", "detached"): SEQ,
    ("k1+", "pi_ref", "loss", "sequence", "detached"): SEQ,
    ("k3+", "pi_ref", "loss", "sequence", "none"): SEQ,
    ("exact", "pi_ref", "loss", "sequence", "detached"): SEQ,
    ("k1", "pi_ref", "loss", "sequence", "live"): SEQ,
    ("k3", "pi_ref", "loss", "sequence", "live"): SEQ,
}


def _cfg(est, direction, where, gradient, w):
    kw = dict(exact=True) if est == "exact" else dict(estimator=est)
    return KLConfig(direction=direction, where=where, gradient=gradient, is_weight=w, **kw)


@pytest.mark.parametrize("row", sorted(ALLOWED, key=str))
@pytest.mark.parametrize("L,seed", [(2, 0), (3, 1)])
def test_each_allowed_row_follows_its_kl(row, L, seed):
    tree = Tree(L, seed)
    tg = _targets(tree)
    assert (tg[SEQ] - tg[TOK_F]).norm() > 0.03 * tg[SEQ].norm()  # the three gradients are told apart here
    assert (tg[TOK_F] - tg[TOK_R]).norm() > 0.03 * tg[TOK_F].norm()
    got = _code_grad(tree, _cfg(*row))
    torch.testing.assert_close(got, tg[ALLOWED[row]], atol=1e-12, rtol=1e-10)


REFUSED = [
    ("k3+", "pi_ref", "reward", None, "detached"), ("k3", "pi_ref", "reward", None, "detached"),
    ("k2", "pi_ref", "reward", None, "detached"), ("low_var_kl", "pi_ref", "reward", None, "detached"),
    ("k1", "ref_pi", "reward", None, "detached"), ("k3", "ref_pi", "reward", None, "detached"),
    ("exact", "ref_pi", "reward", None, "detached"), ("k1", "pi_ref", "reward", "token", "detached"),
    ("k2", "pi_ref", "loss", "sequence", "detached"), ("low_var_kl", "pi_ref", "loss", "sequence", "detached"),
    ("k1", "pi_ref", "loss", "sequence", "detached"), ("k3", "pi_ref", "loss", "sequence", "detached"),
    ("k3", "ref_pi", "loss", "sequence", "detached"), ("exact", "ref_pi", "loss", "sequence", "detached"),
]


@pytest.mark.parametrize("row", REFUSED, ids=str)
def test_biased_rows_are_refused_naming_the_keys(row):
    est, direction, where, gradient, w = row
    with pytest.raises(ValueError, match=r"kl\.(estimator|direction|gradient)=.*use "):
        _cfg(*row)


def _raw_reward_grad(tree, estimator):
    """The reward-place gradient of a sampled estimator, built without KLConfig (which refuses it)."""
    from rl.objectives.kl import kl_estimate

    logp, ref_logp, _, _, prob = tree.stats()
    mask = torch.ones_like(logp, dtype=torch.bool)
    kl = kl_estimate(logp.detach(), ref_logp, estimator).detach()
    rewards = kl_shaped_rewards(torch.zeros(logp.shape[0], dtype=D), kl, mask, beta=1.0)
    adv, _ = gae(rewards, torch.zeros_like(kl), mask.to(D), gamma=1.0, lam=1.0)
    return tree.grad((prob.detach()[:, None] * -adv * logp).sum())


@pytest.mark.parametrize("est", ["k3", "k2"])
def test_why_k3_and_k2_are_refused_in_the_reward(est):
    """k3 as a per-token reward follows grad K(pi||ref) - sum_t grad_t KL(ref||pi) (prefix fixed):
    far from the sequence-level KL's gradient, and weakest near the reference; k2 follows no KL."""
    for L, seed in [(2, 0), (3, 1)]:
        tree = Tree(L, seed)
        tg = _targets(tree)
        got = _raw_reward_grad(tree, est)
        if est == "k3":
            torch.testing.assert_close(got, tg[SEQ] - tg[TOK_R], atol=1e-12, rtol=1e-10)
        assert min(float((got - tg[t]).norm() / tg[t].norm()) for t in (SEQ, TOK_F, TOK_R)) > 0.1
    near = Tree(1, 2, ref_gap=0.05)  # one token, reference close by: the two terms nearly cancel
    tg = _targets(near)
    assert _raw_reward_grad(near, "k3").norm() < 0.1 * tg[SEQ].norm()


def test_exact_kl_in_the_reward_needs_its_pathwise_term():
    """Without the loss's pathwise term the exact KL in the reward loses E[sum_t grad KL_t]: the
    return-to-go alone is the future part only (the old behaviour, 2-token case)."""
    tree = Tree(2, 0)
    tg = _targets(tree)
    logp, ref_logp, kl_pr, _, prob = tree.stats()
    mask = torch.ones_like(logp, dtype=torch.bool)
    rewards = kl_shaped_rewards(torch.zeros(logp.shape[0], dtype=D), kl_pr.detach(), mask, beta=1.0)
    adv, _ = gae(rewards, torch.zeros_like(logp), mask.to(D), gamma=1.0, lam=1.0)
    score_only = tree.grad((prob.detach()[:, None] * -adv * logp).sum())
    torch.testing.assert_close(score_only + tg[TOK_F], tg[SEQ], atol=1e-12, rtol=1e-10)
    assert float((score_only - tg[SEQ]).norm() / tg[SEQ].norm()) > 0.2
    cfg = KLConfig(exact=True, where="reward")
    assert cfg.in_loss and cfg.gradient == "sequence"


def test_defaults_by_place():
    assert KLConfig(where="reward").estimator == "k1"
    assert KLConfig(where="loss").estimator == "k3+"
    assert KLConfig().estimator == "k3+" and KLConfig().gradient == "token"
    assert KLConfig(where="loss", direction="ref_pi").estimator == "k3"
    assert KLConfig(where="loss", is_weight="live").estimator == "k3"
    assert KLConfig(where="reward", estimator="k1+").estimator == "k1+"  # a set estimator wins
    assert KLConfig(where="reward").gradient == "sequence"


def test_future_kl_masks_and_sums_after():
    kl = torch.tensor([[1.0, 2.0, float("nan"), 4.0], [0.5, 0.25, 8.0, float("inf")]], dtype=D)
    m = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]], dtype=torch.bool)
    want = torch.tensor([[6.0, 4.0, 0.0, 0.0], [8.25, 8.0, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(future_kl(kl, m), want, atol=0, rtol=0)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_gap_sizes(capsys):
    """The numbers docs/kl_playbook.md quotes (`pytest -s -k gap_sizes`): how far each gradient is from
    the sequence-level KL's, relative (|g - grad K| / |grad K|), seeds 0-4, reference gap 0.05 / 0.6."""
    rows = []
    for gap in (0.05, 0.6):
        for L in (1, 2, 3, 4):
            errs = {"per-token (loss)": [], "k3 in the reward": [], "k3 norm ratio": [], "k2 in the reward": [],
                    "exact in the reward, score part only": []}
            for seed in range(5):
                tree = Tree(L, seed, ref_gap=gap)
                tg = _targets(tree)
                k3 = _raw_reward_grad(tree, "k3")
                errs["per-token (loss)"].append(_rel(tg[TOK_F], tg[SEQ]))
                errs["k3 in the reward"].append(_rel(k3, tg[SEQ]))
                errs["k3 norm ratio"].append(float(k3.norm() / tg[SEQ].norm()))
                errs["k2 in the reward"].append(_rel(_raw_reward_grad(tree, "k2"), tg[SEQ]))
                errs["exact in the reward, score part only"].append(_rel(tg[SEQ] - tg[TOK_F], tg[SEQ]))
            rows.append((gap, L, {k: (min(v), max(v)) for k, v in errs.items()}))
    with capsys.disabled():
        for gap, L, e in rows:
            print(f"\nref gap {gap} L={L}: " + "; ".join(f"{k} {a:.3g}-{b:.3g}" for k, (a, b) in e.items()))
    for gap, L, e in rows:
        if L == 1:  # one token: the per-token KL is the sequence KL
            assert e["per-token (loss)"][1] < 1e-12
        elif gap == 0.6:
            assert e["per-token (loss)"][0] > 0.04
        assert e["k3 in the reward"][0] > 0.5 and e["exact in the reward, score part only"][0] > 0.5
        assert e["k3 norm ratio"][1] < (0.1 if gap == 0.05 else 0.7)
