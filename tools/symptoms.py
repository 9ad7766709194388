"""The KL playbook's symptom detectors, registered in `tools.diagnose.diagnose` (see docs/kl_playbook.md).

Each `check_*(rows, window)` reads the metrics.jsonl records and returns a `Finding` (what it saw,
the likely cause, the first fix) or None:

| finding              | symptom                                                                    |
|----------------------|----------------------------------------------------------------------------|
| reward_flat_kl_normal| reward has not moved since the start while the KL sits at a normal level   |
| kl_high              | the mean KL level stays high (>= KL_HIGH nats/token), well below the guard |
| reward_hacking       | reward rising while the KL climbs with it (beta shrinking or too small)    |
| entropy_collapse     | entropy near zero, or falling fast                                         |
| entropy_max          | entropy near its maximum log(vocab): a blown-up policy                     |
| kl_adv_spike         | KL jumps at, or just after, a spike of the mean absolute advantage         |
| repetition_low_kl    | responses repeat their n-grams while the KL stays low                      |
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Finding:
    """One diagnosis (tools.diagnose prints these): the symptom's name, what was seen, causes, first fix."""

    name: str
    evidence: str
    causes: str
    first_try: str


def _series(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def _slope(ys: list[float]) -> float:
    """Least-squares slope per step."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))

KL_NORMAL = 1e-3  # a mean per-token KL above this is "not near zero"
BETA_STRONG = 0.5  # a per-token KL coefficient this large dominates a reward in [0, 1]
KL_HIGH = 1.0  # nats per token: high for RL fine-tuning (a healthy run's is 0.01-0.4)
KL_HACK = 0.5  # the KL level a reward-hacking climb reaches
ENTROPY_ZERO = 0.05  # nats per token
KL_SPIKE = 0.05  # a KL spike below this (nats/token) is noise around a near-zero KL
ADV_LAG = 2  # steps after an advantage spike in which the KL may jump
REPEAT = 0.3  # share of repeated 3-grams per response


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


def check_reward_flat_kl_normal(rows, window: int) -> Finding | None:
    """Fires when the reward has not risen since the first steps, the KL is above KL_NORMAL, and the
    penalty is what holds: beta >= BETA_STRONG, or the KL is being pulled back (falling by a third)."""
    rw, kl = _series(rows, "reward_mean"), _series(rows, "kl_mean")
    if len(rw) < 12 or len(kl) < 6:
        return None
    head, tail, k = rw[:5], rw[-window:], kl[-window:]
    gain = sum(tail) / len(tail) - sum(head) / len(head)
    level = statistics.median(k)
    beta = _series(rows, "beta")[-window:]
    strong = bool(beta) and statistics.median(beta) >= BETA_STRONG
    pulled = _slope(k) < 0 and k[-1] < 0.67 * k[0]
    if gain < 0.05 * max(abs(sum(head) / len(head)), 0.1) and level > KL_NORMAL and (strong or pulled):
        bt = f"; beta {statistics.median(beta):.4g}" if beta else ""
        return Finding("reward_flat_kl_normal", f"reward {sum(head) / len(head):.3g} over the first 5 steps and "
                                                f"{sum(tail) / len(tail):.3g} over the last {len(tail)} while the "
                                                f"mean KL sits at {level:.3g}{bt}"
                                                + (" and is being pulled back" if pulled else ""),
                       "the KL penalty (beta) or the reference is too strong: the policy spends its updates staying "
                       "close to the reference; or the learning rate is too low",
                       "lower kl_ctl.beta (or kl_ctl.preset=ziegler with a larger kl_ctl.target); check that "
                       "reference.checkpoint is the policy's start; raise optim.lr")
    return None


def check_kl_high(rows, window: int) -> Finding | None:
    kl = _series(rows, "kl_mean")[-window:]
    if len(kl) < 6 and not (rows and rows[-1].get("kl_stop")):  # a run the KL guard stopped early is judged too
        return None
    level = statistics.median(kl)
    if level >= KL_HIGH:
        beta = _series(rows, "beta")[-window:]
        bt = f" with beta {statistics.median(beta):.4g}" if beta else ""
        return Finding("kl_high", f"the mean KL sits at {level:.3g} nats/token (median of the last {len(kl)} "
                                  f"steps){bt}: high, though below guard.kl_warn_per_token",
                       "beta too small for the learning rate (or 0); a reference that is not the policy's start",
                       "raise kl_ctl.beta or let it adapt (kl_ctl.preset=ziegler or band, kl_ctl.target ~0.1); "
                       "lower optim.lr")
    return None


def check_reward_hacking(rows, window: int) -> Finding | None:
    rw, kl = _series(rows, "reward_mean")[-window:], _series(rows, "kl_mean")[-window:]
    if len(rw) < 8 or len(kl) < 8:
        return None
    n = max(len(kl) // 4, 2)
    kl0, kl1 = sum(kl[:n]) / n, sum(kl[-n:]) / n
    r0, r1 = sum(rw[:n]) / n, sum(rw[-n:]) / n
    corr = pearson(rw, kl)
    if r1 > r0 and _slope(rw) > 0 and kl1 >= KL_HACK and kl1 >= 2 * max(kl0, 1e-6) and (corr or 0.0) >= 0.6:
        beta = _series(rows, "beta")[-window:]
        bt = f"; beta {beta[0]:.4g} -> {beta[-1]:.4g}" if beta else ""
        return Finding("reward_hacking", f"reward {r0:.3g} -> {r1:.3g} while the mean KL climbs {kl0:.3g} -> "
                                         f"{kl1:.3g} with it (correlation {corr:.2f} over {len(kl)} steps){bt}",
                       "the policy is buying reward by moving far from the reference: reward hacking or an "
                       "overfit reward model; a shrinking or too small beta lets it",
                       "read the high-reward samples; hold the KL (kl_ctl.preset=ziegler or band with a target); "
                       "reward.normalize=fixed and reward.clip; a larger rollout.group_size")
    return None


def check_entropy_collapse(rows, window: int) -> Finding | None:
    ent = _series(rows, "entropy")[-window:]
    if len(ent) < 6:
        return None
    last = sum(ent[-3:]) / 3
    short = ent[-10:]
    fast = len(short) >= 6 and short[0] > 0.2 and last < 0.4 * short[0]
    if last < ENTROPY_ZERO or fast:
        what = f"entropy {last:.3g} nats/token (from {short[0]:.3g} {len(short)} steps before)"
        return Finding("entropy_collapse", what,
                       "the policy turned deterministic: learning rate too high, no entropy bonus, rewards that "
                       "favour one answer, or a low sampling temperature",
                       "loss.entropy_target (e.g. half the start entropy) or loss.entropy_coef; lower optim.lr; "
                       "rollout.temperature=1.0")
    return None


def check_entropy_max(rows, window: int) -> Finding | None:
    recent = [r for r in rows[-window:] if isinstance(r.get("entropy"), (int, float))
              and isinstance(r.get("entropy_max"), (int, float)) and r["entropy_max"] > 0]
    if len(recent) < 3:
        return None
    hits = [r for r in recent if r["entropy"] >= 0.8 * r["entropy_max"]]
    if len(hits) >= max(3, len(recent) // 2):
        r = hits[-1]
        return Finding("entropy_max", f"entropy {r['entropy']:.3g} of at most {r['entropy_max']:.3g} nats/token "
                                      f"in {len(hits)}/{len(recent)} recent steps: near uniform",
                       "the policy blew up: learning rate far too high, an entropy bonus too large (or an entropy "
                       "target too high), a non-finite step that was not skipped",
                       "lower optim.lr; lower loss.entropy_coef or loss.entropy_target; resume from an earlier "
                       "checkpoint")
    return None


def _spikes(xs: list[float]) -> set[int]:
    med = statistics.median(xs)
    mad = statistics.median([abs(x - med) for x in xs]) or 1e-12
    return {i for i, x in enumerate(xs) if x > med + 5 * mad and x > 1.5 * med}


def check_kl_adv_spike(rows, window: int) -> Finding | None:
    """Fires when the mean KL jumps (a rise far above the window's step-to-step changes, >= KL_SPIKE and
    by half its level) at a step of an outlier mean |advantage| or up to ADV_LAG steps after it, and the
    KL's rises correlate with |adv| at that lag. The KL of step s is measured before step s's update, so
    an update driven by huge advantages shows at s + 1, or later where momentum carries it; the KL may
    come back (a spike) or stay up (a jump)."""
    recent = [r for r in rows[-window:] if isinstance(r.get("kl_mean"), (int, float))
              and isinstance(r.get("adv_abs_mean"), (int, float))]
    if len(recent) < 8:
        return None
    kl, adv = [r["kl_mean"] for r in recent], [r["adv_abs_mean"] for r in recent]
    rise = [0.0] + [b - a for a, b in zip(kl, kl[1:])]
    advs = _spikes(adv)
    jumps = {i for i in _spikes(rise) if rise[i] >= KL_SPIKE and rise[i] >= 0.5 * max(kl[i - 1], 0.0)}
    both = {i for i in jumps if any(i - lag in advs for lag in range(ADV_LAG + 1))}
    corr = max(pearson(rise[lag:], adv[:len(adv) - lag]) or 0.0 for lag in range(ADV_LAG + 1))
    if both and corr >= 0.5:
        steps = [recent[i].get("step") for i in sorted(both)]
        at = [recent[i].get("step") for i in sorted(advs)]
        return Finding("kl_adv_spike", f"the KL jumps at steps {steps}, at or just after outlier mean |advantage| "
                                       f"at steps {at} ({max(adv):.3g} against a median {statistics.median(adv):.3g}"
                                       f"; correlation of KL rises and |adv| {corr:.2f} over {len(recent)} steps)",
                       "a few outlier rewards (or a critic off scale) give huge advantages, and the update they "
                       "drive moves the policy far in one step",
                       "reward.clip and reward.normalize=fixed; algo.whiten_advantages / algo.adv_std_norm; "
                       "optim.grad_clip; a smaller optim.lr")
    return None


def check_repetition_low_kl(rows, window: int) -> Finding | None:
    rep, kl = _series(rows, "repetition_rate")[-window:], _series(rows, "kl_mean")[-window:]
    if len(rep) < 6 or len(kl) < 6:
        return None
    r, k = statistics.median(rep), statistics.median(kl)
    if r >= REPEAT and k < 0.05:
        return Finding("repetition_low_kl", f"{r:.0%} of the responses' 3-grams repeat (median of {len(rep)} "
                                            f"steps) while the mean KL is only {k:.3g}",
                       "the reference itself repeats (the KL pins the policy to a degenerate start), or sampling "
                       "is too greedy (low temperature)",
                       "check the start checkpoint's samples; rollout.temperature=1.0; a repetition penalty in "
                       "the reward (reward.fns); lower kl_ctl.beta so the policy can leave the reference")
    return None


CHECKS = (check_reward_flat_kl_normal, check_kl_high, check_reward_hacking, check_entropy_collapse,
          check_entropy_max, check_kl_adv_spike, check_repetition_low_kl)
