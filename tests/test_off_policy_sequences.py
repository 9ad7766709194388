"""What the corrections do over whole responses at staleness, by exact enumeration of every 2- and 3-token response
of a 3-token vocabulary in float64 (tests/test_kl_sequence.py's tabular Tree policy). Versions are parameter
updates of the tables; the update starts at the current version (pi = pi_old), mu is the policy k versions old.

What docs/off_policy.md states and these check:
- the policy gradient with one advantage per response: the sequence-level weight (seq_tis, uncapped) gives the
  on-policy gradient E_pi_old[A grad log pi(y)] exactly; the token-level weights (tis, decoupled) correct each
  token but not the distribution of its prefix and continuation (the surrogate's approximation), and miss it;
- the KL in the loss (k3+, weighted by pi/mu; the exact KL, unweighted): the per-position KL(pi||ref) gradient
  at mu's prefixes, E_{h~mu}[sum_t grad KL_t(h_t)]: each token is corrected, its prefix is mu's (at staleness
  0, pi's).
"""

import pytest
import torch

from rl.objectives.kl import KLConfig
from rl.objectives.losses import PolicyLossConfig, TokenPolicyLoss
from rl.objectives.off_policy import OffPolicyConfig, loss_inputs
from tests.test_kl_sequence import Tree

D = torch.float64
NO_CLIP = PolicyLossConfig(clip_low=0.999, clip_high=1e6)


class Versions:
    """Tree tables theta_0 .. theta_4, one parameter update apart; the tree's own theta is set to theta_4."""

    def __init__(self, L, seed):
        self.tree = Tree(L, seed, ref_gap=0.6)
        g = torch.Generator().manual_seed(100 + seed)
        cur = [t.detach().clone() for t in self.tree.theta]
        self.tables = [cur]
        for _ in range(4):
            cur = [t - 0.3 * torch.randn(t.shape, generator=g, dtype=D) for t in cur]
            self.tables.append(cur)
        with torch.no_grad():
            for t, v in zip(self.tree.theta, self.tables[4]):
                t.copy_(v)

    def logp(self, tables):
        """[B, L] log-probs of every response's tokens under `tables`."""
        return self.tree.dists(tables).gather(-1, self.tree.seqs[..., None])[..., 0]


def _code_grad(v, k, correction, kl_cfg=None, advantages=None, cap=None, exact_kl=None):
    tree = v.tree
    logp = v.logp(tree.theta)
    old = logp.detach()  # pi_old = the current weights before the update
    mu = v.logp(v.tables[4 - k])
    B, L = logp.shape
    mask = torch.ones(B, L, dtype=torch.bool)
    cfg = type("C", (), {"algo": type("A", (), {"off_policy": OffPolicyConfig(correction, cap), "max_staleness": 4})})
    data = type("S", (), {"old_logp": old, "rollout_logprobs": mu, "mask": mask, "policy_version": None})
    inp = loss_inputs(cfg, data)
    weights = mu.sum(1).exp()[:, None].expand(B, L)  # E_{y~mu}: each response's probability under mu
    adv = torch.zeros(B, L, dtype=D) if advantages is None else advantages[:, None].expand(B, L)
    fn = TokenPolicyLoss(NO_CLIP, weights, mask, inp.old_logp, adv, kl_cfg=kl_cfg, beta=1.0,
                         ref_logp=tree.dists(tree.ref).gather(-1, tree.seqs[..., None])[..., 0],
                         on_policy=inp.on_policy_ok, is_weights=inp.weights, kl_old=inp.kl_old)
    kl = None if exact_kl is None else exact_kl.reshape(-1)
    return tree.grad(fn(logp.reshape(-1), None, kl, slice(None)).sum())


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("L,seed", [(2, 0), (3, 1)])
def test_sequence_weights_give_the_on_policy_gradient_token_weights_do_not(L, seed):
    v = Versions(L, seed)
    tree = v.tree
    g = torch.Generator().manual_seed(7 + seed)
    A = torch.randn(tree.seqs.shape[0], generator=g, dtype=D)  # one advantage per response (GRPO's)
    logp = v.logp(tree.theta)
    target = tree.grad((logp.sum(1).exp().detach() * A * logp.sum(1)).sum())  # grad of E_pi_old[A log pi(y)]
    for k in (0, 1, 2, 4):
        seq = _code_grad(v, k, "seq_tis", advantages=A, cap=1e9)  # the loss is -A r: minus its gradient
        torch.testing.assert_close(-seq, target, atol=1e-12, rtol=1e-10)
        for kind in ("tis", "decoupled"):
            got = -_code_grad(v, k, kind, advantages=A, cap=None if kind == "decoupled" else 1e9)
            if k == 0:
                torch.testing.assert_close(got, target, atol=1e-12, rtol=1e-10)
            else:
                assert _rel(got, target) > 1e-3, (kind, k)


@pytest.mark.parametrize("L,seed", [(2, 0), (3, 1)])
def test_kl_in_the_loss_follows_the_per_position_kl_at_mus_prefixes(L, seed):
    v = Versions(L, seed)
    tree = v.tree
    lp_all, lq_all = tree.dists(tree.theta), tree.dists(tree.ref)
    kl_t = (lp_all.exp() * (lp_all - lq_all)).sum(-1)  # [B, L] exact KL(pi||ref) at each response's prefixes
    for k in (0, 1, 2, 4):
        for correction in ("none", "tis", "seq_tis", "decoupled"):
            p_mu = v.logp(v.tables[4 - k]).sum(1).exp()[:, None]  # prefixes (and continuations) drawn by mu
            want = tree.grad((p_mu * kl_t).sum())
            got = _code_grad(v, k, correction, kl_cfg=KLConfig(estimator="k3+", where="loss"))
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
            exact = _code_grad(v, k, correction, kl_cfg=KLConfig(exact=True, where="loss"), exact_kl=kl_t)
            torch.testing.assert_close(exact, want, atol=1e-12, rtol=1e-10)  # the exact KL: no token weight
            if k > 0:  # not the prefix distribution of pi
                on = tree.grad((v.logp(tree.theta).sum(1).exp().detach()[:, None] * kl_t).sum())
                assert _rel(got, on) > 1e-3
