"""The run set-up (core/runtime/run.py) and seeding (parallel.dims.derive_seed), single process.

derive_seed is checked against the expressions each call site wrote out before it existed
(seed * 1_000_003 + key, and model init's `% 2**63`), so a default job's seeds are unchanged."""

import json
import os
import random
import zlib

import pytest
import torch
import yaml

from core.config import ModelConfig, SFTConfig, load_config, to_dict
from core.runtime.run import start_run
from core.sft_data import SequenceLoader
from parallel.dims import ParallelDims, derive_seed, resolve_device
from rl.experience.rollout import step_prompts
from rl.experience.tasks import make_task

SEEDS = [0, 1, 7, 1234, 2**31 - 1, 10**12]


@pytest.mark.parametrize("seed", SEEDS)
def test_derive_seed_is_the_old_expressions(seed):
    for key in (0, 1, 2, 131, 7919, 10**6):
        assert derive_seed(seed, key) == seed * 1_000_003 + key  # data order, rollout prompts
    for name in ("embed.weight", "layers.0.attn.wq.weight", "lm_head.weight"):
        crc = zlib.crc32(name.encode())
        assert derive_seed(seed, crc) == (seed * 1_000_003 + crc) % (2**63)  # model init
    assert derive_seed(seed, 3, 5) == ((seed * 1_000_003 + 3) * 1_000_003 + 5) % 2**63
    assert derive_seed(seed) == seed


def test_derive_seed_range_and_errors():
    for keys in [(-5, 3), (2**62, 2**62, 9), (-(2**70),)]:
        s = derive_seed(*keys)
        assert 0 <= s < 2**63
        torch.Generator().manual_seed(s)  # accepted
    assert derive_seed(-5, 3) == (-5 * 1_000_003 + 3) % 2**63
    with pytest.raises(ValueError, match="at least one key"):
        derive_seed()
    with pytest.raises(TypeError, match="key 1 must be an int, got float"):
        derive_seed(1, 2.0)


def test_data_order_and_rollout_prompts_use_the_same_seeds_as_before():
    tokens = torch.arange(1000, dtype=torch.long) % 50
    loader = SequenceLoader(tokens, 8, 4, seed=1234)
    g = torch.Generator().manual_seed(1234 * 1_000_003 + 0)
    assert torch.equal(loader._order, torch.randperm(loader.n_seq, generator=g))
    task = make_task("arithmetic", max_operand=9, ops="+")
    _, got = step_prompts(task, 8, 1234, 5, 0, 1)
    assert got == task.sample_prompts(8, random.Random(1234 * 1_000_003 + 5))


def test_resolve_device(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda") == torch.device("cuda", 3)
    want = torch.device("cuda", 3) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == want


def test_start_run_single_process(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(SFTConfig, None, [f"train.out_dir={out}", "train.device=cpu", "train.seed=5"])
    os.makedirs(out)
    (out / "metrics.jsonl").write_text('{"stale": 1}\n')
    mc = ModelConfig(vocab_size=64, hidden_size=16, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=32)
    run = start_run(cfg, ParallelDims(1, 1), mc)
    assert (run.state.mesh, run.state.tp_group, run.kv_group) == (None, None, None)
    assert run.resume({}) is None and run.resumed_step is None  # no checkpoint under out_dir yet
    assert run.device == torch.device("cpu") and run.ckpt_root == str(out / "checkpoints")
    assert torch.initial_seed() == 5
    assert run.writer is None and not (out / "config.yaml").exists()  # nothing written before open_outputs
    writer = run.open_outputs(cfg)
    assert yaml.safe_load((out / "config.yaml").read_text()) == json.loads(json.dumps(to_dict(cfg)))
    writer.write({"step": 1})
    run.close()
    # a fresh start (nothing to resume) truncates the old metrics
    assert [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] == [{"step": 1}]
