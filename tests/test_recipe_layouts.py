"""Each recipe's objective and advantage through the trainer (2 steps, 2 epochs x 2 mini-batches, float64) does
not depend on the layout: tp 2, dp 2, the shared-prompt layout or not, token-budget micro-batches (trimmed and
packed), the fused head or not, all against one process with one micro-batch per mini-batch."""

import pytest
import torch

from tests.test_rl_trainer import _steps_and_logits

pytestmark = pytest.mark.slow  # 2-step trainer runs in float64: 5-10 s each on a 2-core machine

OFF = ["algo.epochs=2", "algo.mini_batches=2", "kl.estimator=k3+"]
RECIPES = {
    "gspo": OFF + ["loss.policy=gspo", "loss.agg=seq-mean-token-mean", "loss.clip_low=0.1", "loss.clip_high=0.15"],
    "gspo_token_kl_seq": OFF + ["loss.policy=gspo_token", "kl.gradient=sequence", "kl.estimator=k1+",
                                "loss.clip_low=0.1"],
    "cispo": OFF + ["loss.policy=cispo", "loss.clip_low=1.0", "loss.clip_high=0.05"],
    "rloo": OFF + ["algo.advantage=rloo", "kl.where=reward", "kl.estimator=k1"],
    "reinforce_pp": OFF + ["algo.advantage=reinforce_pp", "kl.where=reward", "kl.estimator=k1"],
    "reinforce_pp_baseline": OFF + ["algo.advantage=reinforce_pp_baseline", "algo.adv_std_norm=false"],
}
KEYS = ("reward_mean", "kl_mean", "pg_loss", "grad_norm", "entropy", "ratio_mean", "clipfrac", "kl_loss",
        "seq_clipfrac", "seq_ratio_mean", "ds_rounds", "ds_drop_rate", "ds_groups_sampled", "ds_filled",
        "overlong_rate", "response_len", "samples")


# DAPO with its data side: dynamic sampling (rounds of new prompts), overlong filter and punishment
DAPO = ["algo.recipe=dapo", "reward.fns=[tests.reward_plugins:sevens]", "algo.dynamic_sampling_max_rounds=3",
        "rollout.group_size=2"]
LAYOUTS = {  # single-process variants of the same update
    "unshared": ["algo.share_prompts=false"],
    "budget": ["algo.share_prompts=false", "algo.micro_batch_tokens=40"],
    "packed": ["algo.share_prompts=false", "algo.micro_batch_tokens=40", "algo.pack_sequences=true"],
    "shared_budget": ["algo.micro_batch_tokens=40"],
    "unfused": ["algo.fused_loss=false", "algo.micro_batch_size=3"],
}


def _run(tp, dp, overrides):
    return _steps_and_logits(tp, dp, overrides, keys=KEYS, optional=KEYS)


def _same(a, b):
    (ra, la), (rb, lb) = a, b
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for k in x:
            assert y[k] == pytest.approx(x[k], rel=1e-6, abs=1e-8), k
    torch.testing.assert_close(lb, la, atol=1e-7, rtol=1e-7)


@pytest.fixture(scope="module")
def singles():
    torch.set_num_threads(1)
    return {name: _run(1, 1, ov) for name, ov in RECIPES.items()}


def test_recipes_move_the_policy(singles):
    for name, (recs, _) in singles.items():
        assert recs[0]["grad_norm"] > 0 and recs[1]["grad_norm"] > 0, name
        if name.startswith("gspo"):  # the off-policy mini-batches clip some responses, not all
            assert 0.0 < recs[1]["seq_clipfrac"] < 1.0, recs[1]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_single_process_layouts(singles, layout):
    for name in ("gspo", "gspo_token_kl_seq", "cispo"):
        _same(singles[name], _run(1, 1, RECIPES[name] + LAYOUTS[layout]))


def test_gspo_and_reinforce_pp_dp2(dist_pools, singles):
    for name in ("gspo", "reinforce_pp"):
        for r in dist_pools.run(2, _run, 1, 2, RECIPES[name]):
            _same(singles[name], r)


def test_every_recipe_tp2_and_dp2(dist_pools, singles):
    for name, ov in RECIPES.items():
        _same(singles[name], dist_pools.run(2, _run, 2, 1, ov)[0])
        for r in dist_pools.run(2, _run, 1, 2, ov + ["algo.micro_batch_tokens=40"]):
            _same(singles[name], r)


def test_dapo_through_the_trainer_at_tp2(dist_pools):
    """Dynamic sampling's extra rounds (prompts of other lengths concatenated, the kept groups under the regular
    row ids) feed an ordinary step: the same at tp 2 as in one process."""
    torch.set_num_threads(1)
    single = _run(1, 1, DAPO)
    recs = single[0]
    assert all(r["samples"] == 8 for r in recs)  # 4 prompts x 2 samples, however many rounds
    assert sum(r["ds_rounds"] for r in recs) > 0 and all(0 < r["ds_drop_rate"] < 1 for r in recs)
    _same(single, dist_pools.run(2, _run, 2, 1, DAPO)[0])
    # dp 2: each rank fills its own share (so not the single process's batch), in the same rounds on both
    r0, r1 = dist_pools.run(2, _run, 1, 2, DAPO)
    _same(r0, r1)
    assert all(r["samples"] == 8 for r in r0[0])
