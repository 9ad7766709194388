"""`python -m tools.kl_memory` (tools/klcost/): its CLI and JSON rows, the values every method computes
against a float64 reference, communication volumes that follow from the algorithms, projections
(FakeTensorMode) against measurements, bad arguments, and a rank killed mid-run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from core.config import ModelConfig
from tests.dist import REPO
from tools import kl_memory
from tools.klcost import cli, methods
from tools.klcost.distill_methods import TOP_K
from tools.klcost.project import project

FIELDS = {"name", "method", "mode", "pass", "source", "tokens", "hidden", "vocab", "tp", "dtype", "peak_bytes",
          "time_s", "comm_bytes", "memory_source", "first_run_s"}
# the KL-to-reference methods; the distillation rows (a teacher of another width, other values) are checked
# against their own float64 formulas in tests/test_distill.py::test_kl_memory_distillation_rows
ALL = [m for m in methods.METHODS if not m.startswith("distill_")]
WITH_DISTILL = list(methods.METHODS)  # the memory and projection checks: every method


def _run_cli(args, timeout=240):
    cmd = [sys.executable, "-m", "tools.kl_memory", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_cli_tp2_rows_comm_and_projection(tmp_path):
    T, H, V, tp = 24, 8, 131, 2
    out = tmp_path / "kl.json"
    proc = _run_cli(["--tokens", str(T), "--hidden", str(H), "--vocab", str(V), "--tp", str(tp), "--json", str(out),
                     "--chunk-size", "8", "--pass", "both", "--methods", ",".join(WITH_DISTILL), "--repeats", "1",
                     "--warmup", "0"], timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    passes = ("forward", "forward+backward")
    assert {(r["name"], r["pass"]) for r in rows} == {(n, p) for n in WITH_DISTILL for p in passes}
    for r in rows:
        assert FIELDS <= set(r), r
        assert (r["tokens"], r["hidden"], r["vocab"], r["tp"], r["source"]) == (T, H, V, tp, "measured")
        assert r["peak_bytes"] > 0 and r["time_s"] > 0
    by = {(r["name"], r["pass"]): r for r in rows}
    width = 192 // tp  # ModelConfig(vocab_size=131).padded_vocab_size(2) = 192
    grad_hidden = T * H * 4  # copy_to_tp's backward all-reduce, the same for every method
    assert by["gather", "forward"]["comm_bytes"] == 2 * T * width * 4  # two all-gathers of [T, Vp/tp] fp32
    assert by["gather", "forward+backward"]["comm_bytes"] == 2 * T * width * 4 + grad_hidden
    # fused exact: one MAX of [T, 2] and one gather of [T, 6] (sum-exp p/q, entropy, KL, 2 targets)
    assert by["fused_exact", "forward"]["comm_bytes"] == T * (2 + 6) * 4
    for p in ("forward", "forward+backward"):  # the loss inside: the same volume, per chunk (T / 8 = 3 calls)
        assert by["fused_exact_loss", p]["comm_bytes"] == by["fused_exact", p]["comm_bytes"]
        assert by["fused_exact_loss", p]["comm_calls"] == by["fused_exact", p]["comm_calls"] + 2 * (3 - 1)
    # k3: [T, 2] maxima and [T, 4] sums; with the loss inside the reference's [T, 1] + [T, 2] come from
    # its own no-grad call and the policy's [c, 1] + [c, 2] per chunk: the same bytes
    assert by["fused_k3", "forward"]["comm_bytes"] == T * (2 + 4) * 4
    assert by["fused_k3_loss", "forward"]["comm_bytes"] == T * (2 + 4) * 4
    assert by["vp_chunked", "forward"]["comm_bytes"] == T * 4 * ((1 + 2) + (1 + 2) + (2 + 3))
    assert by["matmul_floor", "forward"]["comm_bytes"] == 0
    # the projection runs the same code on a fake group: the same comm, peaks within 10% (in a fresh
    # process, as a user runs it: nothing earlier in this one can touch its fake group or allocator)
    proj = tmp_path / "proj.json"
    proc = _run_cli(["--tokens", str(T), "--hidden", str(H), "--vocab", str(V), "--tp", str(tp), "--json", str(proj),
                     "--chunk-size", "8", "--pass", "both", "--methods", ",".join(WITH_DISTILL), "--project"],
                    timeout=600)
    assert proc.returncode == 0, proc.stderr
    projected = json.loads(proj.read_text())
    assert len(projected) >= 2 * (len(WITH_DISTILL) - 1)  # every method but (at most) one that cannot be projected
    for pr in projected:
        r = by[pr["name"], pr["pass"]]
        assert pr["source"] == "projected" and pr["comm_bytes"] == r["comm_bytes"], (pr["name"], pr["pass"])
        if pr["name"] == "gather":
            # The measured gather rows at tp=2 have, now and then, held three more [T, Vp/tp] fp32 buffers
            # than the projection (forward 127584 vs 99936 bytes; forward+backward 127680 vs 100032): the
            # last all_gather's input and two outputs, which gloo's Work still references on its worker
            # thread for a moment after the call returns (seen in ~0.2-2% of calls; more under load;
            # docs/kl_cost.md). The bound allows exactly those three; the other rows keep the 10% bound.
            assert r["peak_bytes"] - 3 * T * width * 4 <= pr["peak_bytes"] <= r["peak_bytes"] * 1.10, (pr, r)
            continue
        if pr["name"] == "distill_topk":
            # The same gloo effect on the teacher's top-k all-gathers: measured once in a few runs 9600 bytes
            # above the projection at T = 24 (docs/distillation.md's 40420 against 30820) and 12800 at T = 32,
            # T k (4 + 8 tp): the values' [T, k] fp32 input and the ids' tp gathered [T, k] int64 parts, still
            # referenced for a moment after the call returns. Otherwise the two agree to the byte.
            held = T * TOP_K * (4 + 8 * tp)
            assert r["peak_bytes"] - held <= pr["peak_bytes"] <= r["peak_bytes"] * 1.10, (pr, r)
            continue
        assert abs(pr["peak_bytes"] - r["peak_bytes"]) <= 0.10 * r["peak_bytes"], (pr, r)


def _reference_values(T, H, V, seed):
    """float64 log p(t), entropy, KL(p||q) and k3 of the tool's inputs (tp = 1), by hand."""
    x = methods.Inputs(T, H, V, 1, 0, torch.float64, seed, False)
    zp, zq = (x.h @ x.w.T)[:, :V], (x.hr @ x.wr.T)[:, :V]
    logp, logq = zp.log_softmax(-1), zq.log_softmax(-1)
    lp, lq = logp.gather(1, x.t[:, None])[:, 0], logq.gather(1, x.t[:, None])[:, 0]
    p = logp.exp()
    r = (lq - lp).exp()
    return dict(logprob=lp.mean(), entropy=-(p * logp).sum(-1).mean(), kl=(p * (logp - logq)).sum(-1).mean(),
                k3=(r - 1 - (lq - lp)).mean())


@pytest.mark.slow
def test_every_method_agrees_with_float64(tmp_path):
    out = tmp_path / "kl.json"
    peers = "verl_k3,trl_k3" if cli.unavailable("trl_k3", "cpu") is None else "verl_k3"
    rows = kl_memory.main(["--tokens", "32", "--hidden", "8", "--vocab", "131", "--json", str(out), "--methods",
                           ",".join(ALL), "--peers", peers, "--chunk-size", "8", "--repeats", "1", "--warmup", "0"])
    assert json.loads(out.read_text()) == rows
    ref = _reference_values(32, 8, 131, 0)
    for r in rows:
        assert r["comm_bytes"] == 0 and r["source"] == "measured"  # tp = 1: no collective at all
        if r["name"] == "matmul_floor":
            assert r["time_vs_floor"] == 1.0
            continue
        assert r["logprob_mean"] == pytest.approx(float(ref["logprob"]), rel=1e-5), r["name"]
        want = ref["kl"] if r["mode"] == "exact" else ref["k3"]
        assert r["kl_mean"] == pytest.approx(float(want), rel=1e-5), r["name"]
        if r["mode"] == "exact":
            assert r["entropy_mean"] == pytest.approx(float(ref["entropy"]), rel=1e-5), r["name"]
        assert r["time_vs_floor"] > 0


@pytest.mark.parametrize("name", ["gather", "vp_chunked", "fused_exact", "fused_exact_loss", "fused_k3_loss",
                                  "distill_fused_loss", "distill_jsd", "distill_topk", "distill_jsd_call"])
@pytest.mark.slow
def test_projection_matches_measurement_tp1(name):
    from tools.klcost.measure import measure

    for p in ("forward", "forward+backward"):
        real = measure(name, p, 200, 24, 1000, "fp32", 64, repeats=0)
        proj = project(name, p, 200, 24, 1000, 1, "fp32", 64)
        assert proj["source"] == "projected" and proj["time_s"] is None
        assert abs(proj["peak_bytes"] - real["peak_bytes"]) <= 0.10 * real["peak_bytes"], (p, proj, real)


@pytest.mark.slow
def test_projected_rows_at_llama_scale_allocate_nothing(tmp_path):
    out = tmp_path / "p.json"
    rows = kl_memory.main(["--model", "llama3-8b", "--tokens", "8k", "--dtype", "bf16", "--project", "--json",
                           str(out), "--methods", "gather,fused_exact", "--chunk-size", "1024", "--sweep", "tp=1,8"])
    by = {(r["name"], r["tp"]): r["peak_bytes"] for r in rows}
    Vp = ModelConfig(vocab_size=128256).padded_vocab_size(1)
    assert by["gather", 1] >= 2 * 8192 * 128256 * 4  # at least two fp32 [T, V] (log p, log q): 8 GiB
    # no [T, V] tensor: the head-weight gradient (V x H fp32, 4 [chunk, V] tensors' worth at H=4096) plus at
    # most 6 [chunk, V] fp32 temporaries (logits of both models, the statistics' work tensors)
    assert by["fused_exact", 1] < 10 * 1024 * Vp * 4
    assert by["fused_exact", 1] < by["gather", 1] / 5
    assert by["fused_exact", 8] < by["fused_exact", 1] / 4  # the chunk's logits shrink with the shard


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.slow
def test_projection_extrapolated_in_tokens_equals_the_direct_one(tp):
    """13 chunks of 64 tokens and a short one of 5, extrapolated from 4 and 8 chunks (+ 5): the same
    peak, bytes and calls as running them all (the chunked loops repeat the same work; the O(T)
    buffers are made up front). vp_chunked is projected directly: its peak is the larger of a forward
    and a backward phase with different slopes in T, which swap at 13 chunks here."""
    for name in ("matmul_floor", "vp_chunked", "fused_exact", "fused_exact_loss", "fused_k3", "fused_k3_loss"):
        for p in ("forward", "forward+backward"):
            ext = project(name, p, 64 * 13 + 5, 16, 1000, tp, "bf16", 64)
            direct = project(name, p, 64 * 13 + 5, 16, 1000, tp, "bf16", 64, extrapolate=False)
            assert ext.get("extrapolated_from") == (None if name == "vp_chunked" else [261, 517])
            assert "extrapolated_from" not in direct
            for k in ("tokens", "peak_bytes", "comm_bytes", "comm_calls"):
                assert ext[k] == direct[k], (name, p, k, ext[k], direct[k])


def test_default_chunk_is_auto_and_meets_the_10x_target_at_llama_scale(tmp_path):
    """The memory target at T=8192, H=4096, V=128256 bf16, tp 1, at the default chunk: the fused exact
    KL peaks >= 10x below gathering the logits. The chunk reported is the fused heads' rule."""
    rows = kl_memory.main(["--model", "llama3-8b", "--tokens", "8k", "--dtype", "bf16", "--project", "--json",
                           str(tmp_path / "p.json"), "--methods", "gather,fused_exact,fused_exact_loss"])
    by = {r["name"]: r for r in rows}
    Vp = ModelConfig(vocab_size=128256).padded_vocab_size(1)
    assert by["fused_exact"]["chunk_size"] == 256 == min(2**25 // Vp, 4096 * 2 // 32) // 64 * 64  # bf16 head
    assert by["gather"]["peak_bytes"] >= 10 * by["fused_exact"]["peak_bytes"]
    assert by["gather"]["peak_bytes"] >= 10 * by["fused_exact_loss"]["peak_bytes"]
    # the head's weight gradient (bf16 [Vp, H], summed over the chunks in an fp32 accumulator whose storage
    # it is then cast into: 4 bytes per weight), grad hidden (bf16 [T, H]) and at most 7 [256, Vp] fp32
    assert by["fused_exact"]["peak_bytes"] <= Vp * 4096 * 4 + 8192 * 4096 * 2 + 7 * 256 * Vp * 4


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 8])
def test_exact_kl_within_1p1x_the_memory_of_k3_at_llama_scale_tp(tp):
    """The memory target at tp > 1: projected at T=8192, H=4096, V=128256 bf16 (Llama-3-8B's head),
    forward+backward at the default chunk, the fused exact KL with the loss inside peaks at most
    1.1x the fused sampled-k3 path with the loss inside. The exact path holds one [chunk, Vp/tp]
    fp32 temporary more (the reference's logits); with the chunk bounded by elements only (2048
    tokens at tp 8) that 128 MiB stayed while the head's gradient (in both peaks) shrank with tp:
    1.15x at tp 2, 1.27x at tp 8 (this test fails so with the second bound of auto_chunk_size removed)."""
    T, H, V = 8192, 4096, 128256
    exact = project("fused_exact_loss", "forward+backward", T, H, V, tp, "bf16", None)
    k3 = project("fused_k3_loss", "forward+backward", T, H, V, tp, "bf16", None)
    width = ModelConfig(vocab_size=V).padded_vocab_size(tp) // tp
    assert k3["peak_bytes"] >= width * H * 2  # the weight gradient is inside the k3 path's peak
    assert exact["chunk_size"] == k3["chunk_size"]
    assert exact["peak_bytes"] <= 1.1 * k3["peak_bytes"], (exact["peak_bytes"], k3["peak_bytes"], exact["chunk_size"])


def test_sweep_parsing():
    assert cli.parse_sweep("tokens=8k,16K,tp=1,2") == {"tokens": [8192, 16384], "tp": [1, 2]}
    with pytest.raises(ValueError, match="unknown key 'depth'"):
        cli.parse_sweep("depth=3")


@pytest.mark.parametrize("args, message", [
    (["--methods", "gather,bogus"], "unknown ['bogus']"),
    (["--peers", "nemo_k3"], "unknown ['nemo_k3']"),
    (["--chunk-size", "64"], "--chunk-size 64 is larger than --tokens 16"),
    (["--peers", "verl_k3", "--tp", "2"], "run at tp = 1 only"),
    (["--json", "/nonexistent-dir/x.json"], "folder /nonexistent-dir does not exist"),
    (["--sweep", "tp=0"], "--tp must be positive"),
])
def test_bad_arguments(tmp_path, capsys, args, message):
    base = ["--tokens", "16", "--hidden", "4", "--vocab", "50", "--json", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit):
        kl_memory.main(base + args)
    assert message in capsys.readouterr().err


def test_absurd_size_refused_before_allocating(tmp_path, capsys):
    start = time.monotonic()
    with pytest.raises(SystemExit):
        kl_memory.main(["--tokens", "128k", "--hidden", "4096", "--vocab", "128256", "--dtype", "fp32",
                        "--methods", "gather", "--chunk-size", "1024", "--json", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert "needs about" in err and "GiB" in err and "--project" in err
    need = float(err.split("needs about ")[1].split(" GiB")[0])
    assert need > 2 * 131072 * 128256 * 4 / 2**30  # more than two fp32 [T, V] tensors
    assert time.monotonic() - start < 60 and not (tmp_path / "x.json").exists()


def _children(pid):
    """Spawned rank processes of `pid` (multiprocessing's spawn_main), from /proc."""
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and "spawn_main" in cmd:
            kids.append(int(d))
    return kids


@pytest.mark.slow
def test_killed_rank_is_named_and_the_tool_exits(tmp_path):
    """kill -9 one rank of --tp 2; the tool must exit non-zero within its timeout,
    naming that rank (the old code waited on the result queue forever)."""
    cmd = [sys.executable, "-m", "tools.kl_memory", "--tokens", "4096", "--hidden", "64", "--vocab", "4000",
           "--tp", "2", "--json", str(tmp_path / "x.json"), "--methods", "fused_exact", "--repeats", "500",
           "--timeout", "300"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kids = []
        deadline = time.monotonic() + 240  # imports are slow on a loaded machine
        while len(kids) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            kids = _children(proc.pid)
        assert len(kids) == 2, "the ranks did not start"
        time.sleep(3)
        victim = max(kids)
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)  # the old code never returned
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert f"(pid {victim})" in err and "SIGKILL" in err, err[-2000:]
    assert not (tmp_path / "x.json").exists()
