"""Reward and KL curves of runs at several staleness levels, beside synchronous seeds: a table of window
means and a plot. The runs are made by rl.train (see docs/async.md, "Training at staleness"); this reads
their metrics.jsonl.

    python -m bench.staleness_curves --runs sync_1234=DIR sync_1=DIR ... --window 40 --plot OUT.png
"""

from __future__ import annotations

import argparse
import json
import os


def read(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in (json.loads(line) for line in f if line.strip()) if "reward_mean" in r]


def windows(recs: list[dict], key: str, w: int) -> list[float]:
    return [sum(r[key] for r in recs[a:a + w]) / len(recs[a:a + w]) for a in range(0, len(recs), w)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True, help="NAME=RUN_DIR, synchronous runs named sync_*")
    ap.add_argument("--window", type=int, default=40)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    runs = dict(r.split("=", 1) for r in a.runs)
    data = {name: read(d) for name, d in runs.items()}
    n = max(len(v) for v in data.values())
    heads = [f"{s}-{min(s + a.window, n) - 1}" for s in range(0, n, a.window)]
    print("| run | " + " | ".join(f"steps {h}: reward / KL" for h in heads) + " |")
    print("|---|" + "---|" * len(heads))
    for name, recs in data.items():
        cells = [f"{r:.3f} / {k:.3f}" for r, k in zip(windows(recs, "reward_mean", a.window),
                                                     windows(recs, "kl_mean", a.window))]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, recs in data.items():
            steps = [a.window * (i + 0.5) for i in range(len(windows(recs, "reward_mean", a.window)))]
            style = dict(color="0.6", lw=1) if name.startswith("sync") else dict(lw=1.8)
            for ax, key in zip(axes, ("reward_mean", "kl_mean")):
                ax.plot(steps, windows(recs, key, a.window), label=name, **style)
        for ax, title in zip(axes, ("reward (exact match)", "mean KL per token")):
            ax.set_xlabel("step")
            ax.set_title(title)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=90)
    return data


if __name__ == "__main__":
    main()
