"""The RL update with the policy loss inside the fused head (`algo.fused_loss=true`, the default)
against autograd through the recomputing fused head (`false`), side by side in one run.

    python -m bench.bench_fused_update [--config mid] [--steps 2] [--repeats 2]

One process, 1 thread, GRPO on bench.bench_rl_step's configs, with the sampled KL estimator
and with the exact full-vocabulary KL. Runs alternate (on, off, on, off, ...) so machine load hits
both alike; each reports the median phase times of `--steps` steps after a warm-up step.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.bench_rl_step import CONFIGS, build_trainer, time_steps


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="mid", choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for exact in (False, True):
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for _ in range(args.repeats):
            for fused in (True, False):
                t = build_trainer(CONFIGS[args.config], "grpo",
                                  extra=[f"algo.fused_loss={str(fused).lower()}", f"kl.exact={str(exact).lower()}"])
                runs[fused].append(time_steps(t, args.steps))
        for fused in (True, False):
            rs = runs[fused]
            rows.append({"kl": "exact" if exact else "k3 (sampled)", "fused_loss": fused,
                         "update_s": statistics.median(r["update"] for r in rs),
                         "step_s": statistics.median(r["step"] for r in rs), "grad_norm": rs[0]["grad_norm"]})
    print(f"`python -m bench.bench_fused_update --config {args.config} --steps {args.steps} "
          f"--repeats {args.repeats}`\n")
    print("| KL | algo.fused_loss | update s | step s | update vs off | grad norm |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        off = next(o for o in rows if o["kl"] == r["kl"] and not o["fused_loss"])
        print(f"| {r['kl']} | {str(r['fused_loss']).lower()} | {r['update_s']:.2f} | {r['step_s']:.2f} | "
              f"{r['update_s'] / off['update_s']:.2f} | {r['grad_norm']:.4f} |")
    return rows


if __name__ == "__main__":
    main()
