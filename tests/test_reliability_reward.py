"""A reward plug-in on hostile input: every call bounded in time by a worker process that is killed
past reward.timeout_s; the math reward scores what used to hang or crash it."""

from __future__ import annotations

import os
import time

import pytest

from rl.experience.rewards import RewardConfig, build_reward, score_responses
from tests.reward_plugins import HANG


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow  # starts a reward worker: a fresh Python process
def test_a_hanging_plugin_is_killed_and_named_by_prompt_and_sample():
    _, fn, _ = build_reward(RewardConfig(task=None, fns=["tests.reward_plugins:plugin_hangs"], timeout_s=2))
    try:
        assert score_responses(fn, [{}], ["fine"], 1).tolist() == [1.0]  # starts the worker
        pid = fn.fn.worker.proc.pid
        t0 = time.monotonic()
        with pytest.raises(ValueError) as e:
            score_responses(fn, [{}, {}], ["ok", "ok", "ok", f"x {HANG}"], 2)
        took = time.monotonic() - t0
        msg = str(e.value)
        assert msg.startswith("reward for prompt 1, sample 1: ")
        assert "plug-in tests.reward_plugins:plugin_hangs" in msg and "reward.timeout_s=2" in msg
        assert HANG in msg  # the response
        assert took < 10, took
        assert not _alive(pid), "the hung worker must be killed"
        assert score_responses(fn, [{}], ["fine again"], 1).tolist() == [1.0]  # a fresh worker
    finally:
        fn.close()


@pytest.mark.slow  # starts a reward worker: a fresh Python process
def test_on_timeout_scores_instead_of_stopping(capsys):
    _, fn, _ = build_reward(RewardConfig(task=None, fns=["tests.reward_plugins:plugin_hangs"], timeout_s=1,
                                         on_timeout=-1.0))
    try:
        assert score_responses(fn, [{}], [HANG, "fine"], 2).tolist() == [-1.0, 1.0]
    finally:
        fn.close()
    assert "scored reward.on_timeout=-1.0" in capsys.readouterr().err


@pytest.mark.slow  # starts a reward worker: a fresh Python process
def test_plugin_output_on_stdout_does_not_break_the_worker():
    _, fn, _ = build_reward(RewardConfig(task=None, fns=["tests.reward_plugins:plugin_prints"]))
    try:
        assert score_responses(fn, [{}], ["a", "b"], 2).tolist() == [0.5, 0.5]
    finally:
        fn.close()


@pytest.mark.slow  # starts a reward worker: a fresh Python process
def test_the_worker_answers_a_rank_holding_over_1024_descriptors():
    """A rank that already holds more than 1024 file descriptors (a long run's sockets and files) gets its
    worker's pipes numbered past FD_SETSIZE: the call still waits on them (select() raised ValueError)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1100 + 64
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"the descriptor limit ({hard}) is below {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held = []
    _, fn, _ = build_reward(RewardConfig(task=None, fns=["tests.reward_plugins:digits_over_5"]))
    try:
        while not held or held[-1] < 1100:  # every descriptor below 1100 taken: the pipes come after
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert score_responses(fn, [{}], ["12345", "1234567890"], 2).tolist() == [1.0, 2.0]
        assert min(fn.fn.worker.proc.stdout.fileno(), fn.fn.worker.proc.stdin.fileno()) > 1024
    finally:
        fn.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow  # starts a reward worker: a fresh Python process
def test_task_reward_runs_in_the_rank_and_plugins_in_the_worker():
    _, task_only, _ = build_reward(RewardConfig(task="arithmetic"))
    assert not hasattr(task_only.fn, "worker")  # the exact-match task reward pays no round trip
    _, inline, _ = build_reward(RewardConfig(task=None, fns=["math"], timeout_s=0))
    assert inline.fn.worker is None


@pytest.mark.parametrize("bad", [-1, float("nan"), "10", True])
def test_timeout_key_is_checked(bad):
    with pytest.raises(ValueError, match="reward.timeout_s"):
        RewardConfig(timeout_s=bad)


def test_on_timeout_key_is_checked():
    with pytest.raises(ValueError, match="reward.on_timeout"):
        RewardConfig(on_timeout="zero")


@pytest.mark.slow  # starts a reward worker: a fresh Python process
def test_math_reward_scores_a_tower_of_powers_in_bounded_time():
    """`\\boxed{10^{10^{10}}}` as a response and as a gold answer: math-verify's own limits in the
    worker's main thread say "not equal" (score 0) well inside reward.timeout_s."""
    pytest.importorskip("math_verify")
    _, fn, _ = build_reward(RewardConfig(task=None, fns=["math"], timeout_s=30))
    try:
        t0 = time.monotonic()
        got = score_responses(fn, [{"answer": "5"}, {"answer": "10^{10^{10}}"}],
                              ["\\boxed{10^{10^{10}}}", "\\boxed{5}", "\\boxed{4}", "\\boxed{10^{10^{10}}}"], 2)
        assert got.tolist() == [0.0, 1.0, 0.0, 1.0]
        assert time.monotonic() - t0 < 30
    finally:
        fn.close()


def test_a_number_past_the_int_conversion_limit_scores():
    """More than sys.get_int_max_str_digits() (4,300) digits: compared as text, not a ValueError."""
    from rl.experience.math_reward import MathReward

    big = "7" * 5000
    reward = MathReward(use_math_verify=False)
    assert reward({"answer": big}, f"the answer is {big}") == 1.0
    assert reward({"answer": "5"}, f"the answer is {big}") == 0.0
    assert reward({"answer": big}, "the answer is 5") == 0.0


@pytest.mark.slow
def test_a_hanging_reward_at_dp2_is_named_not_blamed_on_a_frozen_rank(tmp_path):
    """torchrun, dp=2, a plug-in that hangs on rank 1: the run ends within reward.timeout_s (not
    parallel.timeout_s) with every rank naming the plug-in, the prompt and the sample."""
    from rl.train import main
    from tests.dist import REPO, run_torchrun

    config = os.path.join(REPO, "configs", "grpo_tiny.yaml")
    small = ["model.hidden_size=32", "model.intermediate_size=64", "init.sft_steps=5", "init.sft_examples=200",
             "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=4", "train.progress=false",
             f"init.sft_dir={tmp_path / 'sft'}"]
    assert main(["--config", config, *small, f"train.out_dir={tmp_path / 'first'}", "train.steps=1"]) == 0
    t0 = time.monotonic()
    res = run_torchrun(["rl.train", "--config", config, *small, f"train.out_dir={tmp_path / 'hang'}",
                        "train.steps=3", "reward.fns=[tests.reward_plugins:plugin_hangs_on_rank_1]",
                        "reward.timeout_s=3", "parallel.timeout_s=300"], nproc=2, timeout=240)
    took = time.monotonic() - t0
    assert res.returncode != 0 and took < 200, (took, res.stderr[-3000:])
    assert "reward for prompt 0, sample 0: " in res.stderr, res.stderr[-3000:]
    assert "plug-in tests.reward_plugins:plugin_hangs_on_rank_1" in res.stderr and "reward.timeout_s=3" in res.stderr
    assert "has not advanced" not in res.stderr and "collective failed" not in res.stderr, res.stderr[-3000:]
