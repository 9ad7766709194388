"""Noise-aware statistics of a run's metric series, for the symptom detectors (tools/diagnose.py,
tools/symptoms.py, tools/symptoms_policy.py).

A metric logged once per step is a trajectory plus sampling noise: `reward_mean` is the mean of a few
hundred rewards (a 0/1 reward at p = 0.3 over 256 samples has a standard error of 0.029 per step), and
`kl_mean` the mean of a heavy-tailed per-token KL (p99 about 15x the mean), whose step-to-step changes
are 20-30% of its level. A detector therefore never compares two single steps: it fits a line by least
squares over a window and asks whether the slope's confidence interval clears a rate that matters.

| function        | returns                                                                          |
|-----------------|----------------------------------------------------------------------------------|
| `number`        | a float for ints, floats and the strings "nan"/"NaN"/"inf"/"-Infinity"... ; else None |
| `series`        | a key's finite values, in step order                                             |
| `fit`           | `Trend`: least-squares slope per step, its standard error (residual scatter, widened |
|                 | for lag-1 autocorrelation of the residuals), t = slope / se, fitted start/end    |
| `noise_sd`      | the step-to-step noise, robustly: MAD of first differences / (0.6745 sqrt 2)     |
| `gain`          | mean of the last part minus mean of the first part, with its standard error      |

The standard error of the slope is the textbook s / sqrt(Sxx) times sqrt((1 + rho) / (1 - rho)),
rho = lag-1 autocorrelation of the residuals clamped to [0, 0.9]: the effective-sample-size
correction for a series whose noise wanders (a policy that drifts for a few steps).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

Z = 3.0  # "significant": a slope, or a gain, at least this many standard errors from the null


def number(v) -> float | None:
    """v as a float when it is a number, or a string spelling one (metrics files written by other tools
    carry "nan", "NaN", "inf", "-Infinity"); None for anything else (booleans, lists, text)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            return None
    return None


def series(rows: list[dict], key: str) -> list[float]:
    """The finite values of `key` in `rows` (in order); records without it, or with a non-finite value,
    are left out."""
    out = []
    for r in rows:
        v = number(r.get(key))
        if v is not None and math.isfinite(v):
            out.append(v)
    return out


@dataclass
class Trend:
    slope: float  # per step
    se: float  # standard error of the slope
    n: int
    start: float  # the fitted value at the window's first point
    end: float  # ... and at its last

    @property
    def t(self) -> float:
        return self.slope / self.se if self.se > 0 else (math.inf if self.slope > 0 else -math.inf if self.slope < 0
                                                          else 0.0)

    def lower(self, z: float = Z) -> float:
        """The slope's lower confidence bound (slope - z se)."""
        return self.slope - z * self.se

    def upper(self, z: float = Z) -> float:
        return self.slope + z * self.se


def fit(ys: list[float]) -> Trend | None:
    """Least-squares line through ys against 0..n-1; None for fewer than 4 points."""
    n = len(ys)
    if n < 4:
        return None
    mx, my = (n - 1) / 2, sum(ys) / n
    if max(abs(y - my) for y in ys) <= 1e-12 * max(abs(my), 1e-300):  # constant up to rounding: no trend at all
        return Trend(0.0, 0.0, n, my, my)
    sxx = sum((i - mx) ** 2 for i in range(n))
    b = sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sxx
    res = [y - (my + b * (i - mx)) for i, y in enumerate(ys)]
    s2 = sum(e * e for e in res) / (n - 2)
    rho = 0.0
    if s2 > 0:
        rho = sum(a * c for a, c in zip(res, res[1:])) / (s2 * (n - 2))
        rho = min(max(rho, 0.0), 0.9)
    se = math.sqrt(s2 / sxx * (1 + rho) / (1 - rho))
    return Trend(b, se, n, my - b * mx, my + b * mx)


def noise_sd(ys: list[float]) -> float:
    """Step-to-step noise of ys, robust to a trend and to outliers: MAD of the first differences, scaled
    to a standard deviation of one step's value."""
    if len(ys) < 3:
        return 0.0
    d = [b - a for a, b in zip(ys, ys[1:])]
    med = statistics.median(d)
    return statistics.median(abs(x - med) for x in d) / (0.6745 * math.sqrt(2))


def gain(ys: list[float], part: int) -> tuple[float, float, float, float]:
    """(mean of the last `part` values - mean of the first `part`, its standard error from noise_sd,
    mean of the first part, mean of the last part)."""
    head, tail = ys[:part], ys[-part:]
    h, t = sum(head) / len(head), sum(tail) / len(tail)
    return t - h, noise_sd(ys) * math.sqrt(1 / len(head) + 1 / len(tail)), h, t
