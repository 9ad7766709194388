"""Context parallelism on the accelerators available (scripts/gpu_check.sh's "context_parallel" section):
    python -m tests.gpu.cp_check [--cpu] [--tokens 32768] [--json OUT]

Two ranks are started here: NCCL with one GPU each when there are two GPUs or more, else gloo on the CPU
(exactness) -- cp = 2 needs two devices; NCCL refuses two ranks on one GPU.
  1. exactness (tests/test_context_parallel.py's checks): ring and Ulysses attention of each rank's tokens
     and their gradients against single-device attention in float64 (1e-10); the model with the fused
     GRPO head at cp = 2, every gradient against one device in float64 (1e-10); on CUDA the ring runs its
     math kernel (the CPU flash kernel serves CPU blocks only);
  2. the GRPO update's forward + backward over one sequence of `--tokens` tokens (bench/bench_cp.py's
     `update_peak`, a model of `--hidden`): cp = 2 ring and Ulysses per rank against cp = 1, peak memory and
     time. With one GPU only cp = 1 runs there (cp = 2 is reported as skipped).
`--cpu`: everything on the CPU with gloo, at `--tokens 1024` and a hidden size of 64 (seconds); the two ranks are
forked, not spawned.
Writes {backend, device, checks: [{name, ok, detail}], steps: [...]} to --json; exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _checks(device) -> list[dict]:
    from tests.test_context_parallel import attention_run, model_run, reference_model_run

    out = []
    ref = reference_model_run(torch.float64)
    for impl in ("ring", "ulysses"):
        for name, fn in ((f"attention {impl} cp=2 fp64",
                          lambda i=impl: attention_run(2, i, 4, 2, False, device=device)),
                         (f"attention {impl} documents fp64",
                          lambda i=impl: attention_run(2, i, 4, 2, True, device=device)),
                         (f"model+fused GRPO head {impl} cp=2 fp64",
                          lambda i=impl: model_run(2, 1, i, ref, torch.float64, True, device))):
            try:
                fn()
                ok, detail = True, ""
            except Exception:  # noqa: BLE001 - reported, the next check runs
                ok, detail = False, traceback.format_exc(limit=3)
            flag = torch.tensor([0.0 if ok else 1.0], device=device)
            dist.all_reduce(flag)
            out.append(dict(name=name, ok=bool(flag.item() == 0), detail=detail))
    return out


def _rank(rank: int, port: int, args, q) -> None:
    from bench.bench_cp import update_peak

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    nccl = not args.cpu and torch.cuda.device_count() >= 2
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=900))
    checks = _checks(device)
    kw = dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, repeats=1)
    steps = []
    if nccl or args.cpu:
        for impl in ("ring", "ulysses"):
            steps.append(update_peak(args.tokens, dist.group.WORLD, impl, device=device, **kw))
    dist.barrier()
    if rank == 0:
        one = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
        steps.append(update_peak(args.tokens, None, device=one, **kw))
        q.put(dict(backend="nccl" if nccl else "gloo", device=str(device), gpus=torch.cuda.device_count(),
                   checks=checks, steps=steps, cp2_skipped=not (nccl or args.cpu)))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.cp_check", description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.cpu:
        args.tokens, args.hidden, args.layers, args.vocab = args.tokens or 1024, args.hidden or 64, 2, 256
    args.tokens, args.hidden = args.tokens or 32768, args.hidden or 1024
    ctx = mp.get_context("fork" if args.cpu else "spawn")  # --cpu: the ranks start without re-importing torch
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    rep = q.get(timeout=1800)
    for p in procs:
        p.join()
    rep["tokens"], rep["hidden"] = args.tokens, args.hidden
    one = rep["steps"][-1]
    for r in rep["steps"]:
        r["peak_over_cp1"] = r["peak_bytes"] / one["peak_bytes"] if one["peak_bytes"] else None
        print(f"T={r['tokens']} cp={r['cp']} {r['impl'] if r['cp'] > 1 else '':8} peak {r['peak_bytes'] / 2**20:.1f} "
              f"MiB ({r['peak_over_cp1']:.3f}x cp=1), {r['time_s']:.3f} s")
    for c in rep["checks"]:
        print(f"[{'PASS' if c['ok'] else 'FAIL'}] {c['name']} ({rep['backend']})" + (f": {c['detail']}" if c["detail"]
                                                                                    else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if all(c["ok"] for c in rep["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
