"""Sequence parallelism's memory at tp=2: what a forward keeps for backward (MemTracker), SP off and on, with
and without activation checkpointing, beside core/runtime/budget.py's activation parts.

    python -m bench.bench_seq_parallel

Two gloo ranks on CPU, fp32; the model and batch of tests/test_seq_parallel_memory.py (which asserts the
same comparison). With checkpointing the budget's numbers leave out the one layer that exists only while
backward recomputes it (its peak counts it).
"""

from __future__ import annotations

from core.runtime.budget_seq import other_act, seq_act
from tests import test_seq_parallel_memory as case
from tests.dist import DistPool


def main() -> list[dict]:
    pool = DistPool(case.TP)
    rows = []
    try:
        for ac in (False, True):
            for sp in (False, True):
                got = pool.run(case._kept_after_forward, sp, ac)[0]
                b = case._budget(sp, ac)
                recompute = (other_act(case.CFG, case.TP) + seq_act(case.CFG, case.TP, sp)) * case.ROWS * case.S * 4
                want = b["activations"] + b["sequence activations"] - (recompute if ac else 0)
                rows.append(dict(ac=ac, sp=sp, measured=got, budget=want, seq_part=b["sequence activations"]))
    finally:
        pool.close()
    print("| checkpointing | SP | kept after forward (MB, MemTracker) | budget (MB) | budget / measured | "
          "budget's sequence activations (MB) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {'on' if r['ac'] else 'off'} | {'on' if r['sp'] else 'off'} | {r['measured'] / 1e6:.3f} | "
              f"{r['budget'] / 1e6:.3f} | {r['budget'] / r['measured']:.3f} | {r['seq_part'] / 1e6:.3f} |")
    return rows


if __name__ == "__main__":
    main()
