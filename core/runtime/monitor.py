"""Metrics where users already look: TensorBoard event files and a Weights & Biases offline run,
beside metrics.jsonl, under the same names.

`Monitor(out_dir, tensorboard=True, wandb="offline")` on rank 0; `log(rec, step)` writes every
finite number of the metrics record `rec` as a scalar named by its key, and the listed vector
metrics as histograms: `kl_quantiles` (kl_p50/p90/p99/max of the step), `rollout_kl_quantiles` (the
exact KL(rollout || train) per token's p50/p99/max, rl/health/mismatch.py) and `kl_by_position` (the
mean KL of each response-position bucket, as a histogram over bucket index weighted by that KL). Both
backends are optional extras (`pip install tensorboard`, `pip install wandb`): a missing one is
skipped with one note on stderr, never an error.
"""

from __future__ import annotations

import math
import os
import sys

HIST_KEYS = ("kl_by_position",)
QUANTILE_KEYS = ("kl_p50", "kl_p90", "kl_p99", "kl_max")
QUANTILE_GROUPS = {"kl_quantiles": QUANTILE_KEYS,
                   "rollout_kl_quantiles": ("rollout_kl_p50", "rollout_kl_p99", "rollout_kl_max")}


def scalars(rec: dict) -> dict[str, float]:
    """The record's finite numbers (bools as 0/1), keyed by their metrics.jsonl names."""
    out = {}
    for k, v in rec.items():
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


def _note(msg: str) -> None:
    print(f"kltron.monitor: {msg}", file=sys.stderr)


class Monitor:
    def __init__(self, out_dir: str, tensorboard: bool = False, wandb: str = "off", config: dict | None = None):
        self.tb = self.wb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # the optional extra is absent
                _note(f"monitor.tensorboard=true but TensorBoard is not installed ({e}); skipped "
                      f"(pip install tensorboard)")
            else:
                self.tb = SummaryWriter(log_dir=os.path.join(out_dir, "tensorboard"))
        if wandb == "offline":
            try:
                import wandb as wb
            except ImportError:
                _note("monitor.wandb=offline but wandb is not installed; skipped (pip install wandb)")
            else:
                # offline: nothing leaves the machine; the run folder is {out_dir}/wandb/offline-run-*
                # (read it back with `wandb leet inspect --json RUN`, upload it with `wandb sync RUN`)
                os.makedirs(out_dir, exist_ok=True)
                self.wb = wb.init(mode="offline", dir=out_dir, config=config or {}, project="kltron",
                                  settings=wb.Settings(disable_git=True))

    @property
    def active(self) -> bool:
        return self.tb is not None or self.wb is not None

    def log(self, rec: dict, step: int) -> None:
        vals = scalars(rec)
        quants = {name: [rec[k] for k in keys if isinstance(rec.get(k), (int, float))]
                  for name, keys in QUANTILE_GROUPS.items()}
        if self.tb is not None:
            import numpy as np

            for k, v in vals.items():
                self.tb.add_scalar(k, v, step)
            for name, quant in quants.items():
                if quant:
                    self.tb.add_histogram(name, np.asarray(quant, dtype=np.float64), step)
            for k in HIST_KEYS:
                h = rec.get(k)
                if isinstance(h, list) and h and all(isinstance(x, (int, float)) for x in h):
                    # bucket i's "count" is its mean KL: the per-position profile, one bar per bucket
                    c = [max(float(x), 0.0) for x in h]
                    self.tb.add_histogram_raw(k, min=0.0, max=float(len(c)), num=sum(c),
                                              sum=sum(i * x for i, x in enumerate(c)),
                                              sum_squares=sum(i * i * x for i, x in enumerate(c)),
                                              bucket_limits=[float(i + 1) for i in range(len(c))], bucket_counts=c,
                                              global_step=step)
            self.tb.flush()
        if self.wb is not None:
            import wandb as wb

            data = dict(vals)
            for name, quant in quants.items():
                if quant:
                    data[name] = wb.Histogram(quant)
            for k in HIST_KEYS:
                if isinstance(rec.get(k), list) and rec[k]:
                    data[k] = wb.Histogram(np_histogram=_position_hist(rec[k]))
            self.wb.log(data, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def _position_hist(h: list[float]):
    """(counts, edges) for wandb: bucket i holds the mean KL of position bucket i, clamped at 0 as in
    the TensorBoard histogram (a k1 bucket mean can be negative)."""
    import numpy as np

    return np.maximum(np.asarray(h, dtype=np.float64), 0.0), np.arange(len(h) + 1, dtype=np.float64)
