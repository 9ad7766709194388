"""`python -m tools.kl_memory`: argument parsing, checks made before any work, and the run."""

from __future__ import annotations

import argparse
import json
import os
import sys

from core.config import ModelConfig
from core.model_shapes import PRESETS
from tools.klcost.measure import run_all
from tools.klcost.methods import DEFAULT, DTYPES, METHODS
from tools.klcost.peers import PEERS, unavailable
from tools.klcost.project import PROJECTABLE, project_all, refuse_if_too_big
from tools.klcost.report import atomic_write, write_report
from tools.klcost.spawn import RankFailure, run_spawned

MODELS = {name: (c.hidden_size, c.vocab_size) for name, c in PRESETS.items()}  # name -> (hidden, vocab) of the head
SWEEP_KEYS = ("tokens", "hidden", "vocab", "tp")


def parse_int(s: str) -> int:
    """'8192', '8k' (= 8192) or '128K'."""
    s = s.strip().lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


def parse_chunk(s: str):
    """'auto' -> None (the fused heads' default); '256' or '1k' -> an int."""
    return None if s.strip().lower() == "auto" else parse_int(s)


def parse_sweep(text: str) -> dict[str, list[int]]:
    """'tokens=8k,16k,tp=1,2' -> {'tokens': [8192, 16384], 'tp': [1, 2]}: a piece with '=' starts a key."""
    out: dict[str, list[int]] = {}
    key = None
    for piece in (p.strip() for p in text.split(",") if p.strip()):
        if "=" in piece:
            key, piece = (x.strip() for x in piece.split("=", 1))
            if key not in SWEEP_KEYS:
                raise ValueError(f"--sweep: unknown key {key!r}; choose from {list(SWEEP_KEYS)}")
            out[key] = []
        if key is None:
            raise ValueError(f"--sweep: {piece!r} comes before any key=; write e.g. tokens=4096,8192,tp=1,2")
        out[key].append(parse_int(piece))
    return out


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m tools.kl_memory",
                                 description="Peak memory, time and communication of the KL term's paths.")
    ap.add_argument("--tokens", type=parse_int, help="tokens per rank (T); 8k = 8192")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--model", choices=sorted(MODELS), help="take --hidden and --vocab from a model's head")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1,
                    help="context-parallel ranks: each rank's head runs over ceil(T / cp) of the T tokens (the "
                    "sequence split over cp; sequence parallelism inside tp changes nothing here: the head gets every "
                    "token of its rank); rows keep T as tokens_total")
    ap.add_argument("--ref-hidden", type=int, default=None,
                    help="the reference's (a distillation teacher's) hidden width; default --hidden")
    ap.add_argument("--ref-model", choices=sorted(MODELS), default=None,
                    help="take --ref-hidden from a model's head (a teacher, e.g. llama3-70b; same vocabulary)")
    ap.add_argument("--sweep", default=None, help="grid, e.g. tokens=8k,32k,128k,tp=1,2,4,8 (keys: tokens, "
                    "hidden, vocab, tp)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--json", default=None, help="output file: a JSON list of rows")
    ap.add_argument("--report", default=None, help="folder for rows.json, table.md and the PNG plots")
    ap.add_argument("--methods", default=",".join(DEFAULT), help=f"comma-separated subset of {list(METHODS)}")
    ap.add_argument("--peers", default="", help=f"comma-separated subset of {list(PEERS)} (tp = 1)")
    ap.add_argument("--chunk-size", type=parse_chunk, default="auto",
                    help="tokens per chunk of the chunked methods, or 'auto' (default: what the fused heads pick, "
                    "chunk x Vp/tp <= 2^25 elements and, above 2^21, chunk <= H/16 in bf16, H/8 in fp32; "
                    "in [128, T])")
    ap.add_argument("--pass", dest="pass_", choices=["forward", "forward+backward", "both"],
                    default="forward+backward")
    ap.add_argument("--project", action="store_true", help="projected rows (FakeTensorMode), nothing allocated")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="measured rows: cpu (default) or cuda; projected rows: the device path to project "
                    "(default cuda: fp32 logits straight from the matmul, as on a GPU)")
    ap.add_argument("--cpu-peak", choices=["memtracker", "profiler"], default="memtracker",
                    help="how a measured CPU row's peak is read: MemTracker (a dispatch mode) or the allocator's "
                    "events via torch.profiler (tools/klcost/cpu_peak.py); cce_k3 always uses the profiler")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before ranks still running are killed")
    ap.add_argument("--force", action="store_true", help="measure even when the estimate exceeds free memory")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def _names(ap, text, known, flag):
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"{flag}: unknown {unknown}; choose from {list(known)}")
    return names


def _grid(ap, a) -> tuple[list[tuple[int, int, int]], list[int]]:
    """((T, H, V) shapes, tps) from the single values, --model and --sweep."""
    if a.model:
        a.hidden, a.vocab = MODELS[a.model]
    try:
        sweep = parse_sweep(a.sweep) if a.sweep else {}
    except ValueError as e:
        ap.error(str(e))
    vals = {k: sweep.get(k, [getattr(a, k)]) for k in SWEEP_KEYS}
    for k, vs in vals.items():
        if any(v is None for v in vs):
            ap.error(f"--{k} is required (or give it in --sweep{', or --model' if k in ('hidden', 'vocab') else ''})")
        if any(v < 1 for v in vs):
            ap.error(f"--{k} must be positive, got {vs}")
    shapes = [(T, H, V) for T in vals["tokens"] for H in vals["hidden"] for V in vals["vocab"]]
    return shapes, vals["tp"]


def _check_outputs(ap, a):
    if not (a.json or a.report):
        ap.error("give --json OUT.json or --report DIR (or both)")
    if a.json:
        d = os.path.dirname(os.path.abspath(a.json))
        if not os.path.isdir(d):
            ap.error(f"--json {a.json}: folder {d} does not exist")
    if a.report:
        parent = os.path.dirname(os.path.abspath(a.report.rstrip("/")))
        if not os.path.isdir(parent):
            ap.error(f"--report {a.report}: parent folder {parent} does not exist")


def check_args(ap, a):
    """Every check that can fail, before any work: (methods, peers, notes, passes, shapes, tps)."""
    _check_outputs(ap, a)
    names = _names(ap, a.methods, METHODS, "--methods")
    peers = _names(ap, a.peers, PEERS, "--peers")
    shapes, tps = _grid(ap, a)
    if a.device is None:
        a.device = "cuda" if a.project else "cpu"
    if a.chunk_size is not None and a.chunk_size < 1:
        ap.error(f"--chunk-size must be positive or 'auto', got {a.chunk_size}")
    if a.chunk_size is not None and a.chunk_size > min(T for T, _, _ in shapes):
        ap.error(f"--chunk-size {a.chunk_size} is larger than --tokens {min(T for T, _, _ in shapes)}")
    if a.cp < 1:
        ap.error(f"--cp must be positive, got {a.cp}")
    if a.warmup < 0 or a.repeats < 1:
        ap.error(f"--warmup must be >= 0 and --repeats >= 1, got {a.warmup} and {a.repeats}")

    for V in {V for _, _, V in shapes}:
        for tp in tps:
            Vp = ModelConfig(vocab_size=V).padded_vocab_size(tp)
            if Vp % tp or Vp // tp < 1:
                ap.error(f"--tp {tp} does not divide the padded vocabulary {Vp} (vocab {V})")
    notes = []
    if peers and (max(tps) > 1):
        ap.error(f"--peers {peers} run at tp = 1 only (none of them shards the vocabulary); got tp {tps}")
    if a.device == "cuda" and not a.project:
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: torch.cuda.is_available() is False on this machine")
        if max(tps) > 1:
            ap.error("--device cuda runs tp = 1 here (the spawned ranks use gloo on CPU)")
    if a.project:

        notes += [f"{p}: not projected (compiled or Triton kernels; measured rows only)" for p in peers
                  if p not in PROJECTABLE]
        peers = [p for p in peers if p in PROJECTABLE]
    for p in list(peers):
        why = unavailable(p, a.device)
        if why:
            notes.append(why)
            peers.remove(p)
    if a.cpu_peak == "profiler" and max(tps) > 1 and not a.project:
        notes.append("--cpu-peak profiler at tp > 1: gloo's worker thread releases an all_gather's input and outputs "
                     "a moment after the call returns, and the profiler's overhead makes that land inside the run "
                     "often: gathering rows vary run to run by up to 3 [T, Vp/tp] per all_gather (docs/kl_cost.md)")
    passes = ["forward", "forward+backward"] if a.pass_ == "both" else [a.pass_]
    return names + peers, notes, passes, shapes, tps


def _log(r):
    t = "-" if r["time_s"] is None else f"{r['time_s']:.3f} s"
    print(f"{r['name']:>16} {r['pass']:>16} T={r['tokens']} H={r['hidden']} V={r['vocab']} tp={r['tp']} "
          f"{r['source']:>9}  peak {r['peak_bytes'] / 2**20:10.1f} MiB  time {t}  comm {r['comm_bytes']} B",
          file=sys.stderr, flush=True)


def main(argv=None) -> list[dict]:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.ref_model is not None:
        a.ref_hidden = MODELS[a.ref_model][0]
    names, notes, passes, shapes, tps = check_args(ap, a)
    totals = {(-(-T // a.cp), H, V): T for T, H, V in shapes}  # this rank's tokens -> the sequence's
    shapes = list(totals)
    for n in notes:
        print(f"note: {n}", file=sys.stderr, flush=True)
    if a.project:

        rows = project_all(names, passes, shapes, tps, a.dtype, a.chunk_size, log=_log, device=a.device,
                           ref_hidden=a.ref_hidden)
    else:

        refuse_if_too_big(ap, names, passes, shapes, tps, a)
        rows = measure_grid(names, passes, shapes, tps, a)
    for r in rows:
        r.update(cp=a.cp, tokens_total=totals.get((r["tokens"], r["hidden"], r["vocab"]), r["tokens"]))
    write_outputs(rows, notes, a, argv)
    return rows


def measure_grid(names, passes, shapes, tps, a) -> list[dict]:

    rows = []
    kw = dict(names=names, passes=passes, dtype=a.dtype, chunk=a.chunk_size, seed=a.seed, device=a.device,
              warmup=a.warmup, repeats=a.repeats, cpu_peak=a.cpu_peak, ref_hidden=a.ref_hidden)
    for tp in tps:
        if tp == 1:
            rows += run_all(shapes=shapes, log=_log, **kw)
            continue
        try:
            got = run_spawned(tp, timeout=a.timeout, log=lambda m: print(m, file=sys.stderr, flush=True),
                              shapes=shapes, **kw)
        except RankFailure as e:
            print(str(e), file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        for r in got:
            _log(r)
        rows += got
    return rows


def write_outputs(rows, notes, a, argv):

    if a.json:
        atomic_write(a.json, json.dumps(rows, indent=1))
    if a.report:
        command = "python -m tools.kl_memory " + " ".join(argv if argv is not None else sys.argv[1:])
        write_report(a.report, rows, notes, command)
