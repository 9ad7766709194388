"""The playbook's hooks in a real (tiny, single-process) trainer: grad_ratio sets each step's beta
from the logged gradient norms; the entropy target moves the coefficient by its rule; the new
metrics are in every record; kl.where=auto puts PPO's KL in the reward."""

import math

import pytest
import torch

from core.config import ModelConfig, load_config
from core.model import build_model
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel, kv_replica_group
from rl.config import RLConfig
from rl.models.critic import Critic
from rl.train import assemble
from tools.diagnose import diagnose

MODEL = dict(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
             max_seq_len=64)
BASE = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "reward.use_task_reward=false", "reward.fns=[tests.reward_plugins:digits_over_6]", "optim.lr=1e-2",
        "optim.warmup_steps=0", "optim.grad_clip=0.5", "train.progress=false"]


def _trainer(overrides):
    torch.set_num_threads(1)
    cfg = load_config(RLConfig, None, BASE + list(overrides))
    mc = ModelConfig(**MODEL)
    state = init_parallel(ParallelDims(1, 1), "cpu", mc.n_heads, mc.n_kv_heads)
    kv = kv_replica_group(state, mc.n_kv_heads)
    policy, ref = build_model(mc, state.tp_group, kv, seed=11), build_model(mc, state.tp_group, kv, seed=12)
    critic = None
    if cfg.algo.name == "ppo":
        critic = Critic(mc, state.tp_group, kv)
        critic.body.init_weights(11)
    return assemble(cfg, state, mc, load_tokenizer(None), policy, ref, critic)


@pytest.mark.slow
def test_grad_ratio_and_entropy_target_through_the_trainer(capsys):
    tr = _trainer(["kl_ctl.preset=grad_ratio", "loss.entropy_target=3.0", "loss.entropy_lr=0.01",
                   "loss.entropy_coef_max=0.5"])
    assert "kl_ctl.preset=grad_ratio: set mode=grad_ratio" in capsys.readouterr().out
    coef = 0.0
    for s in range(3):
        rec = tr.step(s)
        assert rec["beta"] == pytest.approx(min(0.1 * rec["pg_grad_norm"] / rec["kl_grad_norm"], 10.0), rel=1e-9)
        assert rec["entropy_coef"] == pytest.approx(coef)
        coef = min(max(coef + 0.01 * (3.0 - rec["entropy"]), 0.0), 0.5)
        assert rec["entropy_max"] == pytest.approx(math.log(256))
        assert 0.0 <= rec["repetition_rate"] <= 1.0
    assert -1.0 <= rec["reward_kl_corr"] <= 1.0
    assert tr.ent_ctl.coef == pytest.approx(coef)


@pytest.mark.slow
def test_ppo_auto_puts_the_kl_in_the_reward():
    tr = _trainer(["algo.name=ppo", "kl_ctl.beta=0.5"])
    assert tr.cfg.kl.where == "reward"
    rec = tr.step(0)
    assert math.isfinite(rec["kl_mean"]) and rec["kl_mean"] > 0  # the reference differs: a KL to pay in the reward


def _names_after(overrides, steps=14, window=10, same_ref=False):
    tr = _trainer(overrides)
    if same_ref:
        with torch.no_grad():
            for (_, p), (_, q) in zip(tr.policy.named_parameters(), tr.ref.named_parameters()):
                q.copy_(p)
    rows = [tr.step(s) for s in range(steps)]
    return [f.name for f in diagnose(rows, window)]


@pytest.mark.slow
def test_real_run_huge_beta_keeps_the_reward_flat():
    """beta 5 against a reference the policy does not start at: the penalty pulls the KL to near 0 and the
    reward stays flat (kl_flat_reward, design document 003's "KL near 0 and reward stalled"; a flat reward is
    judged on 40 steps or more: fewer cannot tell a flat reward from sampling noise)."""
    names = _names_after(["kl_ctl.beta=5", "kl_ctl.beta_max=10", "optim.lr=1e-3"], steps=45)
    assert "kl_flat_reward" in names or "reward_flat_kl_normal" in names, names


@pytest.mark.slow
def test_real_run_without_a_penalty_buys_reward_with_kl():
    """beta 0, lr 1e-2 on a dense reward: no penalty (beta_zero, named first), and reward and KL climb together
    (reward_hacking, judged on the 20 steps or more after the start-up)."""
    names = _names_after(["kl_ctl.beta=0", "kl_ctl.beta_min=0", "optim.lr=1e-2"], steps=31)
    assert names[0] == "beta_zero" and "reward_hacking" in names, names


@pytest.mark.slow
def test_real_run_repetitive_reference_repeats_at_a_low_kl():
    """Policy = reference, a head that only ever picks token 40 or 41: responses repeat their 3-grams while
    the KL stays near 0 (the penalty holds the policy on a degenerate reference)."""
    tr = _trainer(["rollout.max_new_tokens=12", "kl_ctl.beta=1", "optim.lr=1e-4"])
    u = torch.randn(32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for (_, p), (_, q) in zip(tr.policy.named_parameters(), tr.ref.named_parameters()):
            q.copy_(p)
        for mod in (tr.policy, tr.ref):
            w = dict(mod.named_parameters())["lm_head.weight"]
            w.zero_()
            w[40], w[41] = 3 * u, -3 * u
    rows = [tr.step(s) for s in range(10)]
    names = [f.name for f in diagnose(rows, 10)]
    assert "repetition_kl_not_high" in names and "kl_adv_spike" not in names
