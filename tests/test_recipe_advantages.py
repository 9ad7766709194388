"""The critic-free advantages (rl/objectives/advantages.py) against their papers' formulas in float64: RLOO's
leave-one-out baseline, REINFORCE++'s batch-normalised returns (with the KL per token in the reward) and its
group-baseline variant, GRPO with and without the std (Dr. GRPO); each recipe's policy gradient against the
paper's estimator by autograd on a tiny softmax policy (on-policy and pi_old != pi); REINFORCE++'s global
normalisation over 2 DP ranks against one process."""

import pytest
import torch

from rl.objectives.advantages import outcome_advantages, reinforce_pp_advantages, rloo_advantages
from rl.objectives.losses import PolicyLossConfig
from rl.objectives.policy_objectives import make_token_loss
from tests.test_policy_objectives import B, S, _case, _logp

G = 4


def _scores(n_groups=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (n_groups * G,), generator=g).double() + 0.25 * torch.rand(n_groups * G, generator=g,
                                                                                           dtype=torch.float64)


def test_rloo_is_leave_one_out():
    r = _scores()
    got = rloo_advantages(r, G)
    want = torch.stack([r[i] - (r[(i // G) * G:(i // G + 1) * G].sum() - r[i]) / (G - 1) for i in range(r.numel())])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(r, 1)


def _mask(lens):
    return torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]


def _whiten_ref(x, m, eps=1e-8):
    v = x[m]
    mean, var = v.mean(), v.var(unbiased=True)
    return torch.where(m, (x - mean) / torch.sqrt(var + eps), torch.zeros((), dtype=x.dtype))


@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_reinforce_pp_returns_normalised_over_the_batch(baseline, beta):
    """REINFORCE++ eq. (2)-(4): A_t = r(x, y) - beta sum_{i >= t} KL_i, then (A - mean) / std over every token of
    the batch; -baseline: each score minus its group's mean first."""
    r = _scores()
    lens = [3, 1, 4, 2, 2, 4, 1, 3]
    m = _mask(lens)
    kl = torch.rand(m.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    s = r.clone()
    if baseline:
        s = s - s.view(-1, G).mean(1).repeat_interleave(G)
    ret = torch.zeros(m.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        for t in range(n):
            ret[b, t] = s[b] - beta * kl[b, t:n].sum()
    want = _whiten_ref(ret, m)
    got = reinforce_pp_advantages(r, m, G, baseline=baseline, kl=kl if beta else None, beta=beta)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    via = outcome_advantages("reinforce_pp_baseline" if baseline else "reinforce_pp", r, m, G, kl=kl, beta=beta,
                             kl_in_reward=beta != 0.0)
    torch.testing.assert_close(via, want, rtol=1e-12, atol=1e-12)


def test_grpo_with_and_without_std():
    r = _scores()
    m = _mask([2] * r.numel())
    g = r.view(-1, G)
    dr = (g - g.mean(1, keepdim=True)).reshape(-1)
    std = (dr.view(-1, G) / (g.std(1, unbiased=True, keepdim=True) + 1e-6)).reshape(-1)
    torch.testing.assert_close(outcome_advantages("grpo", r, m, G, std_norm=False)[:, 0], dr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outcome_advantages("grpo", r, m, G, std_norm=True)[:, 0], std, rtol=1e-12,
                               atol=1e-12)


# ---- each recipe's policy gradient against its paper's estimator, on the tiny policy of test_policy_objectives ----

def _recipe_loss(agg, norm_len, adv, mask, old, lp):
    cfg = PolicyLossConfig(policy="ppo", agg=agg, norm_len=norm_len)
    m = mask.bool()
    n = m.sum(1, keepdim=True).double()
    w = {"token-mean": torch.ones(m.shape, dtype=torch.float64) / m.sum(),
         "seq-mean-token-mean": torch.ones(m.shape, dtype=torch.float64) / (n * B),
         "seq-mean-token-sum-norm": torch.full(m.shape, 1.0 / ((norm_len or 1.0) * B), dtype=torch.float64)}[agg]
    on = old is None
    fn = make_token_loss(cfg, torch.where(m, w, torch.zeros((), dtype=torch.float64)), mask,
                           torch.zeros(B, S, dtype=torch.float64) if on else old, adv, on_policy=on)
    return fn(lp.reshape(-1), None, None, slice(None)).sum()


@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("recipe", ["rloo", "dr_grpo", "reinforce_pp"])
def test_recipe_gradient_equals_paper_estimator(recipe, off_policy):
    """RLOO (Ahmadian et al. eq. 6): 1/k sum_i (R_i - mean_{j != i} R_j) grad log pi(y_i); Dr. GRPO (Liu et al.
    eq. 3): 1/G sum_i 1/L_max sum_t (R_i - mean R) grad log pi(y_t), with the PPO ratio off-policy;
    REINFORCE++: the token mean of the normalised returns times the clipped ratio's gradient."""
    h, w, t, mask, old = _case(seed=6, off_policy=off_policy)
    r = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)  # one group of the three responses
    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp = _logp(hl, wl, t)
    o = lp.detach() if old is None else old
    ratio = torch.exp(lp - o)
    if recipe == "rloo":
        a = torch.stack([r[i] - (r.sum() - r[i]) / (B - 1) for i in range(B)])
        agg, norm_len, adv_tok = "seq-mean-token-sum-norm", 1.0, a[:, None].expand(B, S)
        surr = torch.where(a[:, None] >= 0, torch.minimum(ratio, torch.full_like(ratio, 1.2)),
                           torch.maximum(ratio, torch.full_like(ratio, 0.8))) * a[:, None]
        ref = -(surr * mask).sum(1).mean()
        ours_adv = outcome_advantages("rloo", r, mask, B)
    elif recipe == "dr_grpo":
        a = r - r.mean()
        agg, norm_len, adv_tok = "seq-mean-token-sum-norm", 4.0, a[:, None].expand(B, S)
        surr = torch.where(a[:, None] >= 0, torch.minimum(ratio, torch.full_like(ratio, 1.2)),
                           torch.maximum(ratio, torch.full_like(ratio, 0.8))) * a[:, None]
        ref = -((surr * mask).sum(1) / 4.0).mean()
        ours_adv = outcome_advantages("grpo", r, mask, B, std_norm=False)
    else:
        adv_tok = _whiten_ref(r[:, None].expand(B, S).clone(), mask)
        agg, norm_len = "token-mean", None
        surr = torch.where(adv_tok >= 0, torch.minimum(ratio, torch.full_like(ratio, 1.2)),
                           torch.maximum(ratio, torch.full_like(ratio, 0.8))) * adv_tok
        ref = -(surr * mask).sum() / mask.sum()
        ours_adv = outcome_advantages("reinforce_pp", r, mask, B)
    torch.testing.assert_close(ours_adv, torch.where(mask, adv_tok, torch.zeros((), dtype=torch.float64)),
                               rtol=1e-12, atol=1e-12)
    ref.backward()
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = _recipe_loss(agg, norm_len, ours_adv, mask, old, _logp(hh, ww, t))
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ww.grad, wl.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hh.grad, hl.grad, rtol=1e-12, atol=1e-12)


def _reinforce_pp_dp(baseline):
    import torch.distributed as dist

    rank = dist.get_rank()
    r = _scores(n_groups=4)
    lens = [3, 1, 4, 2, 2, 4, 1, 3] * 2
    m = _mask(lens)
    kl = torch.rand(m.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    half = slice(rank * 8, rank * 8 + 8)
    return reinforce_pp_advantages(r[half], m[half], G, baseline=baseline, kl=kl[half], beta=0.2,
                                   dp_group=dist.group.WORLD)


def test_reinforce_pp_normalises_over_every_dp_rank(dist_pools):
    for baseline in (False, True):
        r = _scores(n_groups=4)
        m = _mask([3, 1, 4, 2, 2, 4, 1, 3] * 2)
        kl = torch.rand(m.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        one = reinforce_pp_advantages(r, m, G, baseline=baseline, kl=kl, beta=0.2)
        got = dist_pools.run(2, _reinforce_pp_dp, baseline)
        torch.testing.assert_close(torch.cat(got), one, rtol=1e-12, atol=1e-12)
