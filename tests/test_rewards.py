"""Built-in tasks and their rewards, plug-in reward functions, NaN refusal, running normalisation."""

import math
import random
import re
import statistics

import pytest
import torch

from rl.experience.rewards import (
    CombinedReward,
    RewardConfig,
    RunningRewardNorm,
    build_reward,
    load_reward_fn,
    score_responses,
)
from rl.experience.tasks import CHARSET, ArithmeticTask, StringTask, make_task, sft_text


def plugin_length(meta, response):  # a plug-in for the tests: "tests.test_rewards:plugin_length"
    return float(len(response))


def plugin_nan(meta, response):
    return float("nan") if response == "bad" else 1.0


NOT_CALLABLE = 3


def test_arithmetic_rewards_vs_python():
    task = ArithmeticTask(max_operand=50, partial_credit=0.1)
    prompts = task.sample_prompts(40, random.Random(0))
    assert prompts == task.sample_prompts(40, random.Random(0))  # seeded
    assert len({p for p, _ in prompts}) > 20
    for prompt, meta in prompts:
        assert set(prompt) <= set(CHARSET) and set(meta["answer"]) <= set(CHARSET)
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", prompt).groups()
        want = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert task.reward(meta, str(want)) == 1.0
        assert task.reward(meta, f" {want}\ntrailing") == 1.0  # cut at newline, spaces stripped
        wrong = str(want + 1) if want + 1 != 0 and len(str(want + 1)) == len(str(want)) else str(want - 1)
        if len(wrong) == len(str(want)):
            assert task.reward(meta, wrong) == 0.1  # well-formed, right length
        assert task.reward(meta, str(want) + "0") == 0.0
        assert task.reward(meta, "abc") == 0.0
        assert sft_text(meta) == prompt + str(want)
    assert ArithmeticTask().reward({"answer": "19"}, "18") == 0.0  # partial credit off by default


@pytest.mark.parametrize("op,fn", [("rev", lambda s: s[::-1]), ("sort", lambda s: "".join(sorted(s))),
                                   ("copy", lambda s: s)])
def test_string_tasks_vs_python(op, fn):
    task = make_task(op, partial_credit=0.25, alphabet="abcd", max_len=5)
    for prompt, meta in task.sample_prompts(30, random.Random(1)):
        assert set(prompt) <= set(CHARSET)
        s = re.fullmatch(rf"{op}:([a-d]+)=", prompt).group(1)
        assert 2 <= len(s) <= 5
        assert task.reward(meta, fn(s)) == 1.0
        assert task.reward(meta, "a" * (len(s) + 1)) == 0.0
        if len(set(s)) > 1 or op != "copy":
            other = "".join("a" if c != "a" else "b" for c in fn(s))
            assert task.reward(meta, other) == 0.25
        assert task.reward(meta, "9" * len(s)) == 0.0


def test_task_errors():
    with pytest.raises(ValueError, match="unknown task 'mul'"):
        make_task("mul")
    with pytest.raises(ValueError, match="op"):
        StringTask(op="shuffle")
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops="*")


def test_score_responses_refuses_nan_naming_prompt_and_sample():
    metas = [{"answer": "1"}, {"answer": "2"}]
    out = score_responses(plugin_length, metas, ["a", "bb", "ccc", "dddd"], group_size=2)
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0] and out.dtype == torch.float32
    with pytest.raises(ValueError, match="prompt 1, sample 0 is nan"):
        score_responses(plugin_nan, metas, ["x", "y", "bad", "z"], group_size=2)
    with pytest.raises(ValueError, match="prompt 0, sample 1 is inf"):
        score_responses(lambda m, r: math.inf if r == "y" else 0.0, metas, ["x", "y", "z", "w"], 2)
    with pytest.raises(ValueError, match="prompt 0, sample 0 is not a number"):
        score_responses(lambda m, r: "high", metas, ["x", "y", "z", "w"], 2)
    with pytest.raises(ValueError, match="3 responses for 2 prompts"):
        score_responses(plugin_length, metas, ["a", "b", "c"], 2)


def test_plugin_specs():
    assert load_reward_fn("tests.test_rewards:plugin_length") is plugin_length
    for spec, msg in (("tests.test_rewards", "must look like"),
                      ("a:b:c", "must look like"),
                      ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
                      ("tests.test_rewards:missing", "has no attribute 'missing'"),
                      ("tests.test_rewards:NOT_CALLABLE", "not callable")):
        with pytest.raises(ValueError, match=re.escape(repr(spec))) as e:
            load_reward_fn(spec)
        assert msg in str(e.value)


def test_combined_reward_mean_and_min():
    task = ArithmeticTask()
    meta = {"answer": "12"}
    mean = CombinedReward([task.reward, "tests.test_rewards:plugin_length"], "mean")
    mn = CombinedReward([task.reward, "tests.test_rewards:plugin_length"], "min")
    assert mean(meta, "12") == (1.0 + 2.0) / 2 and mn(meta, "12") == 1.0
    assert mean(meta, "123") == 1.5 and mn(meta, "123") == 0.0
    task2, fn, norm = build_reward(RewardConfig(task="rev", fns=["tests.test_rewards:plugin_length"],
                                                combine="min", clip=2.0))
    assert isinstance(task2, StringTask) and fn({"answer": "ab"}, "ab") == 1.0 and norm.clip == 2.0
    _, fn1, _ = build_reward(RewardConfig())
    assert fn1({"answer": "7"}, "7") == 1.0
    with pytest.raises(ValueError, match="reward.combine"):
        RewardConfig(combine="max")


def test_running_norm_vs_statistics_and_round_trip():
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(n, generator=g) * 3 + 2 for n in (5, 1, 8)]
    norm = RunningRewardNorm(clip=None)
    seen = []
    for b in batches:
        out = norm.normalize_(b)
        seen += b.tolist()
        mu, sd = statistics.fmean(seen), statistics.pstdev(seen)
        assert abs(norm.mean - mu) < 1e-12 and abs(norm.std - sd) < 1e-9
        torch.testing.assert_close(out, (b - mu) / (sd + 1e-8))
    clone = RunningRewardNorm(clip=0.5)
    clone.load_state_dict(dict(norm.state_dict()))
    nxt = torch.tensor([100.0, -100.0, 2.0])
    clipped = clone.normalize_(nxt)
    assert clipped.abs().max() <= 0.5 and clipped.tolist()[:2] == [0.5, -0.5]
    assert RunningRewardNorm(clip=1.0, normalize=False).normalize_(torch.tensor([3.0, -0.5])).tolist() == \
        [1.0, -0.5]
    with pytest.raises(ValueError, match="expected keys"):
        clone.load_state_dict({"mean": 0.0})


def _norm_on_ranks():
    import torch.distributed as dist

    r = dist.get_rank()
    norm = RunningRewardNorm()
    outs = []
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + r)
        outs.append(norm.normalize_(torch.randn(3 + r, generator=g), dp_group=dist.group.WORLD))
    return norm.state_dict(), outs


def test_running_norm_global_over_dp(dist_pools):
    res = dist_pools.run(2, _norm_on_ranks)
    assert res[0][0] == pytest.approx(res[1][0], rel=0, abs=1e-12)  # identical state on every rank
    seen = []
    for step in range(2):
        seen += [x for r in range(2)
                 for x in torch.randn(3 + r, generator=torch.Generator().manual_seed(10 * step + r)).tolist()]
    assert abs(res[0][0]["mean"] - statistics.fmean(seen)) < 1e-12
    assert abs(math.sqrt(res[0][0]["m2"] / res[0][0]["count"]) - statistics.pstdev(seen)) < 1e-9
    assert res[0][0]["count"] == len(seen)
