"""`rl.train --dry-run` and the start-up memory check (core.runtime.budget's projection where users meet it)."""

import os

import pytest
import torch

from core.config import ConfigError, ModelConfig, load_config
from core.runtime.budget import projected_peak_bytes
from rl import preflight
from rl import train as rl_train
from rl.config import RLConfig
from tests.dist import REPO

CFG = os.path.join(REPO, "configs", "grpo_tiny.yaml")


def test_dry_run_prints_the_plan_and_builds_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert rl_train.main(["--config", CFG, "--dry-run", f"train.out_dir={out}", "init.sft_dir=" + str(tmp_path / "sft"),
                          "train.device=cpu"]) == 0
    text = capsys.readouterr().out
    assert "rollout:" in text and "# projected peak per rank (1 ranks: tp=1 x dp=1, cpu" in text
    assert not out.exists() and not (tmp_path / "sft").exists()  # nothing written, nothing trained
    cfg = load_config(RLConfig, CFG, ["train.device=cpu"])
    want = projected_peak_bytes(cfg, 1, "cpu")["peak"] / 2**30
    assert f"{want:.3f} GiB" in text


def test_dry_run_plans_a_gpu_layout_from_a_cpu_machine(capsys):
    over = ["train.device=cuda", "parallel.tp=2", "model.hidden_size=4096", "model.n_heads=32", "model.n_kv_heads=8",
            "model.intermediate_size=14336", "model.n_layers=32", "model.vocab_size=128256"]
    assert rl_train.main(["--config", CFG, "--dry-run", "--world-size", "16", *over]) == 0
    text = capsys.readouterr().out
    assert "(16 ranks: tp=2 x dp=8, cuda" in text


def test_start_up_refuses_a_run_that_cannot_fit(monkeypatch):
    cfg = load_config(RLConfig, CFG, [])
    mc = ModelConfig(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                     intermediate_size=14336, max_seq_len=64)

    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "an 80 GB GPU")
    peak = preflight.memory_plan(cfg, mc, 1, torch.device("cuda"))["peak"]
    assert peak > Props.total_memory  # 8B with fp32 AdamW on one GPU
    with pytest.raises(ConfigError, match="train.memory_check=false") as e:
        preflight.check_memory(cfg, mc, 1, torch.device("cuda"))
    assert f"{peak / 2**30:.1f} GiB" in str(e.value) and "an 80 GB GPU" in str(e.value)
    off = load_config(RLConfig, CFG, ["train.memory_check=false"])
    preflight.check_memory(off, mc, 1, torch.device("cuda"))  # overridden: no error
    preflight.check_memory(cfg, mc, 1, torch.device("cpu"))  # CPU runs are not checked


def test_dry_run_of_a_split_launch_plans_each_role(tmp_path, capsys):
    """A one-step-off launch (parallel.rollout_ranks): the trainer ranks are world - rollout_ranks laid out by tp x
    dp and hold no KV cache; the rollout ranks' peak is the policy's fp32 weights at rollout_tp plus the KV cache of
    their share of the step's rows, here computed by hand from the shapes."""
    cfg_path = os.path.join(REPO, "configs", "grpo_tiny_async.yaml")
    over = ["--world-size", "5", "parallel.rollout_ranks=2", "rollout.prompts_per_step=30", "train.device=cpu",
            f"train.out_dir={tmp_path / 'run'}", f"init.sft_dir={tmp_path / 'sft'}"]
    assert rl_train.main(["--config", cfg_path, "--dry-run", *over]) == 0
    text = capsys.readouterr().out
    assert "(3 trainer ranks of 5: tp=1 x dp=3, cpu" in text, text[-2000:]
    cfg = load_config(RLConfig, cfg_path, over[2:])
    plan = preflight.memory_plan(cfg, cfg.model, 3, torch.device("cpu"))
    assert plan["parts"]["rollout KV cache"] == 0 and plan["peak"] == max(plan["experience_peak"], plan["update_peak"])
    ro = plan["rollout_ranks"]
    m = cfg.model
    rows = 30 * cfg.rollout.group_size // 2  # rollout dp = 2 ranks / rollout_tp 1
    kv = 2 * m.n_layers * rows * m.max_seq_len * m.n_kv_heads * (m.hidden_size // m.n_heads) * 4
    from core.model import build_model
    weights = 4 * sum(p.numel() for p in build_model(m, seed=None, device="meta").parameters())
    assert ro["parts"]["policy weights"] >= weights  # fp32, unsharded (padding rows included)
    assert ro["batch"].rollout_rows == rows and ro["parts"]["rollout KV cache"] == kv
    assert f"# projected peak per rollout rank (2 ranks: tp=1 x dp=2, {rows} rows each): " \
           f"{ro['peak'] / 2**30:.3f} GiB" in text
    assert rl_train.main(["--config", cfg_path, "--dry-run", "--world-size", "5", "parallel.rollout_ranks=5"]) != 0
    assert "parallel.rollout_ranks=5 leaves no trainer rank in a world of 5" in capsys.readouterr().err
