"""The `rl.train` entry point end to end: warm start, resume equal to an uninterrupted run, a
reference with another tokenizer refused before training, and a two-node torchrun launch."""

import json
import os
import subprocess
import sys

import pytest

from tests.dist import REPO, free_port

pytestmark = pytest.mark.slow  # every test here runs the RL entry point on a warm-start checkpoint it first trains

CONFIG = os.path.join(REPO, "configs", "grpo_tiny.yaml")
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "init.sft_steps=5", "init.sft_examples=200",
         "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4", "train.steps=4",
         "train.save_every=0", "train.progress=false"]
KEYS = ("reward_mean", "kl_mean", "kl_p99", "beta", "pg_loss", "grad_norm", "entropy", "clipfrac")


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    """A starting checkpoint built once by the warm start (and reused by every test here)."""
    from rl.train import main

    base = tmp_path_factory.mktemp("rl")
    sft = str(base / "sft")
    assert main(["--config", CONFIG, *SMALL, f"init.sft_dir={sft}", f"train.out_dir={base / 'straight'}"]) == 0
    assert os.path.isfile(os.path.join(sft, "model", "manifest.json"))
    return base, sft


def test_resume_equals_uninterrupted(sft_dir):
    from rl.train import main

    base, sft = sft_dir
    straight = _rows(str(base / "straight"))
    assert [r["step"] for r in straight] == [0, 1, 2, 3]
    out = str(base / "resumed")
    common = ["--config", CONFIG, *SMALL, f"init.sft_dir={sft}", f"train.out_dir={out}"]
    assert main([*common, "train.stop_after=2"]) == 0  # the job ends (a time limit), checkpoint at step 1
    assert len(_rows(out)) == 2
    assert main(common) == 0  # the same command again resumes at step 2
    resumed = _rows(out)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(straight, resumed):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}


def test_reference_with_other_tokenizer_is_refused(sft_dir, capsys):
    from core.ckpt import read_manifest, save_model_weights
    from core.config import ModelConfig, from_dict
    from core.model import build_model
    from rl.train import main

    base, sft = sft_dir
    cfg = from_dict(ModelConfig, read_manifest(os.path.join(sft, "model"))["model_config"])
    other = str(base / "other_tok")
    save_model_weights(build_model(cfg, seed=1), other, None, tokenizer_fingerprint="0" * 64)
    out = base / "refused"
    rc = main(["--config", CONFIG, *SMALL, f"init.sft_dir={sft}", f"train.out_dir={out}",
               f"reference.checkpoint={other}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "tokenizer" in err and "reference" in err, err
    assert not os.path.exists(out / "metrics.jsonl")  # refused before the first step


@pytest.mark.slow
def test_two_nodes_on_loopback(sft_dir):
    """Two torchrun launchers (--nnodes 2, one process each) run two steps together."""
    base, sft = sft_dir
    out = str(base / "two_nodes")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
               "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
               "-m", "rl.train", "--config", CONFIG, *SMALL, "train.steps=2", f"init.sft_dir={sft}",
               f"train.out_dir={out}", "parallel.tp=2"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1]
    assert os.path.isdir(os.path.join(out, "checkpoints", "step-00000001"))


def test_kl_stop_guard_saves_and_stops(sft_dir):
    """Mean KL per token above guard.kl_stop_per_token: the step's checkpoint is written, then the run stops with a
    message pointing at tools.diagnose (step 0 has KL exactly 0: policy == reference)."""
    from rl.train import main

    base, sft = sft_dir
    out = base / "kl_stop"
    with pytest.raises(SystemExit) as exc:
        main(["--config", CONFIG, *SMALL, f"init.sft_dir={sft}", f"train.out_dir={out}",
              "guard.kl_stop_per_token=1e-9", "guard.kl_warn_per_token=1e-10", "reward.use_task_reward=false",
              "reward.fns=[tests.reward_plugins:digits_over_6]", "train.steps=6"])
    msg = str(exc.value.code)
    assert "nats per token passed guard.kl_stop_per_token" in msg and "tools.diagnose" in msg
    rows = _rows(str(out))
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["kl_stop"] and rows[1]["kl_warning"]
    assert os.path.isdir(out / "checkpoints" / "step-00000001")
