"""SFT: the data loader (windows of the raw stream, seeded order, DP sharding, exact resume), bitwise
determinism of the loop, metrics and progress output, and a real `torchrun -m core.sft` run with
dp=2 (FSDP2) and gradient accumulation that matches the single-process run of the same global batch
and lowers the loss."""

from __future__ import annotations

import os

import pytest
import torch

from core.config import SFTConfig, load_config
from core.runtime.metrics import read_metrics
from core.sft_data import DataError, SequenceLoader, tokenize_text_file
from core.tokenizer import load_tokenizer
from tests.dist import REPO, run_torchrun

TINY = os.path.join(REPO, "configs", "sft_tiny.yaml")
# a smaller, faster variant of the shipped tiny config for tests
FAST = ["model.hidden_size=32", "model.intermediate_size=64", "data.seq_len=32", "optim.warmup_steps=3",
        "optim.lr=5e-3", "train.progress=false"]


@pytest.fixture(scope="module")
def tokens():
    return tokenize_text_file(None, load_tokenizer(None))


def test_windows_are_slices_of_the_stream(tokens):
    S = 16
    loader = SequenceLoader(tokens, seq_len=S, micro_batch_size=4, seed=0)
    assert loader.n_seq == (tokens.numel() - 1) // S
    b = next(loader)
    assert b.input_ids.shape == b.targets.shape == (4, S)
    for row, tgt in zip(b.input_ids, b.targets):
        starts = [i for i in range(loader.n_seq) if torch.equal(tokens[i * S:i * S + S], row)]
        assert starts, "every input row is a window of the stream at a multiple of seq_len"
        i = starts[0]
        assert torch.equal(tgt, tokens[i * S + 1:i * S + S + 1]), "targets are the inputs shifted by one"


def _starts(loader, batch) -> list[int]:
    S = loader.seq_len
    index = {tuple(loader.tokens[i * S:i * S + S].tolist()): i for i in range(loader.n_seq)}
    return [index[tuple(r.tolist())] for r in batch.input_ids]


def test_epoch_order_by_seed_and_dp_sharding(tokens):
    S, mb = 32, 4
    one = SequenceLoader(tokens, S, 2 * mb, seed=1)
    halves = [SequenceLoader(tokens, S, mb, seed=1, dp_rank=r, dp=2) for r in range(2)]
    per_epoch = one.n_seq // (2 * mb)
    seen = []
    for _ in range(per_epoch):
        full = next(one)
        parts = [next(h) for h in halves]
        # the two DP ranks split the dp=1 global batch in rank order
        assert torch.equal(torch.cat([p.input_ids for p in parts]), full.input_ids)
        seen += _starts(one, full)
    assert len(set(seen)) == len(seen) == per_epoch * 2 * mb, "an epoch visits each sequence at most once"
    other = SequenceLoader(tokens, S, 2 * mb, seed=2)
    assert _starts(other, next(other)) != _starts(one, SequenceLoader(tokens, S, 2 * mb, seed=1).__next__())
    # the next epoch reshuffles
    assert one.epoch == 0
    next(one)
    assert one.epoch == 1


def test_loader_resume_is_exact(tokens):
    a = SequenceLoader(tokens, 32, 4, seed=3, dp_rank=1, dp=2)
    for _ in range(a.n_seq // 8 + 2):  # cross an epoch boundary
        next(a)
    sd = a.state_dict()
    b = SequenceLoader(tokens, 32, 4, seed=3, dp_rank=1, dp=2)
    b.load_state_dict(sd)
    for _ in range(5):
        assert torch.equal(next(a).input_ids, next(b).input_ids)
    with pytest.raises(DataError, match="another token stream or seq_len"):
        SequenceLoader(tokens, 16, 4, seed=3).load_state_dict(sd)
    with pytest.raises(DataError, match="seed 3"):
        SequenceLoader(tokens, 32, 4, seed=4).load_state_dict(sd)


def test_too_little_text_is_refused(tokens):
    with pytest.raises(DataError, match="fewer than one global batch"):
        SequenceLoader(tokens[:100], 32, 4, seed=0)


def test_same_config_twice_is_bitwise_equal(tmp_path):
    from core.sft import train

    runs = []
    for i in range(2):
        cfg = load_config(SFTConfig, TINY, FAST + ["train.steps=4", f"train.out_dir={tmp_path / str(i)}"])
        runs.append(train(cfg)["losses"])
    assert runs[0] == runs[1]
    recs = read_metrics(str(tmp_path / "0" / "metrics.jsonl"))
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr", "skipped", "tokens", "tokens_per_s", "peak_mem_bytes", "peak_mem_kind"):
        assert key in recs[0], key
    assert recs[0]["peak_mem_kind"] in ("cpu_rss_hwm", "cpu_max_rss") and recs[0]["tokens"] == 8 * 32
    assert [r["loss"] for r in recs] == runs[0]


def test_entry_point_resume_is_bitwise_equal(tmp_path):
    """6 steps straight == 3 steps (the job stops, as at a time limit), a train checkpoint, a
    fresh run of the same command that resumes, 3 more steps."""
    from core.sft import train

    straight = train(load_config(SFTConfig, TINY, FAST + ["train.steps=6", f"train.out_dir={tmp_path / 'a'}"]))
    out = f"train.out_dir={tmp_path / 'b'}"
    first = train(load_config(SFTConfig, TINY, FAST + ["train.steps=6", "train.save_every=3", "train.stop_after=3",
                                                       out]))
    assert first["losses"] == straight["losses"][:3]
    torch.manual_seed(999)  # resume must restore the RNG, not rely on it
    resumed = train(load_config(SFTConfig, TINY, FAST + ["train.steps=6", out]))
    recs = read_metrics(str(tmp_path / "b" / "metrics.jsonl"))
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in recs] == straight["losses"]
    assert resumed["losses"] == straight["losses"][3:]


@pytest.mark.slow
def test_torchrun_dp2_matches_single_process_and_learns(tmp_path):
    from core.sft import train

    steps = 20
    common = FAST + [f"train.steps={steps}"]
    single = train(load_config(SFTConfig, TINY, common + [f"train.out_dir={tmp_path / 'single'}"]))["losses"]
    out = tmp_path / "dp2"
    # 2 DP ranks x grad_accum 2 x 2 sequences: FSDP2 skips the reduce-scatter on the first micro-step
    res = run_torchrun(["core.sft", "--config", TINY, *common, "data.micro_batch_size=2", "data.grad_accum=2",
                        "parallel.tp=1", f"train.out_dir={out}"], nproc=2, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    losses = [r["loss"] for r in recs]
    assert recs[0]["tokens"] == 8 * 32, "global tokens: 2 DP ranks x 2 micro-steps x 2 sequences x 32"
    # that is the single process's batch of 8, split: the same training run
    torch.testing.assert_close(torch.tensor(losses[:5]), torch.tensor(single[:5]), atol=1e-4, rtol=1e-4)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"loss must drop clearly: {first:.3f} -> {last:.3f}"


def test_shipped_configs_load_and_validate():
    from core.sft import check_sft_config

    assert check_sft_config(load_config(SFTConfig, TINY), 1).world_size == 1
    big = load_config(SFTConfig, os.path.join(REPO, "configs", "llama3_8b_multinode.yaml"), ["train.device=auto"])
    dims = check_sft_config(big, 16)  # 2 nodes x 8 GPUs
    assert (dims.dp, dims.tp) == (2, 8)
    assert big.model.padded_vocab_size(8) == 128256 and big.model.head_dim == 128


def test_progress_bar_and_metrics_writer(tmp_path):
    import io
    import json

    from core.runtime.metrics import MetricsWriter, PhaseTimer, ProgressBar, peak_memory

    log = io.StringIO()  # not a terminal: one full line every `every` steps, the first and the last
    bar = ProgressBar(25, every=10, stream=log)
    for step in range(1, 26):
        bar.update(step, loss=1.0 / step)
    lines = log.getvalue().splitlines()
    assert [ln.split("] ")[1].split(" ")[0] for ln in lines] == ["1/25", "10/25", "20/25", "25/25"]
    assert "loss=0.04" in lines[-1]
    path = tmp_path / "m.jsonl"
    with MetricsWriter(str(path)) as w:
        w.write({"step": 1, "loss": float("nan"), "x": torch.tensor(2.5)})
        assert json.loads(path.read_text()) == {"step": 1, "loss": "nan", "x": 2.5}, "flushed per line"
    MetricsWriter(str(tmp_path / "off.jsonl"), enabled=False).write({"step": 1})
    assert not (tmp_path / "off.jsonl").exists(), "only the main rank writes"
    mem = peak_memory(torch.device("cpu"))
    assert mem["peak_mem_kind"] in ("cpu_rss_hwm", "cpu_max_rss") and mem["peak_mem_bytes"] > 10 * 2**20
    timer = PhaseTimer()
    with timer("a"):
        pass
    assert list(timer.pop()) == ["time_a_s"] and timer.pop() == {}
