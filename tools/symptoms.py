"""The KL and reward symptoms of the KL playbook (docs/kl_playbook.md), registered in
`tools.diagnose.diagnose`; tools/symptoms_policy.py holds those of beta, ratios, entropy and text.

Each `check_*(rows, window)` reads the metrics.jsonl records and returns a `Finding` (what it saw,
the likely cause, the first fix) or None. Trends are least-squares slopes with their standard errors
(tools/trend.py), judged after the start-up (every run's KL rises from exactly 0 while the policy
leaves its reference) over the last TREND_STEPS steps:

| finding               | fires when                                                                       |
|-----------------------|----------------------------------------------------------------------------------|
| kl_climbing           | the KL rises faster than doubling every CLIMB_DOUBLING steps, or (over >= 30      |
|                       | steps) faster than CLIMB_ABS nats/token per step past CLIMB_LEVEL, judged by the |
|                       | slope's lower confidence bound (Z standard errors)                               |
| reward_hacking        | the KL soars (doubling faster than every CLIMB_DOUBLING steps, by the lower bound), |
|                       | or sits >= KL_HIGH and still rises, while the reward rises significantly         |
| kl_high               | median KL of the window >= KL_HIGH nats/token                                    |
| kl_flat_reward        | reward stalled (no significant rise over the run, nor lately; >= MIN_FLAT_STEPS   |
|                       | steps) while the median KL < KL_NEAR_ZERO                                        |
| reward_flat_kl_normal | reward stalled while KL_NEAR_ZERO <= median KL < KL_HIGH                          |
| ref_follows_policy    | the reward rises significantly while the median KL stays below KL_ZERO          |
| kl_negative           | the mean KL is negative, significantly (a sampled k1 whose samples are not pi's)  |
| kl_adv_spike          | the KL jumps at, or just after, an outlier mean |advantage|                       |
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from tools.trend import Z, fit, noise_sd, number, series


@dataclass
class Finding:
    """One diagnosis (tools.diagnose prints these): the symptom's name, what was seen, causes, first fix."""

    name: str
    evidence: str
    causes: str
    first_try: str


STARTUP_STEPS = 10  # the healthy default GRPO job's KL rises from 0 to its plateau over its first ~10 steps
TREND_STEPS = 60  # trends are fitted over at most the last this many steps after the start-up
MIN_TREND = 15  # ... and at least this many
TREND_WINDOWS = (20, 30, TREND_STEPS)  # the KL's climb is judged on each
CLIMB_DOUBLING = 25  # steps: a KL doubling faster than this climbs (the healthy job's: ~50 steps at its fastest)
CLIMB_ABS = 0.003  # nats/token per step: a KL rising faster climbs (the healthy job's: <= 0.0023) ...
CLIMB_LEVEL = 0.5  # ... once it has passed this (nats/token; the healthy job's plateau: 0.36)
KL_HIGH = 1.0  # nats per token: high for RL fine-tuning (the healthy job's stays <= 0.4), far below the guard
KL_NEAR_ZERO = 0.01  # nats per token: "KL near 0" (the healthy job's lowest 20-step mean is 0.086)
KL_ZERO = 1e-3  # nats per token: the policy has not left the reference at all
MIN_FLAT_STEPS = 40  # a reward is called flat only with this many steps to judge it by ...
FLAT_NOISE = 1.5  # ... and when its change over the run, at the slope's upper bound, is within this many steps' noise
KL_SPIKE = 0.05  # a KL spike below this (nats/token) is noise around a near-zero KL
ADV_LAG = 2  # steps after an advantage spike in which the KL may jump


def after_startup(rows: list[dict]) -> list[dict]:
    """The records from step STARTUP_STEPS on (records without an integer step are kept)."""
    return [r for r in rows if not isinstance(r.get("step"), int) or r["step"] >= STARTUP_STEPS]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def kl_climb(rows: list[dict]) -> dict | None:
    """The KL's trend after the start-up over the last 20, 30 and 60 steps (TREND_WINDOWS): {"climbing": bool,
    "soaring": bool, "rel": log-KL trend, "abs": KL trend, "kl": the values} of the window that shows the
    strongest climb (the longest where none does); None with fewer than 20 steps after the start-up."""
    kl = series(after_startup(rows), "kl_mean")[-TREND_STEPS:]
    if len(kl) < TREND_WINDOWS[0] or min(kl) <= 0:
        return None
    best = None
    for w in TREND_WINDOWS:  # a climb that started lately shows on a short window, a slow one on a long
        if w > len(kl) and best is not None:
            break
        part = kl[-w:]
        rel, ab = fit([math.log(x) for x in part]), fit(part)
        fast = rel.lower() >= math.log(2) / CLIMB_DOUBLING
        steady = w >= 30 and ab.lower() >= CLIMB_ABS and ab.end >= CLIMB_LEVEL
        c = {"climbing": fast or steady, "soaring": fast, "rel": rel, "abs": ab, "kl": part}
        if best is None or (c["climbing"], c["soaring"]) > (best["climbing"], best["soaring"]):
            best = c
    return best


def _climb_text(c: dict) -> str:
    rel, ab = c["rel"], c["abs"]
    doubling = math.log(2) / rel.slope if rel.slope > 0 else math.inf
    return (f"mean KL {ab.start:.3g} -> {ab.end:.3g} (fitted) over the last {ab.n} steps: {ab.slope:.3g} +- "
            f"{ab.se:.2g} nats/token per step, doubling every {doubling:.0f} steps")


def reward_rising(rows: list[dict], n: int) -> tuple[bool, object]:
    rw = series(rows, "reward_mean")[-n:]
    tr = fit(rw)
    return (tr is not None and tr.lower() > 0), tr


def check_reward_hacking(rows, window: int) -> Finding | None:
    """The KL soars (doubles faster than every CLIMB_DOUBLING steps), or sits >= KL_HIGH and still rises
    significantly, while the reward rises significantly over the same steps: the policy buys reward by
    leaving the reference. A steady climb at a rate a healthy run's KL never has, without the soaring, is
    `kl_climbing` whatever the reward does."""
    c = kl_climb(rows)
    if c is None:
        return None
    soaring = c["soaring"]
    high = _median(c["kl"][-window:]) >= KL_HIGH and c["abs"].lower() > 0
    up, tr = reward_rising(after_startup(rows), c["abs"].n)
    if not (soaring or high) or not up:
        return None
    beta = series(rows, "beta")[-c["abs"].n:]
    bt = f"; beta {beta[0]:.4g} -> {beta[-1]:.4g}" if beta else ""
    return Finding("reward_hacking", f"reward {tr.start:.3g} -> {tr.end:.3g} (fitted, t = {tr.t:.1f}) while the "
                                     f"{_climb_text(c)}{bt}",
                   "the policy is buying reward by moving far from the reference: reward hacking or an overfit "
                   "reward model; a shrinking or too small beta lets it",
                   "read the high-reward samples; hold the KL (kl_ctl.preset=ziegler or band with a target); "
                   "reward.normalize=fixed and reward.clip; a larger rollout.group_size")


def check_kl_climbing(rows, window: int) -> Finding | None:
    c = kl_climb(rows)
    if c is None or not c["climbing"]:
        return None
    beta = series(rows, "beta")[-c["abs"].n:]
    bt = f"; beta {beta[0]:.4g} -> {beta[-1]:.4g}" if beta else ""
    return Finding("kl_climbing", _climb_text(c) + bt,
                   "beta too small for this learning rate; learning rate too high; a tokenizer or response-mask "
                   "mismatch between policy and reference (KL high from the first step)",
                   "raise kl_ctl.beta or use kl_ctl.preset=ziegler with a target; lower optim.lr; confirm both "
                   "checkpoints carry the same tokenizer fingerprint")


def check_kl_high(rows, window: int) -> Finding | None:
    kl = series(rows, "kl_mean")[-window:]  # the start-up's low KL only lowers the median: kept
    stopped = bool(rows and rows[-1].get("kl_stop"))  # a run the KL guard stopped early is judged too
    if (len(kl) < 6 and not stopped) or _median(kl) < KL_HIGH:
        return None
    beta = series(rows, "beta")[-window:]
    bt = f" with beta {_median(beta):.4g}" if beta else ""
    return Finding("kl_high", f"the mean KL sits at {_median(kl):.3g} nats/token (median of the last {len(kl)} "
                              f"steps){bt}: high" + (" (the KL guard stopped the run)" if stopped else ""),
                   "beta too small for the learning rate (or 0); a reference that is not the policy's start",
                   "raise kl_ctl.beta or let it adapt (kl_ctl.preset=ziegler or band, kl_ctl.target ~0.1); "
                   "lower optim.lr")


def reward_stalled(rows: list[dict]) -> tuple[bool, str]:
    """(the reward has not risen, what was measured): >= MIN_FLAT_STEPS steps after step 0, neither the
    whole run's slope nor the last TREND_STEPS steps' is 2 standard errors above 0 (no evidence of a rise),
    and the whole run's slope at its upper bound (+2 standard errors) changes the reward by at most FLAT_NOISE
    steps' sampling noise over the run (evidence of flatness: a short or noisy run is not called flat)."""
    rw = series([r for r in rows if r.get("step") != 0], "reward_mean")
    if len(rw) < MIN_FLAT_STEPS:
        return False, ""
    whole, recent = fit(rw), fit(rw[-TREND_STEPS:])
    if whole.lower(2.0) > 0 or recent.lower(2.0) > 0 or whole.upper(2.0) * whole.n > FLAT_NOISE * noise_sd(rw):
        return False, ""
    return True, (f"reward {whole.start:.3g} -> {whole.end:.3g} (fitted over {whole.n} steps: {whole.slope:.2g} "
                  f"+- {whole.se:.1g} per step, no significant rise)")


def check_kl_flat_reward(rows, window: int) -> Finding | None:
    stalled, ev = reward_stalled(rows)
    kl = series(after_startup(rows), "kl_mean")[-window:]
    if not stalled or len(kl) < 6 or _median(kl) >= KL_NEAR_ZERO:
        return None
    adv = series(rows, "adv_abs_mean")[-window:]
    ev += f" while the mean KL is {_median(kl):.2g} nats/token (median of {len(kl)} steps)"
    if adv:
        ev += f"; mean |advantage| {_median(adv):.3g}"
    return Finding("kl_flat_reward", ev,
                   "beta too large (the penalty pins the policy to the reference); too little diversity in each "
                   "group (all samples scored alike, so advantages are zero); learning rate too low",
                   "lower kl_ctl.beta (e.g. by 10x, or kl_ctl.preset=target_over_kl); raise rollout.temperature or "
                   "rollout.group_size so groups disagree")


def check_reward_flat_kl_normal(rows, window: int) -> Finding | None:
    stalled, ev = reward_stalled(rows)
    kl = series(after_startup(rows), "kl_mean")[-window:]
    if not stalled or len(kl) < 6 or not KL_NEAR_ZERO <= _median(kl) < KL_HIGH:
        return None
    beta = series(rows, "beta")[-window:]
    bt = f", beta {_median(beta):.4g}" if beta else ""
    return Finding("reward_flat_kl_normal", f"{ev} while the mean KL sits at a normal {_median(kl):.3g} "
                                            f"nats/token{bt}",
                   "the reference is too strong or the penalty too tight: the policy spends its updates staying "
                   "close to the reference; or the learning rate is too low",
                   "allow a larger KL: lower kl_ctl.beta or raise kl_ctl.target; check that reference.checkpoint is "
                   "the policy's start; raise optim.lr")


def check_ref_follows_policy(rows, window: int) -> Finding | None:
    kl = series(after_startup(rows), "kl_mean")[-window:]
    rest = after_startup(rows)
    up, tr = reward_rising(rest, TREND_STEPS)
    if len(kl) < 6 or _median(kl) >= KL_ZERO or not up or len(series(rest, "reward_mean")) < MIN_TREND:
        return None
    syncs = sum(1 for r in rows if r.get("ref_synced") is True)
    return Finding("ref_follows_policy", f"reward {tr.start:.3g} -> {tr.end:.3g} (fitted, t = {tr.t:.1f}) while "
                                         f"the mean KL stays at {_median(kl):.2g} nats/token"
                                         + (f"; the reference was synced {syncs} times" if syncs else ""),
                   "the policy learns but never leaves the reference: the reference is not frozen (it trains with "
                   "the policy, or shares its weights), or it is synced to the policy too often",
                   "load a separate frozen reference (reference.checkpoint); sync it rarely (reference.sync_every "
                   "about a tenth of train.steps, or reference.sync_below)")


def check_kl_negative(rows, window: int) -> Finding | None:
    kl = series(after_startup(rows), "kl_mean")[-window:]
    if len(kl) < 6:
        return None
    m, sd = sum(kl) / len(kl), statistics.stdev(kl)
    if not (m < 0 and m < -Z * max(sd, 1e-12) / math.sqrt(len(kl))):
        return None
    return Finding("kl_negative", f"the mean KL is negative: {m:.3g} nats/token on average over {len(kl)} steps "
                                  f"(step-to-step sd {sd:.2g})",
                   "a sampled k1 (log pi/ref) is negative on single tokens, but its mean over the policy's own "
                   "samples estimates KL(pi||ref) >= 0: samples that are not the policy's (stale old log-probs, "
                   "a mask or shift misaligning log-probs), or policy and reference swapped",
                   "keep the sign (do not clip the per-token KL at 0); check the response mask and the log-prob "
                   "shift; use kl.estimator=k3+ (>= 0 per token) or kl.exact=true to cross-check")


def _spikes(xs: list[float]) -> set[int]:
    med = statistics.median(xs)
    mad = statistics.median([abs(x - med) for x in xs]) or 1e-12
    return {i for i, x in enumerate(xs) if x > med + 5 * mad and x > 1.5 * med}


def pearson(xs, ys):
    n = min(len(xs), len(ys))
    if n < 3:
        return None
    xs, ys = xs[-n:], ys[-n:]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    if sxx <= 1e-24 or syy <= 1e-24:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sxx * syy) ** 0.5


def check_kl_adv_spike(rows, window: int) -> Finding | None:
    """Fires when the mean KL jumps (a rise far above the window's step-to-step changes, >= KL_SPIKE and
    by half its level) at a step of an outlier mean |advantage| or up to ADV_LAG steps after it, and the
    KL's rises correlate with |adv| at that lag. The KL of step s is measured before step s's update, so
    an update driven by huge advantages shows at s + 1, or later where momentum carries it; the KL may
    come back (a spike) or stay up (a jump)."""
    recent = [r for r in rows[-window:] if number(r.get("kl_mean")) is not None
              and number(r.get("adv_abs_mean")) is not None]
    recent = [r for r in recent if math.isfinite(number(r["kl_mean"])) and math.isfinite(number(r["adv_abs_mean"]))]
    if len(recent) < 8:
        return None
    kl, adv = [number(r["kl_mean"]) for r in recent], [number(r["adv_abs_mean"]) for r in recent]
    rise = [0.0] + [b - a for a, b in zip(kl, kl[1:])]
    advs = _spikes(adv)
    jumps = {i for i in _spikes(rise) if rise[i] >= KL_SPIKE and rise[i] >= 0.5 * max(kl[i - 1], 0.0)}
    both = {i for i in jumps if any(i - lag in advs for lag in range(ADV_LAG + 1))}
    corr = max(pearson(rise[lag:], adv[:len(adv) - lag]) or 0.0 for lag in range(ADV_LAG + 1))
    if not (both and corr >= 0.5):
        return None
    steps = [recent[i].get("step") for i in sorted(both)]
    at = [recent[i].get("step") for i in sorted(advs)]
    return Finding("kl_adv_spike", f"the KL jumps at steps {steps}, at or just after outlier mean |advantage| "
                                   f"at steps {at} ({max(adv):.3g} against a median {statistics.median(adv):.3g}"
                                   f"; correlation of KL rises and |adv| {corr:.2f} over {len(recent)} steps)",
                   "a few outlier rewards (or a critic off scale) give huge advantages, and the update they "
                   "drive moves the policy far in one step",
                   "reward.clip and reward.normalize=fixed; algo.whiten_advantages / algo.adv_std_norm; "
                   "optim.grad_clip; a smaller optim.lr")


CHECKS = (check_reward_hacking, check_kl_adv_spike, check_kl_climbing, check_kl_high, check_kl_negative,
          check_ref_follows_policy, check_kl_flat_reward, check_reward_flat_kl_normal)
