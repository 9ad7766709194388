"""A/B of fused-head chunk sizes by CPU time: `python -m bench.bench_chunk_cpu_time --chunks 128,1024`.

Wall-clock rows of `tools.kl_memory` are unusable on a shared, loaded machine (other processes take
the cores); this times each forward+backward by the calling thread's CPU time instead
(`time.thread_time()`, which the other processes do not inflate), with torch on `--threads` threads
(1 by default, so all the work is on the timed thread). Methods and chunks are interleaved within
each round, after one untimed warm-up each; the medians over `--rounds` are printed per chunk with
the ratios the issue-13 time targets name: each method / matmul_floor, fused_exact_loss /
fused_k3_loss. The inputs and the runs are tools/klcost's (one rank, tp 1)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tools.klcost.measure import _run
from tools.klcost.methods import DTYPES, Inputs

NAMES = ["matmul_floor", "fused_exact_loss", "fused_k3_loss", "fused_exact", "fused_k3"]


def cpu_times(T: int, H: int, V: int, dtype: str, chunks: list[int], rounds: int) -> dict:
    """{(name, chunk): [thread CPU seconds per round]} for NAMES x chunks, forward+backward."""
    x = Inputs(T, H, V, 1, 0, DTYPES[dtype], 0, True)
    for n in NAMES:
        for c in chunks:
            _run(n, x, None, c, True)  # warm-up
    res = {(n, c): [] for n in NAMES for c in chunks}
    for r in range(rounds):
        for n in NAMES:
            for c in chunks:
                t0 = time.thread_time()
                _run(n, x, None, c, True)
                res[(n, c)].append(time.thread_time() - t0)
        print(f"round {r + 1}/{rounds} done", flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--chunks", default="128,1024", help="comma-separated tokens per chunk")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    chunks = [int(c) for c in a.chunks.split(",")]
    if a.rounds < 1 or a.threads < 1 or any(c < 1 or c > a.tokens for c in chunks):
        ap.error(f"need --rounds >= 1, --threads >= 1 and every chunk in [1, --tokens={a.tokens}], got "
                 f"rounds={a.rounds} threads={a.threads} chunks={chunks}")
    torch.set_num_threads(a.threads)
    res = cpu_times(a.tokens, a.hidden, a.vocab, a.dtype, chunks, a.rounds)
    med = {k: statistics.median(v) for k, v in res.items()}
    for c in chunks:
        floor = med[("matmul_floor", c)]
        cells = [f"{n} {med[(n, c)]:.3f} s ({med[(n, c)] / floor:.3f}x floor)" for n in NAMES]
        ratio = med[("fused_exact_loss", c)] / med[("fused_k3_loss", c)]
        print(f"chunk {c}: " + "; ".join(cells) + f"; fused_exact_loss / fused_k3_loss {ratio:.3f}")
    return med


if __name__ == "__main__":
    main()
