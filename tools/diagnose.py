"""`python -m tools.diagnose RUN [--json]`: read a run's metrics.jsonl and name the likely problem.

Each check looks for one symptom of the KL playbook's troubleshooting table (docs/kl_playbook.md lists
every one with its detector) and, when it fires, says what it saw (with the numbers), the likely
causes, and the first thing to try. Findings come in the order of ORDER (the most specific first); a
finding that explains another drops it (SUBSUMES: reward hacking explains a climbing or high KL).
This file holds the run-wide checks:

| finding            | symptom                                                         |
|--------------------|-----------------------------------------------------------------|
| non_finite         | NaN/inf in KL, reward, loss or grad norm (also the strings "nan", "inf"), or skipped steps |
| collapse           | entropy at its maximum ln V (uniform policy) or grad norm 0     |
| kl_concentrated    | low mean KL, 80% of it or more on the largest 1% of tokens      |
| reward_swings      | step-to-step reward changes large against its trend and its sampling noise |

and the detectors of tools/symptoms.py (KL and reward), tools/symptoms_policy.py (beta, ratios,
entropy, text), tools/symptoms_mismatch.py (rollout vs training log-probs) and tools/symptoms_recipes.py (the
algorithm recipes' metrics: dynamic sampling, GSPO's clip, truncation). Trends are judged with their standard
errors (tools/trend.py), not step to step.

A metrics file with a step logged twice (an old run resumed before metrics were truncated on
resume) is read keeping the last record of each step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict

from rl.health.guards import HEALTHY_FRACTION, UNIFORM_FRACTION
from tools import symptoms, symptoms_mismatch, symptoms_policy, symptoms_recipes
from tools.symptoms import Finding
from tools.trend import number, series

KL_LOW_MEAN = 0.5  # nats/token: below this a mean KL looks harmless
NON_FINITE_KEYS = ("kl_mean", "reward_mean", "reward_std", "grad_norm", "pg_loss", "kl_loss", "loss", "entropy",
                   "adv_abs_mean")


def check_non_finite(rows) -> Finding | None:
    bad = []
    for r in rows:
        for k in NON_FINITE_KEYS:
            v = number(r.get(k))
            if v is not None and not math.isfinite(v):
                bad.append(f"{k}={v} at step {r.get('step')}")
    skipped = sum(int(r.get("skipped", 0) or 0) for r in rows)
    if not bad and skipped == 0:
        return None
    ev = "; ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else "")
    if skipped:
        ev = (ev + "; " if ev else "") + f"{skipped} optimizer step(s) skipped for a non-finite gradient norm"
    return Finding("non_finite", ev,
                   "learning rate too high; a NaN reward or NaN old log-probs; bf16 reductions without the fp32 "
                   "path; an unclamped log-ratio exploding in exp()",
                   "lower optim.lr (e.g. halve it) and keep kl.fp32=true; set kl.log_ratio_clamp=20; check the "
                   "reward function on the logged responses")


# the largest 1% of tokens carry at least this share of the KL: the healthy default GRPO job's share has
# a median of 0.3-0.45 over 200 steps and reaches 0.77 on single steps late in the run
CONCENTRATED = 0.8
TAIL_MAX = 1.0  # nats: a concentrated tail has at least one token this far from the reference


def top1_share(r: dict) -> tuple[float, bool] | None:
    """(share of the step's KL carried by its largest 1% of tokens, exact?) from a metrics record:
    `kl_top1_share` where logged, else a lower bound from the quantiles -- the tokens above p99 are
    each >= p99 (share >= 0.01 p99 / mean) and the other 99% each <= p99 (share >= 1 - 0.99 p99 / mean)."""
    m, p99 = r.get("kl_mean"), r.get("kl_p99")
    if isinstance(r.get("kl_top1_share"), (int, float)):
        return float(r["kl_top1_share"]), True
    if not (isinstance(m, (int, float)) and isinstance(p99, (int, float))) or not m > 1e-6:
        return None
    return min(max(0.01 * p99 / m, 1.0 - 0.99 * p99 / m, 0.0), 1.0), False


def check_kl_concentrated(rows, window: int) -> Finding | None:
    """Fires when the largest 1% of tokens carry at least CONCENTRATED (0.8) of a low mean KL (with a token
    >= TAIL_MAX nats) in a third of the recent steps. Per-token KL is heavy-tailed in a healthy run (it lives on the
    few tokens the reward depends on, and k3 is large wherever pi << ref): the healthy default GRPO job
    has p99 at 4-32x the mean, so a ratio of tail to mean is no symptom; a KL the top 1% carry is."""
    recent = rows[-window:]
    hits = []
    for r in recent:
        share, m, mx = top1_share(r), r.get("kl_mean"), r.get("kl_max")
        if share is None or not all(isinstance(x, (int, float)) for x in (m, mx)):
            continue
        if abs(m) < KL_LOW_MEAN and mx >= TAIL_MAX and share[0] >= CONCENTRATED:
            hits.append((r, share))
    if len(hits) < max(2, len(recent) // 3):
        return None
    r, (share, exact) = hits[-1]
    ev = (f"in {len(hits)}/{len(recent)} recent steps the largest 1% of tokens carry "
          f"{'' if exact else 'at least '}{CONCENTRATED:.0%} or more of a low mean KL "
          f"(step {r.get('step')}: {share:.0%} of "
          f"mean {r['kl_mean']:.3g}; p99 {r.get('kl_p99', float('nan')):.3g}, max {r['kl_max']:.3g})")
    last = r.get("kl_by_position")
    if isinstance(last, list) and last and max(last) > 3 * (sum(last) / len(last) + 1e-9):
        ev += f"; KL by position peaks in bucket {last.index(max(last))} of {len(last)}"
    return Finding("kl_concentrated", ev,
                   "a few tokens (often late in the response, or special/tool tokens) carry almost all of the "
                   "KL: degenerate text can hide behind a low mean",
                   "look at kl_p99/kl_max and the position heatmap (python -m tools.plot RUN); use the exact "
                   "full-vocabulary KL (kl.exact=true) or a value clamp, and check the response mask")


def check_reward_swings(rows, window: int) -> Finding | None:
    rw = series(rows, "reward_mean")[-window:]
    if len(rw) < 8:
        return None
    diffs = [b - a for a, b in zip(rw, rw[1:])]
    mean_abs_step = sum(abs(d) for d in diffs) / len(diffs)
    trend = abs(rw[-1] - rw[0])
    scale = max(max(rw) - min(rw), 1e-9)
    flips = sum((a > 0) != (b > 0) for a, b in zip(diffs, diffs[1:])) / max(len(diffs) - 1, 1)
    sd, n = series(rows, "reward_std")[-window:], series(rows, "samples")[-window:]
    if sd and n and len(sd) == len(n):
        # swings beyond sampling noise: |difference of two step means| ~ 1.13 * sqrt(2) * SE
        se = sum(s / max(k, 1.0) ** 0.5 for s, k in zip(sd, n)) / len(sd)
        if mean_abs_step < 3 * 1.6 * se:
            return None
    if mean_abs_step > 0.25 * scale and flips > 0.6 and mean_abs_step > 2 * trend / len(diffs):
        return Finding("reward_swings", f"reward moves {mean_abs_step:.3g} per step on average (range "
                                        f"{min(rw):.3g}..{max(rw):.3g}) with the direction flipping in "
                                        f"{flips:.0%} of steps, against a net change of {trend:.3g}",
                       "a noisy or unnormalised reward; too few prompts per step",
                       "set reward.normalize=true (and reward.clip); raise rollout.prompts_per_step")
    return None


def check_collapse(rows) -> Finding | None:
    """The policy collapsed to uniform (entropy >= UNIFORM_FRACTION * ln V, "entropy_max" in the
    record, after a step below HEALTHY_FRACTION * ln V) or learns nothing (grad norm exactly 0 on
    most non-skipped steps)."""
    ents = [(r, r["entropy"], r.get("entropy_max")) for r in rows if isinstance(r.get("entropy"), float)]
    healthy = [i for i, (_, e, m) in enumerate(ents) if m and e < HEALTHY_FRACTION * m]
    uniform = [r for r, e, m in (ents[healthy[0]:] if healthy else []) if e >= UNIFORM_FRACTION * m]
    zero = [r.get("step") for r in rows if r.get("grad_norm") == 0.0 and not r.get("skipped")]
    lr = rows[-1].get("lr")
    if uniform:
        r = uniform[0]
        return Finding("collapse", f"entropy {r['entropy']:.3f} at its maximum ln V = {r['entropy_max']:.3f} from step "
                       f"{r.get('step')} ({len(uniform)} step(s)); grad_norm exactly 0 at steps {zero[:6]}",
                       f"learning rate too high (lr={lr}): one update pushed the policy to the uniform distribution, "
                       "where the gradient vanishes and nothing more is learned",
                       "lower optim.lr by 10x or more and restart from the start checkpoint")
    if len(zero) >= max(3, len(rows) // 2):
        return Finding("collapse", f"grad_norm exactly 0 at {len(zero)} of {len(rows)} steps ({zero[:6]}...)",
                       "no learning signal: rewards flat within every group (all advantages zero), or a collapsed "
                       f"policy (lr={lr} too high?)",
                       "check the reward on the logged responses (reward_std); lower optim.lr")
    return None


def _run_wide(check):
    return lambda rows, window: check(rows)


CHECKS = {f.__name__.removeprefix("check_"): f for f in
          (*symptoms.CHECKS, *symptoms_policy.CHECKS, *symptoms_mismatch.CHECKS, *symptoms_recipes.CHECKS,
           check_kl_concentrated, check_reward_swings)}
CHECKS.update(non_finite=_run_wide(check_non_finite), collapse=_run_wide(check_collapse))
# the most specific (or most urgent) finding first
ORDER = ("non_finite", "collapse", "entropy_max", "ratio_extreme", "rollout_mismatch", "beta_zero", "beta_floor",
         "reward_hacking", "kl_adv_spike", "kl_climbing", "kl_high", "ref_ratio_extreme", "kl_negative",
         "ref_follows_policy", "kl_flat_reward", "reward_swings", "reward_flat_kl_normal", "entropy_collapse",
         "repetition_kl_not_high", "kl_concentrated", "response_length_growing", "response_length_shrinking",
         "seq_clip_high", "groups_short", "groups_saturating", "overlong_high")
# a finding that explains another drops it
SUBSUMES = {"reward_hacking": ("kl_climbing", "kl_high"), "collapse": ("entropy_max",),
            "kl_negative": ("ref_follows_policy", "kl_flat_reward", "reward_flat_kl_normal"),
            "reward_swings": ("reward_flat_kl_normal",)}


def numeric_rows(rows: list[dict]) -> list[dict]:
    """The records with numbers written as strings ("nan", "NaN", "inf", "1e-3") read as floats."""
    out = []
    for r in rows:
        if isinstance(r, dict) and any(isinstance(v, str) for v in r.values()):
            r = {k: (number(v) if isinstance(v, str) and number(v) is not None else v) for k, v in r.items()}
        out.append(r)
    return out


def diagnose(rows: list[dict], window: int = 20) -> list[Finding]:
    """Every finding of CHECKS on `rows` (metrics records in step order), in ORDER, less the subsumed."""
    rows = [r for r in numeric_rows(rows) if isinstance(r, dict)]
    found = {name: CHECKS[name](rows, window) for name in ORDER}
    for name, drops in SUBSUMES.items():
        if found[name] is not None:
            for d in drops:
                found[d] = None
    return [f for f in found.values() if f is not None]


def load_rows(run: str) -> list[dict]:
    path = run if run.endswith(".jsonl") else os.path.join(run, "metrics.jsonl")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON object ({e})") from None
    if not rows:
        raise ValueError(f"{path}: no metrics")
    return last_per_step(numeric_rows(rows))


def last_per_step(rows: list[dict]) -> list[dict]:
    """One record per step, the last one logged (a resumed run may have logged a step twice), in step
    order; records without an integer "step" are kept at the end in file order."""
    by_step, other = {}, []
    for r in rows:
        step = r.get("step") if isinstance(r, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            by_step[step] = r
        else:
            other.append(r)
    return [by_step[k] for k in sorted(by_step)] + other


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.diagnose", description=__doc__.split("\n")[0])
    ap.add_argument("run", help="run folder (with metrics.jsonl) or a metrics.jsonl file")
    ap.add_argument("--window", type=int, default=20, help="recent steps to examine")
    ap.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = ap.parse_args(argv)
    try:
        rows = load_rows(args.run)
    except (OSError, ValueError) as e:
        print(f"tools.diagnose: error: {e}", file=sys.stderr)
        return 2
    found = diagnose(rows, args.window)
    if args.json:
        print(json.dumps([asdict(f) for f in found], indent=2))
        return 0
    if not found:
        print(f"{len(rows)} steps read: no known problem found.")
    for f in found:
        print(f"[{f.name}] {f.evidence}\n  likely: {f.causes}\n  first try: {f.first_try}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
