"""configs/distill_tiny.yaml and its variants, one after another, then one table: the student's greedy
exact-match accuracy on the 128 held-out prompts (eval_pass1) along the run, the teacher's (measured at
step 0), the sampled reward of the last 25 steps, the sampled reverse KL to the teacher (distill_k1) at the
end, and the median step time.

    python -m bench.bench_distill_tiny [--steps 300] [--rows reverse_kl,...] [--out runs] [--table-only]

Rows: the five distillation losses (algo.name=distill), GRPO with the distillation term beside it
(distill.coef=0.5, the reference KL at beta 0.02), and GRPO alone (the same rollouts' shape, no teacher
term) as the baseline. Each row is `python -m rl.train --config configs/distill_tiny.yaml ...` in its own
process; a row whose metrics exist is not rerun unless --force.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

RL_ROWS = ["algo.name=grpo", "kl_ctl.mode=fixed", "kl_ctl.beta=0.02"]
ROWS = {
    "reverse_kl": ["distill.loss=reverse_kl"],
    "forward_kl": ["distill.loss=forward_kl"],
    "jsd": ["distill.loss=jsd", "distill.beta=0.5"],
    "sampled_reverse_kl": ["distill.loss=sampled_reverse_kl"],
    "topk_forward_kl": ["distill.loss=topk_forward_kl", "distill.top_k=8"],
    "grpo+distill": RL_ROWS + ["distill.coef=0.5"],
    "grpo": RL_ROWS + ["distill.coef=0"],
}
MARKS = (0, 50, 100, 150, 200, 250)


def run_row(name: str, steps: int, out: str, force: bool) -> str:
    d = os.path.join(out, f"distill_tiny_{name.replace('+', '_plus_')}")
    if os.path.exists(os.path.join(d, "metrics.jsonl")) and not force:
        return d
    cmd = [sys.executable, "-m", "rl.train", "--config", "configs/distill_tiny.yaml", *ROWS[name],
           f"train.steps={steps}", f"train.out_dir={d}", "train.progress=false", "train.resume=false"]
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return d


def summary(name: str, d: str) -> dict:
    recs = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    evals = {r["step"]: r["eval_pass1"] for r in recs if "eval_pass1" in r}
    last = recs[-25:]
    return {"row": name, "steps": len(recs), "eval": evals,
            "teacher": next((r["teacher_eval_pass1"] for r in recs if "teacher_eval_pass1" in r), None),
            "reward_last25": statistics.mean(r["reward_mean"] for r in last),
            "k1_last25": statistics.mean(r["distill_k1"] for r in last) if "distill_k1" in last[-1] else None,
            "step_s": statistics.median(r["step_time_s"] for r in recs)}


def table(rows: list[dict]) -> str:
    last = max(max(r["eval"]) for r in rows)
    marks = [m for m in MARKS if m < last] + [last]
    head = ("| row | " + " | ".join(f"eval@{m}" for m in marks)
            + " | teacher | reward (last 25) | KL(s||t) k1 (last 25) | step s |")
    lines = [head, "|" + "---|" * (len(marks) + 5)]
    for r in rows:
        ev = " | ".join(f"{r['eval'][m]:.3f}" if m in r["eval"] else "-" for m in marks)
        t = "-" if r["teacher"] is None else f"{r['teacher']:.3f}"
        k = "-" if r["k1_last25"] is None else f"{r['k1_last25']:.3f}"
        lines.append(f"| {r['row']} | {ev} | {t} | {r['reward_last25']:.3f} | {k} | {r['step_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out", default="runs")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args(argv)
    names = args.rows.split(",")
    dirs = {n: os.path.join(args.out, f"distill_tiny_{n.replace('+', '_plus_')}") if args.table_only
            else run_row(n, args.steps, args.out, args.force) for n in names}
    print(table([summary(n, dirs[n]) for n in names]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
