"""The monitor backends read back: a Weights & Biases offline run (through wandb's own reader of its
transaction log, `wandb leet inspect --json`) and TensorBoard event files (tensorboard's
EventAccumulator) hold every number of metrics.jsonl under the same name, and the KL quantiles and
per-position KL as histograms. wandb and tensorboard are optional extras: each test skips, saying so,
where its extra is absent."""

import json
import math
import os
import subprocess
import sys

import pytest

from core.config import load_config
from rl.config import RLConfig


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb imported, with every folder it writes (config, cache, data) under tmp_path and no network."""
    wb = pytest.importorskip("wandb", reason="the optional extra `wandb` is not installed (pip install wandb)")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return wb


def wandb_history(out_dir: str) -> tuple[list[dict], dict]:
    """(history rows in step order, the run's config) of the single offline run under {out_dir}/wandb,
    decoded by wandb's own CLI from its .wandb transaction log."""
    runs = [d for d in os.listdir(os.path.join(out_dir, "wandb")) if d.startswith("offline-run-")]
    assert len(runs) == 1, runs
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                           os.path.join(out_dir, "wandb", runs[0])], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "No such command" in proc.stderr:
        pytest.skip(f"this wandb has no `wandb leet inspect` to read an offline run back: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    hist = [r["history"]["item"] for r in recs if r.get("type") == "history"]
    config = {}
    for r in recs:
        if r.get("type") == "run":
            config = r["run"].get("config", {})
    return sorted(hist, key=lambda h: h["_step"]), config


def _numbers(rec: dict) -> dict[str, float]:
    """The metrics.jsonl record's finite numbers (bools as 0/1), as a reader of the file sees them."""
    out = {}
    for k, v in rec.items():
        if isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


def _records(n=3):
    return [{"step": i, "kl_mean": 0.05 * (i + 1), "reward_mean": 0.25 + 0.125 * i, "skipped": i == 1,
             "kl_p50": 0.01, "kl_p90": 0.04 * (i + 1), "kl_p99": 0.5, "kl_max": 1.5 + i, "note": "text",
             "kl_by_position": [0.1, 0.0, 0.3 * (i + 1), -0.02], "grad_norm": float("nan")} for i in range(n)]


def test_yaml_off_is_the_string_off():
    """`monitor.wandb: off` in YAML (and on the command line) reads as false under YAML 1.1."""
    assert load_config(RLConfig, None, ["monitor.wandb=off"]).monitor.wandb == "off"
    assert load_config(RLConfig, None, ["monitor.wandb=offline"]).monitor.wandb == "offline"
    with pytest.raises(ValueError, match="monitor.wandb"):
        load_config(RLConfig, None, ["monitor.wandb=true"])


@pytest.mark.slow
def test_wandb_offline_run_reads_back(tmp_path, wandb_offline):
    from core.runtime.monitor import Monitor

    mon = Monitor(str(tmp_path), wandb="offline", config={"kl_ctl": {"beta": 0.02}})
    assert mon.wb is not None
    recs = _records()
    for r in recs:
        mon.log(r, r["step"])
    mon.close()
    hist, config = wandb_history(str(tmp_path))
    assert [h["_step"] for h in hist] == [0, 1, 2]
    for h, r in zip(hist, recs):
        want = {"step": r["step"], "kl_mean": 0.05 * (r["step"] + 1), "reward_mean": 0.25 + 0.125 * r["step"],
                "skipped": float(r["step"] == 1), "kl_p50": 0.01, "kl_p90": 0.04 * (r["step"] + 1),
                "kl_p99": 0.5, "kl_max": 1.5 + r["step"]}
        assert {k: h[k] for k in want} == pytest.approx(want, rel=1e-12)
        assert "grad_norm" not in h and "note" not in h  # NaN and text are not scalars
        # the step's four KL quantiles, binned: four counts between the smallest and the largest
        assert sum(h["kl_quantiles.values"]) == 4
        assert h["kl_quantiles.bins"][0] == pytest.approx(0.01) and h["kl_quantiles.bins"][-1] == pytest.approx(
            1.5 + r["step"])
        # per-position KL: bucket i's weight is its mean KL (clamped at 0), over edges 0..4
        assert h["kl_by_position.values"] == pytest.approx([0.1, 0.0, 0.3 * (r["step"] + 1), 0.0])
        assert h["kl_by_position.bins"] == [0, 1, 2, 3, 4]
    assert "0.02" in json.dumps(config)  # the run's config travels with it


def _tensorboard(out_dir: str):
    pytest.importorskip("tensorboard", reason="the optional extra `tensorboard` is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(os.path.join(out_dir, "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    return ea


@pytest.mark.slow
def test_real_job_metrics_match_in_wandb_and_tensorboard(tmp_path, wandb_offline):
    """A real 3-step GRPO job with both monitors on: every number of every metrics.jsonl record is in
    the W&B run and in the TensorBoard events under its name and at its step, with the histograms."""
    from rl.train import run as rl_run

    sft = os.environ.get("KLTRON_TINY_SFT", "runs/tiny_sft")  # the README job's start checkpoint (built if absent)
    cfg = load_config(RLConfig, "configs/grpo_tiny.yaml",
                      [f"init.sft_dir={sft}", f"train.out_dir={tmp_path}", "train.steps=3", "train.progress=false",
                       "rollout.prompts_per_step=8", "rollout.group_size=4", "train.save_every=0",
                       "monitor.tensorboard=true", "monitor.wandb=offline"])
    rl_run(cfg)
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1, 2]
    hist, config = wandb_history(str(tmp_path))
    assert all(key in json.dumps(config) for key in ("kl_ctl", "grpo", "k3+"))  # the run's config travels with it
    ea = _tensorboard(str(tmp_path))
    tb = {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}
    for r, h in zip(rows, hist):
        nums = _numbers(r)
        assert len(nums) > 40
        assert {k: h.get(k) for k in nums} == pytest.approx(nums, rel=1e-6, abs=1e-12)
        assert {k: tb.get(k, {}).get(r["step"]) for k in nums} == pytest.approx(nums, rel=1e-6, abs=1e-12)
        assert h["kl_by_position.values"] == pytest.approx([max(x, 0.0) for x in r["kl_by_position"]], abs=1e-12)
        assert sum(h["kl_quantiles.values"]) == 4
    assert {"kl_quantiles", "kl_by_position"} <= set(ea.Tags()["histograms"])
    pos = ea.Histograms("kl_by_position")
    assert [p.step for p in pos] == [0, 1, 2]
    assert list(pos[-1].histogram_value.bucket) == pytest.approx([max(x, 0.0) for x in rows[-1]["kl_by_position"]],
                                                                 rel=1e-6, abs=1e-9)
