"""The KL's place and gradient in a real (tiny, single-process) trainer: PPO's default puts k1 in the
reward; the exact KL in the reward reaches the loss as its pathwise term; kl.gradient=sequence hands each
token its future KL (rl.objectives.kl_place.future_kl of the rollout's KL, every row computed before the update);
the fused head and the unfused path take the same steps. The gradients themselves are proven by
enumeration in tests/test_kl_sequence.py; here, the wiring."""

import pytest
import torch

from rl.objectives import losses
from rl.objectives.kl_place import future_kl
from tests.test_playbook_trainer import _trainer


class _Spy:
    """Records every TokenPolicyLoss the trainer builds and the KL each call receives."""

    def __init__(self, monkeypatch):
        self.made, self.kl_seen = [], []
        real, spy = losses.TokenPolicyLoss, self

        class Recording(real):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                spy.made.append((self, kw.get("kl_future"), a[4]))  # a[4]: the advantages passed in

            def __call__(self, logp, entropy, kl, tokens):
                spy.kl_seen.append(kl is not None)
                return super().__call__(logp, entropy, kl, tokens)

        import rl.objectives.policy_objectives

        # the update builds its loss with make_token_loss, which makes a TokenPolicyLoss for loss.policy=ppo
        monkeypatch.setattr(rl.objectives.policy_objectives, "TokenPolicyLoss", Recording)


def test_ppo_default_is_k1_in_the_reward():
    tr = _trainer(["algo.name=ppo"])
    assert (tr.cfg.kl.where, tr.cfg.kl.estimator, tr.cfg.kl.gradient) == ("reward", "k1", "sequence")
    with pytest.raises(ValueError, match=r"kl.estimator='k3\+' with kl.where='reward'.*use kl.estimator='k1'"):
        _trainer(["algo.name=ppo", "kl.estimator=k3+"])


@pytest.mark.slow
def test_exact_kl_in_the_reward_enters_the_loss(monkeypatch):
    spy = _Spy(monkeypatch)
    tr = _trainer(["algo.name=ppo", "kl.exact=true", "kl_ctl.beta=0.5"])
    rec = tr.step(0)
    fn, fut, _ = spy.made[0]
    assert fn.kl_in_loss and fut is None and all(spy.kl_seen)
    assert rec["kl_loss"] > 0 and rec["kl_mean"] > 0  # policy and reference differ (seeds 11, 12)


@pytest.mark.slow
def test_sequence_gradient_hands_each_token_its_future_kl(monkeypatch):
    spy = _Spy(monkeypatch)
    tr = _trainer(["kl.gradient=sequence", "kl_ctl.beta=0.5"])
    assert tr.cfg.kl.where == "loss" and tr.cfg.kl.estimator == "k3+"
    data = tr.make_experience(0)
    # the KL of every row is needed before the update
    assert tr.experience._deferred_rows(data.ro, 0) is None and data.deferred is None
    tr.update(data, 0)
    fut = future_kl(data.kl, data.mask)
    got = sum(float(f.double().sum()) for _, f, _ in spy.made)
    assert got == pytest.approx(float(fut.double().sum()), rel=1e-12) and float(fut.abs().sum()) > 0
    for fn, f, adv in spy.made:  # the advantages the surrogate sees: the rollout's minus beta x future KL
        zero = torch.zeros((), dtype=torch.float64)
        want = torch.where(fn.m, adv.reshape(-1).double() - 0.5 * f.reshape(-1).double(), zero)
        torch.testing.assert_close(fn.adv.double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.slow  # ~9 s a case on 2 cores
@pytest.mark.parametrize("ov", [["algo.name=ppo", "kl.exact=true"], ["kl.gradient=sequence", "algo.mini_batches=2"],
                                ["kl.gradient=sequence", "kl.exact=true"],
                                ["kl.where=reward", "kl.exact=true"],  # GRPO: shared prompts, packed groups
                                ["algo.name=ppo", "kl.exact=true", "algo.micro_batch_tokens=64",
                                 "algo.pack_sequences=true"]], ids=str)
def test_fused_and_unfused_take_the_same_steps(ov):
    def run(extra):
        tr = _trainer(ov + ["kl_ctl.beta=0.5"] + extra)
        recs = [tr.step(s) for s in range(2)]
        return [{k: r[k] for k in ("kl_mean", "pg_loss", "kl_loss", "grad_norm")} for r in recs]

    for a, b in zip(run([]), run(["algo.fused_loss=false"])):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


def test_sequence_gradient_is_refused_with_grad_ratio():
    with pytest.raises(ValueError, match="grad_ratio.*kl.gradient='sequence'"):
        _trainer(["kl.gradient=sequence", "kl_ctl.preset=grad_ratio"])
