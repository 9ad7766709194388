"""Smoke test of `python -m tools.kl_memory`: its CLI, its JSON rows, and communication volumes
that follow from the algorithms (gather moves O(T*V), the vocab-parallel paths O(T))."""

import json
import subprocess
import sys

import pytest

from tests.dist import REPO
from tools import kl_memory

FIELDS = {"method", "pass", "mode", "tokens", "hidden", "vocab", "tp", "dtype", "peak_bytes", "time_s",
          "comm_bytes"}


@pytest.mark.slow
def test_cli_tp2_rows_and_comm(tmp_path):
    T, H, V, tp = 24, 8, 131, 2
    out = tmp_path / "kl.json"
    cmd = [sys.executable, "-m", "tools.kl_memory", "--tokens", str(T), "--hidden", str(H), "--vocab", str(V),
           "--tp", str(tp), "--dtype", "fp32", "--json", str(out), "--chunk-size", "8", "--pass", "both"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * len(kl_memory.METHODS) == 12
    assert {(r["name"], r["pass"]) for r in rows} == {(n, p) for n in kl_memory.METHODS
                                                       for p in ("forward", "forward+backward")}
    for r in rows:
        assert FIELDS <= set(r), r
        assert (r["tokens"], r["hidden"], r["vocab"], r["tp"], r["dtype"]) == (T, H, V, tp, "fp32")
        assert r["peak_bytes"] > 0 and r["time_s"] > 0
    by = {(r["name"], r["pass"]): r for r in rows}
    width = 192 // tp  # ModelConfig(vocab_size=131).padded_vocab_size(2) = 192
    grad_hidden = T * H * 4  # copy_to_tp's backward all-reduce, the same for every method
    # gather: two all-gathers of the local [T, Vp/tp] fp32 logits
    assert by["gather", "forward"]["comm_bytes"] == 2 * T * width * 4
    assert by["gather", "forward+backward"]["comm_bytes"] == 2 * T * width * 4 + grad_hidden
    # fused exact: one MAX of [T, 2] and one gather of [T, 6] (sum-exp p/q, entropy, KL, 2 targets)
    assert by["fused_exact", "forward"]["comm_bytes"] == T * (2 + 6) * 4
    assert by["fused_exact", "forward+backward"]["comm_bytes"] == T * (2 + 6) * 4 + grad_hidden
    # fused exact with the loss inside: the same volume, in T / chunk = 3 calls of each collective
    for p in ("forward", "forward+backward"):
        assert by["fused_exact_loss", p]["comm_bytes"] == by["fused_exact", p]["comm_bytes"]
        assert by["fused_exact_loss", p]["comm_calls"] == by["fused_exact", p]["comm_calls"] + 2 * (3 - 1)
    # fused k3: [T, 2] maxima, [T, 4] sums (sum-exp p/q and the two target logits)
    assert by["fused_k3", "forward"]["comm_bytes"] == T * (2 + 4) * 4
    # the unfused vocab-parallel calls (logprobs, entropy, KL): O(T) each, chunking changes nothing
    assert by["vp_chunked", "forward"]["comm_bytes"] == by["vp_materialized", "forward"]["comm_bytes"]
    assert by["vp_chunked", "forward"]["comm_bytes"] == T * 4 * ((1 + 2) + (1 + 2) + (2 + 3))


def test_in_process_tp1_and_bad_arguments(tmp_path, capsys):
    out = tmp_path / "kl.json"
    rows = kl_memory.main(["--tokens", "16", "--hidden", "4", "--vocab", "50", "--tp", "1", "--json", str(out),
                           "--methods", "gather,fused_exact", "--chunk-size", "4"])
    assert json.loads(out.read_text()) == rows
    assert [r["comm_bytes"] for r in rows] == [0, 0]  # tp=1: no collective at all
    with pytest.raises(SystemExit):
        kl_memory.main(["--tokens", "16", "--hidden", "4", "--vocab", "50", "--json", str(out),
                        "--methods", "gather,bogus"])
    assert "unknown ['bogus']" in capsys.readouterr().err
