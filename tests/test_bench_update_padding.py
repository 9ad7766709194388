"""bench/bench_update_padding.py on a micro batch: the token counts of each mode follow from the
batch's lengths counted by hand (and the budgets), and every mode ends the warm-up update at padding's
parameters."""

import json

import pytest
import torch

from bench import bench_update_padding as bench

pytestmark = pytest.mark.slow  # runs three updates per mode


def test_micro_run(tmp_path):
    out = tmp_path / "pad.json"
    threads = torch.get_num_threads()
    try:
        bench.main(["--rows", "16", "--prompt", "10", "--short", "2", "--long", "8", "--long-share", "0.25",
                    "--micro-rows", "8", "--tokens", "80", "--pack-tokens", "40", "--shared-tokens", "40",
                    "--hidden", "32", "--layers", "1", "--heads", "2",
                    "--vocab", "300",  # more than the tokenizer's 256 ids: the batch must draw below those
                    "--repeats", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    rows = {r["mode"]: r for r in json.load(open(out))["rows"]}
    pad, budget, packed, shared = rows["padding"], rows["token budget"], rows["packed"], rows["shared, token budget"]
    assert pad["model_tokens"] == 16 * (10 + 8)  # every row padded to the longest prompt + response
    assert packed["model_tokens"] == packed["real_tokens"]  # nothing but real tokens
    assert packed["real_tokens"] <= budget["model_tokens"] < pad["model_tokens"]
    assert budget["micro_batches"] >= -(-budget["model_tokens"] // 80)  # none over the budget
    assert budget["max_micro_tokens"] <= 80 and packed["max_micro_tokens"] <= 40
    # shared: 2 groups of 8 rows, each its prompt once: fewer tokens than the real ones, each micro-batch
    # R x W <= 40 (no prompt + one response is over 40 here)
    assert shared["max_micro_tokens"] <= 40 and shared["model_tokens"] < packed["real_tokens"]
    for r in (budget, packed, shared):
        assert r["max_param_diff_vs_padding"] < 1e-5  # the same update up to float rounding
