"""Reliability with real processes and real signals (torchrun, gloo, 2 ranks; a timeout fails a hang):
good runs exit 0 every time, a frozen rank ends the run (its watchdog, before parallel.timeout_s) naming it,
SIGTERM / SIGUSR1 save at an agreed step and the resume is bit for bit, a finished run's folder is
left alone, metrics are not logged twice after a resume, and a collapse names the learning rate."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.dist import REPO, OutputReader, process_ended, run_torchrun

pytestmark = pytest.mark.slow  # torchrun launches and RL runs on a warm-start checkpoint

CONFIG = os.path.join(REPO, "configs", "grpo_tiny.yaml")
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "init.sft_steps=5", "init.sft_examples=200",
         "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4", "train.save_every=0",
         "train.progress=false"]
REPEAT = int(os.environ.get("KLTRON_REPEAT", "3"))  # per layout; docs/reliability.md's row: 30
TIMING = ("tokens_per_s", "step_time_s", "time_", "_time", "mem", "peak")


def _rows(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _no_timing(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not any(t in k for t in TIMING)}


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    from rl.train import main

    base = tmp_path_factory.mktemp("rel")
    sft = str(base / "sft")
    assert main(["--config", CONFIG, *SMALL, f"init.sft_dir={sft}", f"train.out_dir={base / 'first'}",
                 "train.steps=1"]) == 0
    return base, sft


def _args(sft, out, *extra):
    return ["rl.train", "--config", CONFIG, *SMALL, f"init.sft_dir={sft}", f"train.out_dir={out}", *extra]


def _assert_clean(res, what):
    assert res.returncode == 0, f"{what}: rc {res.returncode}\n{res.stderr[-3000:]}"
    for bad in ("terminate called", "SIGABRT", "Signal 6", "Traceback"):
        assert bad not in res.stderr, f"{what}: {bad!r}\n{res.stderr[-3000:]}"


def test_good_runs_exit_zero_every_time(sft, straight, preempted):
    """A good dp=2 or tp=2 run never ends with a rank aborting at shutdown, REPEAT times per layout. The dp=2
    runs are `straight`'s (5 steps) and the preemption tests' two resumes (each runs to step 4 from its
    checkpoint), their exits checked the same way; the tp=2 runs are launched here."""
    base, sft = sft
    assert [r["step"] for r in straight] == [0, 1, 2, 3, 4]
    resumes = []
    for how in HOWS:
        if "error" in preempted[how]:
            raise preempted[how]["error"]
        resumes.append(preempted[how]["resume"])
    for res, resumed in resumes:
        _assert_clean(res, "resume")
        assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    dp2 = 1 + len(resumes)
    for i in range(max(REPEAT - dp2, 0)):
        out = base / f"good_{i}_1"
        res = run_torchrun(_args(sft, out, "parallel.tp=1", "train.steps=2"), nproc=2, timeout=300)
        _assert_clean(res, f"run {i} parallel.tp=1")
        assert [r["step"] for r in _rows(out)] == [0, 1]
    for i in range(REPEAT):
        out = base / f"good_{i}_2"
        res = run_torchrun(_args(sft, out, "parallel.tp=2", "train.steps=2"), nproc=2, timeout=300)
        _assert_clean(res, f"run {i} parallel.tp=2")
        assert [r["step"] for r in _rows(out)] == [0, 1]


def test_kl_eval_error_path_exits_cleanly(sft, tmp_path):
    base, sft = sft
    model = os.path.join(sft, "model")
    for _ in range(REPEAT):
        res = run_torchrun(["tools.kl_eval", "--policy", model, "--ref", model, "--tokens",
                            str(tmp_path / "none.jsonl"), "--tp", "2", "--out", str(tmp_path / "R.json"),
                            "--device", "cpu"],
                           nproc=2, timeout=300)
        assert res.returncode != 0
        assert "terminate called" not in res.stderr and "Signal 6" not in res.stderr, res.stderr[-3000:]
        assert "exitcode  : 2" in res.stderr and "none.jsonl" in res.stderr, res.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# real signals on a torchrun launch


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _rank_pid(launcher: int, rank: int) -> int:
    for pid in _children(launcher):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no rank {rank} under torchrun {launcher}")


def _launch(args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_for_steps(proc, out, n, limit=240.0):
    deadline = time.monotonic() + limit
    path = os.path.join(out, "metrics.jsonl")
    while time.monotonic() < deadline:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"ended before step {n}: {proc.communicate()[0][-3000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no {n} steps logged in {limit} s")


def _finish(proc, limit):
    try:
        return proc.communicate(timeout=limit)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running {limit} s after the fault: {proc.communicate()[0][-3000:]}") from None


def test_frozen_rank_ends_the_run_naming_it(sft):
    # rank 0's watchdog ends the run once rank 1's alive-beat has stayed unchanged for 10 s (abort_after(4)), well
    # before the collective timeout would (the same line, naming rank 1; the freeze comes one step in: rank 1's beat
    # may never have been seen to change). torchrun then gives the SIGSTOPped rank its SIGTERM grace (30 s; its
    # failure path takes no shorter one) before a SIGKILL: once rank 0 has reported and exited on its own, the test
    # sends that SIGKILL itself
    base, sft = sft
    out, timeout_s = str(base / "frozen"), 60
    proc = _launch(_args(sft, out, "train.steps=200", f"parallel.timeout_s={timeout_s}", "parallel.watchdog_s=4"))
    reader = OutputReader(proc)  # drained throughout: no rank blocks on a full pipe
    _wait_for_steps(proc, out, 1)
    survivor, victim = _rank_pid(proc.pid, 0), _rank_pid(proc.pid, 1)
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        seen, rest = reader.wait_for("kltron.rl.train: error (rank 0)", timeout_s + 90), reader.rest
        ended = seen and process_ended(survivor, 30)
        took = time.monotonic() - t0
        os.kill(victim, signal.SIGKILL)
        text = rest(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running after the fault: {proc.communicate()[0][-3000:]}") from None
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError:
            pass
    assert seen and ended, (took, text[-3000:])
    assert proc.returncode != 0
    assert "kltron watchdog (rank 0): rank 1 has not advanced in" in text, text[-3000:]
    line = [ln for ln in text.splitlines() if "kltron.rl.train: error (rank 0): a collective failed" in ln]
    assert line and f"parallel.timeout_s={timeout_s}" in line[0] and "rank 1 has not advanced" in line[0], text[-3000:]
    assert "the watchdog ended the run" in line[0] and took < timeout_s - 15, (took, line[0])


@pytest.fixture(scope="module")
def straight(sft):
    base, sft = sft
    out = base / "straight"
    _assert_clean(run_torchrun(_args(sft, out, "train.steps=5"), nproc=2, timeout=300), "straight")
    return _rows(out)


HOWS = ("sigterm_to_torchrun", "sigusr1_to_rank_1")


@pytest.fixture(scope="module")
def preempted(sft):
    """Per way of stopping: a dp=2 run of 5 steps stopped one step in, then its resume with the same command.
    {how: {"error": the launch's failure, or "text", "returncode", "stopped", "saved", "out", "resume": (the
    resume's result, its rows)}}; read by the preemption tests and, for the resumes, by the good-runs test."""
    base, sft = sft
    got = {}
    for how in HOWS:
        out = str(base / f"pre_{how}")
        rec = got[how] = {"out": out}
        try:
            proc = _launch(_args(sft, out, "train.steps=5"))
            _wait_for_steps(proc, out, 1)
            os.kill(proc.pid if how == "sigterm_to_torchrun" else _rank_pid(proc.pid, 1),
                    signal.SIGTERM if how == "sigterm_to_torchrun" else signal.SIGUSR1)
            rec["text"], rec["returncode"] = _finish(proc, 120), proc.returncode
            rec["stopped"] = _rows(out)
            rec["saved"] = sorted(os.listdir(os.path.join(out, "checkpoints")))
            res = run_torchrun(_args(sft, out, "train.steps=5"), nproc=2, timeout=300)
            rec["resume"] = (res, _rows(out) if res.returncode == 0 else None)
        except (AssertionError, OSError, subprocess.SubprocessError) as e:
            rec["error"] = e
    return got


@pytest.mark.parametrize("how", HOWS)
def test_preemption_saves_at_an_agreed_step_and_resumes_bit_for_bit(preempted, straight, how):
    rec = preempted[how]
    if "error" in rec:
        raise rec["error"]
    text, stopped, saved = rec["text"], rec["stopped"], rec["saved"]
    assert "stop requested by signal" in text and "run the same command to resume" in text, text[-3000:]
    if how == "sigusr1_to_rank_1":
        assert rec["returncode"] == 0, text[-3000:]  # every rank exits PREEMPTED_EXIT = 0
    assert saved and saved[-1] == f"step-{stopped[-1]['step']:08d}", (saved, stopped[-1]["step"])
    assert stopped[-1]["step"] < 4  # stopped before the end
    res, resumed = rec["resume"]
    _assert_clean(res, "resume")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert [_no_timing(r) for r in resumed] == [_no_timing(r) for r in straight]


# ---------------------------------------------------------------------------------------------
# in process, one rank


def test_finished_run_folder_is_left_alone(sft, capsys):
    from rl.train import main

    base, sft = sft
    out = base / "first"  # the fixture's finished 1-step run
    before = {f: (out / f).read_bytes() for f in ("config.yaml", "metrics.jsonl")}
    assert main(["--config", CONFIG, *SMALL, f"init.sft_dir={sft}", f"train.out_dir={out}", "train.steps=1",
                 "optim.lr=5e-4"]) == 0
    err = capsys.readouterr().err
    assert f"the run in {out} is complete at step 0" in err and "train.out_dir" in err and "train.steps" in err
    assert {f: (out / f).read_bytes() for f in before} == before


def test_no_step_is_logged_twice_after_a_resume(sft):
    """A crash after step 3 was logged but before its checkpoint: the resume from step 1 rewrites 2, 3."""
    from rl.train import main

    base, sft = sft
    out = str(base / "dup")
    common = ["--config", CONFIG, *SMALL, f"init.sft_dir={sft}", f"train.out_dir={out}", "train.save_every=2",
              "train.keep_last=5"]
    assert main([*common, "train.steps=4"]) == 0
    shutil.rmtree(os.path.join(out, "checkpoints", "step-00000003"))  # the crash lost the last checkpoint
    assert main([*common, "train.steps=5"]) == 0
    assert [r["step"] for r in _rows(out)] == [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def trained_sft(tmp_path_factory):
    """A start checkpoint trained well below the uniform entropy (the 5-step one is near ln V)."""
    from rl.train import main

    base = tmp_path_factory.mktemp("trained")
    sft = str(base / "sft")
    assert main(["--config", CONFIG, *SMALL, "init.sft_steps=120", "init.sft_lr=4e-3", f"init.sft_dir={sft}",
                 f"train.out_dir={base / 'first'}", "train.steps=1"]) == 0
    return base, sft


@pytest.mark.parametrize("lr", ["1e3", "1e30"])
def test_divergence_names_the_learning_rate(trained_sft, lr, capsys):
    """An absurd learning rate is caught and named. The batch carries a learning signal (partial credit):
    with every reward 0 the update's gradient is exactly 0 under the shared-prompt forward (the GRPO
    default), so nothing moves; before it, the padded path's rounding-level KL gradient was what AdamW
    amplified into lr-sized steps. lr=1e30: the weights overflow and the run stops naming optim.lr;
    lr=1e3: the policy collapses (to uniform: a stop naming optim.lr; to deterministic: the entropy guard's
    warning names the learning rate) or lands far from the reference (the KL guard's warning names it)."""
    from rl.train import main

    base, sft = trained_sft
    stopped = None
    try:
        main(["--config", CONFIG, *SMALL, "rollout.prompts_per_step=8", f"init.sft_dir={sft}",
              f"train.out_dir={base / ('lr' + lr)}", "train.steps=4", f"optim.lr={lr}",
              "reward.task_args={max_operand: 9, ops: '+', partial_credit: 0.5}"])
    except SystemExit as e:
        stopped = str(e)
    out = capsys.readouterr()
    if lr == "1e30" or stopped is not None:
        assert stopped is not None and "learning rate too high?" in stopped and "kl_stop" not in stopped, stopped
    else:
        assert "learning rate too high" in out.err + out.out, out.err[-2000:]


