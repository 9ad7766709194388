"""Reliability weak spots, in process and on 2 gloo ranks: bad converter configs and kl_eval --out
named before any work, reward plug-ins that raise / return a non-number / overflow named by prompt
and sample on every rank, metrics truncated to the resumed step, diagnose keeping the last record of
a step, collapse guards, the stop-request agreement under a real signal, the watchdog naming a
stalled rank, and ranks with different configs or code refused by key."""

from __future__ import annotations

import json
import math
import os
import signal
import time

import pytest

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
         "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 131, "max_position_embeddings": 64}
BAD_HF = {
    "heads_zero": ({"num_attention_heads": 0}, "key 'num_attention_heads' must be a positive integer, found 0"),
    "vocab_string": ({"vocab_size": "256"}, "key 'vocab_size' must be a positive integer, found '256' (str)"),
    "hidden_float": ({"hidden_size": 32.0}, "key 'hidden_size' must be a positive integer, found 32.0"),
    "layers_negative": ({"num_hidden_layers": -2}, "key 'num_hidden_layers' must be a positive integer"),
}


RL_BAD = {
    "tp_zero": (["parallel.tp=0"], "parallel.tp must be a positive integer, got 0"),
    "tp_negative": (["parallel.tp=-1"], "parallel.tp must be a positive integer, got -1"),
    "tp_too_big": (["parallel.tp=4", "parallel.dp=1"], "parallel.tp=4 is larger than the world size 2"),
    "steps_zero": (["train.steps=0"], "train.steps must be a positive integer, got 0"),
    "steps_negative": (["train.steps=-1"], "train.steps must be a positive integer, got -1"),
    "save_every_negative": (["train.save_every=-1"], "train.save_every must be >= 0"),
    "device_gpu": (["train.device=gpu"], "train.device must be auto, cpu or cuda, got 'gpu'"),
    "out_dir_read_only": (["train.out_dir=/sys/kltron-run"], "train.out_dir=/sys/kltron-run: directory /sys is not"),
    "timeout_negative": (["parallel.timeout_s=-5"], "parallel.timeout_s must be a positive number of seconds"),
}


@pytest.mark.parametrize("case", list(RL_BAD))
def test_rl_train_config_values_are_named_before_any_work(case, tmp_path):
    """rl.train's checks (pure: the same on every rank, before any collective, file or warm start)."""
    from core.config import ConfigError, load_config
    from rl.config import RLConfig
    from rl.preflight import check_rl_config

    overrides, message = RL_BAD[case]
    cfg = load_config(RLConfig, os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_tiny.yaml"),
                      [f"train.out_dir={tmp_path / 'run'}", f"init.sft_dir={tmp_path / 'sft'}"] + overrides)
    with pytest.raises(ConfigError) as e:
        check_rl_config(cfg, 2)
    assert message in str(e.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("case", list(BAD_HF))
def test_convert_hf_config_values_are_named(case):
    from tools.convert_hf import ConvertError, model_config_from_hf

    edit, message = BAD_HF[case]
    with pytest.raises(ConvertError) as e:
        model_config_from_hf({**LLAMA, **edit}, "hf/config.json")
    assert "hf/config.json" in str(e.value) and message in str(e.value)


def test_convert_hf_good_config_still_reads():
    from tools.convert_hf import model_config_from_hf

    cfg, arch = model_config_from_hf(dict(LLAMA), "config.json")
    assert (cfg.n_heads, cfg.vocab_size, cfg.head_dim, arch) == (4, 131, 8, "LlamaForCausalLM")


def test_kl_eval_out_into_a_missing_directory_fails_first(tmp_path):
    """The policy does not exist either: the --out check comes before any load."""
    from tools.kl_eval import evaluate

    with pytest.raises(ValueError, match=r"--out=.*R.json: directory .*missing does not exist"):
        evaluate(str(tmp_path / "nope"), str(tmp_path / "nope"), str(tmp_path / "t.jsonl"), 1,
                 str(tmp_path / "missing" / "R.json"), "cpu")


# ---------------------------------------------------------------------------------------------
# rewards


def plugin_raises(meta, response):
    raise KeyError("answer")


def plugin_none(meta, response):
    return None


def plugin_list(meta, response):
    return [1.0]


BAD_REWARDS = {
    "raises": (plugin_raises, "reward for prompt 1, sample 0: the reward function raised KeyError"),
    "none": (plugin_none, "reward for prompt 0, sample 0 is not a number: None"),
    "list": (plugin_list, "reward for prompt 0, sample 0 is not a number: [1.0]"),
    "huge": (lambda m, r: 1e38, "reward for prompt 0, sample 0 is 1e+38, above reward.max_abs=1e+06"),
}


@pytest.mark.parametrize("case", list(BAD_REWARDS))
def test_bad_reward_is_named_by_prompt_and_sample(case):
    from rl.experience.rewards import BoundedReward, score_responses

    fn, message = BAD_REWARDS[case]
    fn = BoundedReward(fn if case != "raises" else (lambda m, r: plugin_raises(m, r) if m["i"] else 0.0), 1e6)
    with pytest.raises(ValueError) as e:
        score_responses(fn, [{"i": 0}, {"i": 1}], ["a", "b", "c", "d"], group_size=2)
    assert message in str(e.value)


@pytest.mark.parametrize("spec", ["tests.test_reliability:plugin_none", "tests.test_reliability:plugin_raises"])
def test_bad_plugin_through_the_config_is_named(spec):
    from rl.experience.rewards import RewardConfig, build_reward, score_responses

    _, fn, _ = build_reward(RewardConfig(task="arithmetic", fns=[spec]))
    with pytest.raises(ValueError, match=r"prompt 0, sample 0: .*plug-in (tests.test_reliability:)?plugin_(none|ra)"):
        score_responses(fn, [{"prompt": "1+1=", "answer": "2"}], ["2"], group_size=1)


def test_reward_max_abs_is_configurable():
    from rl.experience.rewards import RewardConfig, build_reward, score_responses

    with pytest.raises(ValueError, match="reward.max_abs"):
        RewardConfig(max_abs=float("inf"))
    _, fn, _ = build_reward(RewardConfig(task="arithmetic", max_abs=10.0))
    assert score_responses(fn, [{"prompt": "1+1=", "answer": "2"}], ["2", "3"], 2).tolist() == [1.0, 0.0]


def _one_rank_fails(bad_rank):
    import torch.distributed as dist

    from rl.experience.rollout import raise_everywhere

    err = "reward for prompt 3, sample 1 is not a number: None" if dist.get_rank() == bad_rank else None
    try:
        raise_everywhere(err, dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


def test_every_rank_names_the_culprit(dist_pools):
    msgs = dist_pools.run(2, _one_rank_fails, 1, timeout=60)
    assert all("reward for prompt 3, sample 1 is not a number" in m for m in msgs), msgs
    assert "rank 1:" in msgs[0]


# ---------------------------------------------------------------------------------------------
# metrics on resume, diagnose


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint(tmp_path):
    from core.runtime.run import truncate_metrics

    p = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "x": s * 1.5}) for s in range(6)]
    p.write_text("\n".join(lines) + "\n" + '{"step": 6, "x"')  # a torn last line (killed mid-write)
    assert truncate_metrics(str(p), 3) == 3
    assert p.read_text() == "\n".join(lines[:4]) + "\n"


def test_diagnose_keeps_the_last_record_of_a_step(tmp_path, capsys):
    from tools.diagnose import load_rows, main

    steps = [0, 1, 2, 3, 2, 3, 4]  # an old resumed run: steps 2 and 3 logged twice
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward_mean": i / 10, "kl_mean": 0.01}) + "\n" for i, s in enumerate(steps)))
    rows = load_rows(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["reward_mean"] for r in rows] == [0.0, 0.1, 0.4, 0.5, 0.6]
    assert main([str(tmp_path)]) == 0
    assert "5 steps read" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# divergence guards


def _rec(**kw):
    base = {"step": 1, "entropy": 1.2, "entropy_max": math.log(256), "kl_mean": 0.1, "grad_norm": 0.5,
            "pg_loss": 0.0, "reward_mean": 0.3, "reward_std": 0.2, "skipped": 0}
    return {**base, **kw}


def test_collapse_to_uniform_stops_and_blames_the_learning_rate():
    from rl.health.guards import collapse_findings

    assert collapse_findings(_rec(), 1e-4) == (False, [])
    near_uniform = _rec(entropy=math.log(256) - 1e-3, grad_norm=0.0)
    assert not collapse_findings(near_uniform, 1e3)[0]  # a barely trained start: near ln V from step 0 on
    assert not collapse_findings(near_uniform, 1e3, baseline=5.2)[0]
    stop, msgs = collapse_findings(near_uniform, 1e3, baseline=1.2)
    assert stop and "learning rate too high? (optim.lr=1000)" in msgs[0] and "ln V = 5.545" in msgs[0]
    assert any("grad_norm is exactly 0" in m for m in msgs)
    stop, msgs = collapse_findings(_rec(kl_mean=float("nan"), entropy=float("nan")), 1e30)
    assert stop and "learning rate too high? (optim.lr=1e+30)" in msgs[0]
    stop, msgs = collapse_findings(_rec(reward_mean=0.0, reward_std=0.0, entropy=1e-6), 1e-4)
    assert not stop and any("exactly 0" in m for m in msgs) and any("near zero" in m for m in msgs)


def test_diagnose_names_a_collapse(tmp_path, capsys):
    from tools.diagnose import main

    rows = [_rec(step=0, lr=1e3)] + [_rec(step=s, lr=1e3, entropy=math.log(256), grad_norm=0.0) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[collapse]" in out and "learning rate too high (lr=1000.0)" in out


# ---------------------------------------------------------------------------------------------
# stop request, watchdog, same config and code


def test_a_real_signal_sets_the_stop_request():
    import torch

    from core.runtime.lifecycle import StopRequest

    req = StopRequest().install()
    try:
        assert not req.agree(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert req.signum == signal.SIGUSR1 and req.agree(torch.device("cpu"))
    finally:
        req.uninstall()


def _agree(signalled_rank):
    import torch
    import torch.distributed as dist

    from core.runtime.lifecycle import StopRequest

    req = StopRequest()
    if dist.get_rank() == signalled_rank:
        req.signum = signal.SIGTERM
    return req.agree(torch.device("cpu"))


def test_one_signalled_rank_stops_every_rank(dist_pools):
    assert dist_pools.run(2, _agree, 1, timeout=60) == [True, True]
    assert dist_pools.run(2, _agree, -1, timeout=60) == [False, False]


def _stall():
    import torch.distributed as dist

    from core.runtime.lifecycle import Watchdog

    # stall 1 s, frozen for 2.5 s: rank 0's own heartbeat thread must not look frozen when a loaded
    # machine delays it (with 0.5 s it did, once, in the fast tier next to other jobs)
    dog = Watchdog(1.0, dist.get_rank(), 2, dist.distributed_c10d._get_default_store(), log=lambda m: None)
    dog.beat("update", 3)
    dog.start()
    dist.barrier()  # both heartbeats are in the store
    if dist.get_rank() == 1:
        dog.stop(finished=False)  # rank 1 freezes: no thread of it runs any more (and it says nothing)
    time.sleep(2.5)
    dog.beat("rollout", 4)  # rank 0 advances (rank 1's phase write is as it would be before SIGSTOP)
    dist.barrier()  # both phase writes are in the store before rank 0 reads (rank 1 can lag on a loaded machine)
    found = dog.check() if dist.get_rank() == 0 else None
    dog.stop()
    dist.barrier()  # rank 0 has read the store before rank 1 leaves
    return found


@pytest.mark.slow
def test_watchdog_names_the_stalled_rank_and_phase(dist_pools):
    found = dist_pools.run(2, _stall, timeout=60)[0]
    assert len(found) == 1 and found[0].startswith("rank 1 has not advanced in"), found
    assert "frozen (phase 'rollout', step 4)" in found[0]


class _Store:
    """The torchrun store's set / get / check / add, in a dict."""

    def __init__(self):
        self.d, self.waited = {}, []

    def set(self, key, value):
        self.d[key] = value.encode()

    def get(self, key):
        # the real store's get of a missing key waits for it (up to the store's timeout), holding the client
        # that the loop's own beats need: the watchdog must never ask for a key that is not there yet
        if key not in self.d:
            self.waited.append(key)
            raise KeyError(key)
        return self.d[key]

    def check(self, keys):
        return all(k in self.d for k in keys)

    def add(self, key, n):
        self.d[key] = str(int(self.d.get(key, b"0")) + n).encode()
        return int(self.d[key])


def _dog(store, now, ended, world=3):
    from core.runtime.lifecycle import Watchdog

    dog = Watchdog(3.0, 0, world, store, log=lambda m: None, roles={1: "rollout rank 0"}, program="kltron.rl.train",
                   clock=lambda: now[0], end=ended.append)
    dog.on_frozen = lambda err: dog.explain(err, 600)
    return dog


def _peers(store, world=3):
    """The other ranks' watchdogs on the same store (their keys; their threads are played by the test)."""
    from core.runtime.lifecycle import Watchdog

    return {r: Watchdog(3.0, r, world, store, log=lambda m: None) for r in range(1, world)}


def _beat(peer, value):
    peer.store.set(peer.key("alive", peer.rank), json.dumps(value))


def test_watchdog_ends_the_run_on_a_frozen_peer_and_never_on_a_slow_one():
    # rank 1 frozen after its second beat (its alive-beat never changes again), rank 2 slow but running (beats
    # every 8 s, less often than the watchdog looks): the end comes once rank 1's beat is older than abort_s on
    # two checks in a row
    store, now, ended = _Store(), [100.0], []
    dog = _dog(store, now, ended)
    peer = _peers(store)
    assert dog.abort_s == 10.0  # max(2 * watchdog_s, ABORT_FLOOR_S)
    for r in (1, 2):
        _beat(peer[r], time.time())
    peer[1].beat("generate", 4)
    dog.tick()
    now[0] += dog.interval_s
    _beat(peer[1], time.time() + 1)
    dog.tick()
    t0, fired = now[0], None  # rank 1's last beat was seen here
    while now[0] < t0 + 60 and fired is None:
        now[0] += dog.interval_s
        if int(now[0] - t0) % 8 == 0:
            _beat(peer[2], now[0])
        dog.tick()
        fired = (now[0] - t0) if ended else None
    assert fired is not None and dog.abort_s < fired <= dog.abort_s + 3 * dog.interval_s, fired
    assert len(ended) == 1
    line = ended[0]
    assert line.startswith("kltron.rl.train: error (rank 0): a collective failed on rank 0 (parallel.timeout_s=600): "
                           "the watchdog ended the run: rank 1 (rollout rank 0) frozen"), line
    assert "rank 1 (rollout rank 0) has not advanced in 1" in line and "frozen (phase 'generate', step 4)" in line
    assert "rank 2" not in line
    assert store.waited == []  # phases of ranks 0 and 2 never published: not waited for


def test_watchdog_ends_the_run_on_a_peer_frozen_before_its_beat_changed():
    # a fast run: the peer froze right after its watchdog's first alive-beat, before this rank's thread ever saw
    # the value change; the value is this launch's (the keys are this watchdog's), so it is a verdict all the same
    store, now, ended = _Store(), [0.0], []
    dog = _dog(store, now, ended, world=2)
    peer = _peers(store, world=2)[1]
    _beat(peer, 5.0)
    while now[0] < 60 and not ended:
        dog.tick()
        now[0] += dog.interval_s
    assert len(ended) == 1 and now[0] <= dog.abort_s + 3 * dog.interval_s, now[0]
    assert "rank 1 (rollout rank 0) frozen" in ended[0] and "has not advanced in 1" in ended[0], ended


def test_watchdog_ends_the_run_when_every_check_comes_late_and_never_on_a_peer_as_slow_as_itself():
    # a loaded machine: this rank's thread checks every 3 s instead of every 0.75 s (every check late); rank 2's
    # thread is as starved (it beats every 3 s) and then twice as starved (every 6 s): never frozen. Rank 1
    # freezes: each late gap counts as at most max_gap_s, so the end comes after abort_s / max_gap_s checks
    store, now, ended = _Store(), [0.0], []
    dog = _dog(store, now, ended)
    peer = _peers(store)
    every = 3.0
    assert every > dog.max_gap_s
    for i in range(100):
        for r, period in ((1, 3), (2, 3 if i < 50 else 6)):
            if int(now[0]) % period == 0:
                _beat(peer[r], now[0])
        dog.tick()
        now[0] += every
    assert ended == []
    t0 = now[0]  # rank 1 freezes here (its last beat was at the check before)
    while now[0] < t0 + 60 and not ended:
        if int(now[0]) % 6 == 0:
            _beat(peer[2], now[0])
        dog.tick()
        now[0] += every
    took = now[0] - t0
    assert len(ended) == 1 and took <= (dog.abort_s // dog.max_gap_s + 3) * every, took
    assert "rank 1 (rollout rank 0) frozen" in ended[0] and "rank 2" not in ended[0], ended


def test_watchdog_does_not_end_the_run_on_a_peer_that_beats_finishes_or_when_itself_starved():
    store, now, ended = _Store(), [0.0], []
    _dog(store, now, [], world=2)  # both ranks' watchdogs of an earlier use of the store (a reused group): rank 1's
    earlier = _peers(store, world=2)[1]
    _beat(earlier, 1.0)  # left its alive-beat there, never to change
    dog = _dog(store, now, ended, world=2)
    peer = _peers(store, world=2)[1]  # rank 1's watchdog of this run
    assert peer.key("alive", 1) != earlier.key("alive", 1) and peer.key("alive", 1) == dog.key("alive", 1)
    for _ in range(100):
        now[0] += dog.interval_s
        dog.tick()
    assert ended == []
    for i in range(200):  # 150 s: rank 1 beating every 9 s (slow, never 10 s unchanged)
        now[0] += dog.interval_s
        if i % 12 == 0:
            _beat(peer, now[0])
        dog.tick()
    _beat(peer, None)  # rank 1 finished its run (Watchdog.stop)
    for _ in range(100):
        now[0] += dog.interval_s
        dog.tick()
    assert ended == []
    _beat(peer, 2.0)  # rank 1 runs again, beats, and freezes
    dog.tick()
    now[0] += dog.interval_s
    _beat(peer, 3.0)
    dog.tick()
    now[0] += 60  # this rank's own thread starved 60 s: that gap counts as max_gap_s only
    dog.tick()
    checks = 0
    while not ended and checks < 100:
        now[0] += dog.interval_s
        dog.tick()
        checks += 1
    # on time again: abort_s counted (the late gap as max_gap_s), then the second check past it
    assert len(ended) == 1 and "rank 1 (rollout rank 0) has not advanced in 6" in ended[0], ended
    assert checks == int((dog.abort_s - dog.max_gap_s) // dog.interval_s) + 2, checks
    dog.on_frozen = None  # no loop to say what it was doing: the watchdog only names the frozen rank
    now[0] += dog.interval_s
    dog.tick()
    assert len(ended) == 1
    assert store.waited == []


def _compare(cfg_by_rank, fake_code):
    import torch.distributed as dist

    import core.runtime.lifecycle as lc

    r = dist.get_rank()
    if fake_code and r == 1:
        lc.source_hash, real = (lambda: "0" * 64), lc.source_hash
    try:
        lc.check_same_everywhere(cfg_by_rank[r])
    except lc.RankMismatchError as e:
        return str(e)
    finally:
        if fake_code and r == 1:
            lc.source_hash = real
    return "same"


def test_ranks_with_different_configs_or_code_are_refused_by_key(dist_pools):
    same = {"optim": {"lr": 1e-3}, "train": {"steps": 4}}
    assert dist_pools.run(2, _compare, [same, same], False, timeout=60) == ["same", "same"]
    other = {"optim": {"lr": 2e-3}, "train": {"steps": 4}}
    msgs = dist_pools.run(2, _compare, [same, other], False, timeout=60)
    assert msgs[0] == msgs[1] and "optim.lr: rank 0=0.001, rank 1=0.002" in msgs[0] and "train.steps" not in msgs[0]
    msgs = dist_pools.run(2, _compare, [same, same], True, timeout=60)
    assert msgs[0] == msgs[1] and "rank(s) [1] run a different kltron source than rank 0" in msgs[0]


SFT_FAST = ["model.hidden_size=32", "model.intermediate_size=64", "data.seq_len=32", "data.micro_batch_size=8",
            "optim.warmup_steps=2", "train.progress=false"]


@pytest.mark.slow
def test_sft_stops_on_a_signal_with_a_checkpoint_and_resumes_bit_for_bit(tmp_path):
    """A real SIGTERM during step 2 of 4: the step ends, its checkpoint is written, Preempted is
    raised; the resumed run's losses equal an uninterrupted run's."""
    from core.config import SFTConfig, load_config
    from core.runtime.lifecycle import Preempted, StopRequest
    from core.sft import train

    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "sft_tiny.yaml")
    straight = train(load_config(SFTConfig, tiny, SFT_FAST + ["train.steps=4", f"train.out_dir={tmp_path / 'a'}"]))
    cfg = load_config(SFTConfig, tiny, SFT_FAST + ["train.steps=4", f"train.out_dir={tmp_path / 'b'}"])
    req = StopRequest().install()
    calls = []

    def agree(device, group=None, _orig=req.agree):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives at the end of step 2
        return _orig(device, group)

    req.agree = agree
    try:
        with pytest.raises(Preempted, match="saved the checkpoint of step 2"):
            train(cfg, req)
    finally:
        req.uninstall()
    assert sorted(os.listdir(tmp_path / "b" / "checkpoints"))[-1] == "step-00000002"
    resumed = train(cfg)
    with open(tmp_path / "b" / "metrics.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f]
    assert losses == straight["losses"] and resumed["losses"] == straight["losses"][2:]
