"""algo.recipe (rl/recipes.py): each recipe sets its paper's keys, says so, and yields to the config's own keys;
an unknown one is refused by name; combinations that follow no paper are refused. DAPO's data side
(rl/experience/dynamic_sampling.py): the truncation test, the soft punishment of DAPO eq. 13, and dynamic
sampling's rounds, agreed over DP."""

import pytest
import torch

from core.config import ConfigError, load_config
from rl.config import RLConfig
from rl.experience.dynamic_sampling import collect_step, overlong_punishment, truncated
from rl.experience.rollout import Rollout
from rl.recipes import RECIPES

TASK = ["reward.task=arithmetic"]


def _cfg(*ov, path=None):
    return load_config(RLConfig, path, TASK + list(ov))


def test_every_recipe_sets_its_keys_and_the_config_wins():
    for name, (keys, _) in RECIPES.items():
        cfg = _cfg(f"algo.recipe={name}")
        for dotted, v in keys({"_max_new_default": 12}).items():
            sec, k = dotted.split(".")
            assert getattr(getattr(cfg, sec), k) == v, (name, dotted)
        assert cfg.recipe_summary.startswith(f"algo.recipe={name}: set ") and "arXiv" in cfg.recipe_summary
    cfg = _cfg("algo.recipe=dapo", "loss.clip_high=0.3")
    assert cfg.loss.clip_high == 0.3 and cfg.loss.clip_low == 0.2 and cfg.algo.dynamic_sampling
    assert "kept your loss.clip_high=0.3 (the recipe's: 0.28)" in cfg.recipe_summary
    # a config file's key wins too; `key=null` hands it back to the recipe
    cfg = _cfg("algo.recipe=dr_grpo", path="configs/grpo_tiny.yaml")
    assert cfg.loss.agg == "token-mean" and not cfg.algo.adv_std_norm
    cfg = _cfg("algo.recipe=dr_grpo", "loss.agg=null", path="configs/grpo_tiny.yaml")
    assert cfg.loss.agg == "seq-mean-token-sum-norm" and cfg.loss.norm_len == 6.0  # the file's max_new_tokens
    assert _cfg("algo.recipe=dapo", "rollout.max_new_tokens=100").algo.overlong_buffer == 20


def test_unknown_recipe_and_mismatched_keys_are_refused():
    with pytest.raises(ConfigError, match=r"algo.recipe must be one of grpo, dapo, .*got 'ppo2'"):
        _cfg("algo.recipe=ppo2")
    with pytest.raises(ConfigError, match="gspo_token"):
        _cfg("loss.policy=gspo", "algo.name=ppo")
    with pytest.raises(ConfigError, match="gspo_token"):
        _cfg("loss.policy=gspo", "algo.advantage=reinforce_pp", "kl.where=reward")
    with pytest.raises(ConfigError, match="loss.dual_clip"):
        _cfg("loss.policy=cispo", "loss.dual_clip=3.0")
    with pytest.raises(ConfigError, match="algo.advantage"):
        _cfg("algo.advantage=rloo", "algo.name=ppo")
    with pytest.raises(ConfigError, match="overlong_buffer"):
        _cfg("algo.overlong_buffer=12")
    with pytest.raises(ConfigError, match="loss.policy"):
        _cfg("loss.policy=grpo")
    assert _cfg("loss.policy=gspo_token", "algo.name=ppo").loss.policy == "gspo_token"


def test_overlong_punishment_is_dapo_eq13():
    L_max, L_cache = 20, 4
    lengths = torch.arange(0, L_max + 1)
    want = torch.tensor([0.0 if n <= L_max - L_cache else ((L_max - L_cache) - n) / L_cache for n in range(L_max + 1)])
    torch.testing.assert_close(overlong_punishment(lengths, L_max, L_cache, 1.0), want)
    torch.testing.assert_close(overlong_punishment(lengths, L_max, L_cache, 0.5), want * 0.5)


def _rollout(lens, last_tokens, scores, N=4, P=2, row0=0, responses=None):
    B = len(lens)
    seq = torch.full((B, P + N), 7)
    rm = torch.arange(N)[None, :] < torch.tensor(lens)[:, None]
    for b, (n, tok) in enumerate(zip(lens, last_tokens)):
        if n:
            seq[b, P + n - 1] = tok
    att = torch.cat([torch.ones(B, P, dtype=torch.long), rm.long()], 1)
    return Rollout(seq, att, rm, P, torch.tensor(scores, dtype=torch.float32), torch.arange(row0, row0 + B),
                   [{"prompt": f"p{row0 + i}"} for i in range(B // 2)], responses or [""] * B)


def test_truncated_needs_the_limit_and_no_stop():
    ro = _rollout([4, 4, 2, 4], [9, 1, 9, 9], [0, 0, 0, 0], responses=["a", "b", "c", "x STOP"])
    assert truncated(ro, 4, [1], ["STOP"]).tolist() == [True, False, False, False]


class _Cfg:
    def __init__(self, **algo):
        from types import SimpleNamespace as NS
        a = dict(dynamic_sampling=True, dynamic_sampling_max_rounds=3, overlong_filter=False, overlong_buffer=0,
                 overlong_penalty=1.0)
        a.update(algo)
        self.algo = NS(**a)
        self.rollout = NS(group_size=2, max_new_tokens=4, stop=[])
        self.train = NS(steps=100)


class _Tok:
    eos_id, eos_ids = 1, [1]


def _collect_for(rank, plan):
    """A fake rollout source: at key step k, this rank's 2 groups of 2 with the scores plan[rank][k]."""
    def collect(key):
        r = (key % 100 == 0) and key // 100 or 0
        sc = plan[rank][r]
        return _rollout([2] * 4, [1] * 4, sc, row0=100 * key + 4 * rank)
    return collect


def test_dynamic_sampling_keeps_signal_groups_and_counts_the_rounds():
    # round 0: group 0 constant, group 1 informative; round 1: both constant; round 2: group 0 informative
    plan = {0: [[1, 1, 0, 1], [0, 0, 1, 1], [0, 1, 1, 1]]}
    stats = {}
    ro, met = collect_step(_collect_for(0, plan), _Cfg(), 0, tokenizer=_Tok(), pad_id=0, dp_rank=0, dp_group=None,
                           stats=stats)
    assert ro.scores.tolist() == [0, 1, 0, 1]  # round 0's group 1, then round 2's group 0
    assert [m["prompt"] for m in ro.metas] == ["p1", "p20000"]
    assert ro.row_ids.tolist() == [0, 1, 2, 3]
    assert met["ds_rounds"] == 2 and met["ds_drop_rate"] == 0.5 and met["ds_filled"] == 0
    assert met["ds_groups_sampled"] == 6
    # capped: one extra round only, the short share filled with a dropped group
    ro, met = collect_step(_collect_for(0, plan), _Cfg(dynamic_sampling_max_rounds=1), 0, tokenizer=_Tok(),
                           pad_id=0, dp_rank=0, dp_group=None, stats={})
    assert met["ds_rounds"] == 1 and met["ds_filled"] == 1 and ro.scores.tolist() == [0, 1, 1, 1]


def test_overlong_filter_masks_truncated_rows_and_punishes():
    def collect(key):
        return _rollout([4, 2, 4, 3], [9, 1, 1, 1], [1.0, 1.0, 0.0, 1.0])
    ro, met = collect_step(collect, _Cfg(dynamic_sampling=False, overlong_filter=True, overlong_buffer=2), 0,
                           tokenizer=_Tok(), pad_id=0, dp_rank=0, dp_group=None, stats={})
    assert ro.response_mask.sum(1).tolist() == [0, 2, 4, 3]  # row 0 ran to the limit without EOS
    assert ro.scores.tolist() == [0.0, 1.0, -1.0, 0.5]  # -1 at the limit, -0.5 one token before
    assert met["overlong_rate"] == 0.25 and met["overlong_penalty_mean"] == pytest.approx(-2.5 / 4)


def _dp_dynamic(plan):
    import torch.distributed as dist

    rank = dist.get_rank()
    ro, met = collect_step(_collect_for(rank, plan), _Cfg(), 0, tokenizer=_Tok(), pad_id=0, dp_rank=rank,
                           dp_group=dist.group.WORLD, stats={})
    return ro.scores.tolist(), ro.row_ids.tolist(), met


def test_dynamic_sampling_rounds_agreed_over_dp(dist_pools):
    # rank 0 is full after round 0; rank 1 needs two extra rounds: both run them (generation is collective)
    plan = {0: [[0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], 1: [[1, 1, 0, 0], [0, 0, 1, 1], [0, 1, 1, 0]]}
    (s0, ids0, m0), (s1, ids1, m1) = dist_pools.run(2, _dp_dynamic, plan)
    assert m0 == m1 and m0["ds_rounds"] == 2 and m0["ds_drop_rate"] == 0.5 and m0["ds_groups_sampled"] == 12
    assert s0 == [0, 1, 1, 0] and s1 == [0, 1, 1, 0]
    assert ids0 == [0, 1, 2, 3] and ids1 == [4, 5, 6, 7]
