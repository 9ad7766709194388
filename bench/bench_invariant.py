"""The batch-invariant mode's cost: one GRPO step phase by phase with parallel.batch_invariant off and on.

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m bench.bench_invariant [--configs 60m,60m_gqa4,mid,tiny] [--steps 2]
        [--response-len N] [--set key=value ...]

`--response-len N`: every response runs to N tokens (room for them in the model's positions);
`--set`: further RLConfig overrides for both trainers. Both trainers are built from the same seeds and
stepped alternately (off, on, off, on, ...) so a shared machine's load falls on both alike; each phase's
median wall time over `--steps` steps after one warm-up, and the step's process CPU time (steadier than
wall time when other jobs share the cores).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from bench.bench_rl_step import CONFIGS, PHASES, BenchConfig, build_trainer
from bench.bench_rl_vs_trl import SIZES

# the 58.5M model of docs/benchmarks.md (bench_rl_vs_trl's "60m": 8 heads, 8 KV heads) on bench_rl_step's mid
# job (8 rows, prompts of ~31 tokens + 64 new ones); "60m_gqa4": the same with 2 KV heads, i.e. 4 query heads
# per KV head as Llama-3 and Mistral (Qwen2.5: 7), whose decode fills the invariant attention's 4-row tiles
_60M = replace(SIZES["60m"], max_seq_len=128)
CONFIGS = dict(CONFIGS, **{"60m": BenchConfig(_60M, CONFIGS["mid"].overrides),
                           "60m_gqa4": BenchConfig(replace(_60M, n_kv_heads=2), CONFIGS["mid"].overrides)})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="60m")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--response-len", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], help="RLConfig key=value overrides for both trainers")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = {}
    for name in a.configs.split(","):
        spec = CONFIGS[name]
        extra = list(a.set)
        if a.response_len:
            n = a.response_len
            spec = replace(spec, model=replace(spec.model, max_seq_len=64 + n))
            extra += [f"rollout.max_new_tokens={n}", f"rollout.min_new_tokens={n}"]
        trainers = {mode: build_trainer(spec, "grpo", extra=[*extra, f"parallel.batch_invariant={mode}"])
                    for mode in ("false", "true")}
        recs = {mode: [] for mode in trainers}
        for s in range(a.steps + 1):
            for mode, tr in trainers.items():
                c0 = time.process_time()
                r = dict(tr.step(s))
                r["cpu_s"] = time.process_time() - c0
                if s > 0:
                    recs[mode].append(r)
        keys = [f"time_{p}_s" for p in PHASES] + ["step_time_s", "cpu_s"]
        rows = {mode: {k: statistics.median(r[k] for r in rs) for k in keys} for mode, rs in recs.items()}
        print(f"{name}: {'phase':14s} {'off s':>8s} {'on s':>8s} {'on/off':>7s}")
        for k in keys:
            off, on = rows["false"][k], rows["true"][k]
            label = k[5:-2] if k.startswith("time_") else {"step_time_s": "step", "cpu_s": "step cpu"}[k]
            print(f"{name}: {label:14s} {off:8.3f} {on:8.3f} "
                  f"{on / off if off else float('nan'):7.3f}")
        out[name] = rows
    return out


if __name__ == "__main__":
    main()
