"""Soak, not part of the test run: `python -m tests.soak [--steps 300] [--nproc 1] [--out DIR]`.

Runs the tiny GRPO job (configs/grpo_tiny.yaml, its start checkpoint built or reused under
`--sft-dir`) for `--steps` steps, stopped at half way (train.stop_after, a job time limit) and
resumed with the same command, then checks `metrics.jsonl`: every step 0..steps-1 exactly once, no
skipped optimizer step, every number finite, and peak memory flat after warm-up in each of the two
processes (max RSS on CPU / max allocated on CUDA; growth from 20 % to the end of a segment at most
`--mem-slack` of the warm value). Prints one line per check and exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(nproc: int, overrides: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    head = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
            if nproc > 1 else [sys.executable, "-m"])
    cmd = head + ["rl.train", "--config", os.path.join(REPO, "configs", "grpo_tiny.yaml"), *overrides]
    res = subprocess.run(cmd, cwd=REPO, env=env)
    if res.returncode != 0:
        raise SystemExit(f"soak: {' '.join(cmd)} exited {res.returncode}")


def _numbers(v):
    if isinstance(v, bool):
        return []
    if isinstance(v, (int, float)):
        return [float(v)]
    if isinstance(v, list):
        return [x for e in v for x in _numbers(e)]
    return []


def check(rows: list[dict], steps: int, half: int, slack: float) -> list[tuple[str, bool, str]]:
    out = []
    got = [r["step"] for r in rows]
    out.append(("every step exactly once", got == list(range(steps)), f"{len(got)} records"))
    skipped = sum(int(r.get("skipped", 0)) for r in rows)
    out.append(("no skipped step", skipped == 0, f"{skipped} skipped"))
    bad = [(r["step"], k) for r in rows for k, v in r.items() if any(not math.isfinite(x) for x in _numbers(v))]
    out.append(("metrics finite", not bad, f"first non-finite: {bad[:3]}"))
    for name, seg in (("first process", rows[:half]), ("resumed process", rows[half:])):
        warm = seg[len(seg) // 5]["peak_mem_bytes"]
        end = seg[-1]["peak_mem_bytes"]
        growth = (end - warm) / warm
        out.append((f"peak memory flat after warm-up ({name})", growth <= slack,
                    f"{warm / 2**20:.1f} MiB at step {seg[len(seg) // 5]['step']} -> {end / 2**20:.1f} MiB at step "
                    f"{seg[-1]['step']} ({100 * growth:+.2f} %)"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--out", default="/tmp/kltron_soak")
    ap.add_argument("--sft-dir", default="/tmp/kltron_soak_sft")
    ap.add_argument("--mem-slack", type=float, default=0.02)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = ap.parse_args(argv)
    half = args.steps // 2
    common = [f"train.steps={args.steps}", f"train.out_dir={args.out}", f"init.sft_dir={args.sft_dir}",
              "train.progress=false", "train.save_every=50", *args.overrides]
    t0 = time.time()
    _launch(args.nproc, common + [f"train.stop_after={half}"])
    _launch(args.nproc, common)
    with open(os.path.join(args.out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    results = check(rows, args.steps, half, args.mem_slack)
    for name, ok, detail in results:
        print(f"soak: {'PASS' if ok else 'FAIL'} {name}: {detail}")
    print(f"soak: {args.steps} steps, resume at {half}, {time.time() - t0:.0f} s")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
