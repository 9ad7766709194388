"""`python -m tools.plot RUN [--out DIR]`: draw a run's KL story as PNGs.

  kl_beta.png       mean KL and beta on one figure (two y axes)
  reward.png        reward mean with a +-std band
  kl_quantiles.png  KL p50 / p90 / p99 / max per step (log scale)
  kl_heatmap.png    mean KL by response-position bucket (rows) and step (columns)
  reward_kl_corr.png  the correlation of reward and KL over the trainer's window (monitor.corr_window)
"""

from __future__ import annotations

import argparse
import os
import sys

from tools.diagnose import load_rows


def _col(rows, key):
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _kl_beta(ax, rows, np):
    ax.plot(*_col(rows, "kl_mean"), color="tab:red", label="mean KL")
    ax.set_xlabel("step")
    ax.set_ylabel("mean per-token KL", color="tab:red")
    ax2 = ax.twinx()
    ax2.plot(*_col(rows, "beta"), color="tab:blue", label="beta")
    ax2.set_ylabel("beta", color="tab:blue")
    ax.set_title("KL and its coefficient")


def _reward(ax, rows, np):
    x, m = _col(rows, "reward_mean")
    _, s = _col(rows, "reward_std")
    ax.plot(x, m, color="tab:green", label="reward mean")
    if len(s) == len(m):
        ax.fill_between(x, np.array(m) - np.array(s), np.array(m) + np.array(s), color="tab:green", alpha=0.15,
                        label="+-std")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend()
    ax.set_title("Reward")


def _quantiles(ax, rows, np):
    for key in ("kl_p50", "kl_p90", "kl_p99", "kl_max"):
        xs, ys = _col(rows, key)
        ax.plot(xs, [max(abs(y), 1e-8) for y in ys], label=key)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("|per-token KL|")
    ax.legend()
    ax.set_title("KL quantiles")


def _corr(ax, rows, np):
    ax.plot(*_col(rows, "reward_kl_corr"), color="tab:purple")
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.set_ylim(-1.05, 1.05)
    ax.set_xlabel("step")
    ax.set_ylabel("corr(reward, KL)")
    ax.set_title("Reward-KL correlation over a window (near 1 while both climb: look for reward hacking)")


def _heatmap(ax, rows, np):
    heat = [r.get("kl_by_position") for r in rows if isinstance(r.get("kl_by_position"), list)]
    width = max(len(h) for h in heat)
    grid = np.full((width, len(heat)), np.nan)
    for j, h in enumerate(heat):
        grid[: len(h), j] = h
    im = ax.imshow(grid, aspect="auto", origin="lower", cmap="magma", interpolation="nearest")
    ax.figure.colorbar(im, ax=ax, label="mean KL")
    ax.set_xlabel("step")
    ax.set_ylabel("response position bucket")
    ax.set_title("KL by response position")


def plot_run(rows: list[dict], out: str) -> list[str]:
    """Draw the run's PNGs into `out` -> their paths (a plot whose metric the run lacks is skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    os.makedirs(out, exist_ok=True)
    has_heat = any(isinstance(r.get("kl_by_position"), list) for r in rows)
    plots = [("kl_beta.png", _kl_beta, (7, 4), True), ("reward.png", _reward, (7, 4), True),
             ("kl_quantiles.png", _quantiles, (7, 4), True),
             ("reward_kl_corr.png", _corr, (7, 3), bool(_col(rows, "reward_kl_corr")[0])),
             ("kl_heatmap.png", _heatmap, (7, 4), has_heat)]
    written = []
    for name, draw, size, present in plots:
        if not present:
            continue
        fig, ax = plt.subplots(figsize=size)
        draw(ax, rows, np)
        path = os.path.join(out, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.plot", description=__doc__.split("\n")[0])
    ap.add_argument("run", help="run folder (with metrics.jsonl) or a metrics.jsonl file")
    ap.add_argument("--out", default=None, help="output folder (default RUN/plots)")
    args = ap.parse_args(argv)
    try:
        rows = load_rows(args.run)
    except (OSError, ValueError) as e:
        print(f"tools.plot: error: {e}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.run if os.path.isdir(args.run) else os.path.dirname(args.run), "plots")
    for p in plot_run(rows, out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
