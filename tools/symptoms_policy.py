"""The KL playbook's symptoms of the penalty's coefficient, the importance ratios, the entropy and the
generated text (docs/kl_playbook.md), registered in `tools.diagnose.diagnose`; the KL and reward ones
are in tools/symptoms.py.

| finding                   | fires when                                                                  |
|---------------------------|-----------------------------------------------------------------------------|
| beta_zero                 | beta is exactly 0 on every step of the window: no KL penalty at all         |
| beta_floor                | beta sits at its floor `beta_min` (logged) on the last FLOOR_STEPS steps after |
|                           | starting above it; in files without `beta_min`: pinned at the run's minimum |
|                           | after falling FLOOR_FALL x or more                                          |
| ratio_extreme             | pi/pi_old (`ratio_min`/`ratio_max`) beyond [1/RATIO_EXTREME, RATIO_EXTREME], or |
|                           | non-finite, on a third of the recent steps (at least 2)                     |
| ref_ratio_extreme         | pi/ref at the sampled tokens (`ref_log_ratio_min`/`_max`) beyond               |
|                           | [1/REF_RATIO_EXTREME, REF_RATIO_EXTREME] on a third of the recent steps     |
| entropy_collapse          | entropy near zero, or fallen below 0.4x within 10 steps                      |
| entropy_max               | entropy >= 0.8 log V on half the recent steps: a blown-up policy            |
| repetition_kl_not_high    | median share of repeated 3-grams >= REPEAT while the KL is below KL_HIGH    |
| response_length_growing   | mean response length of the run's last fifth >= (1 + LENGTH_CHANGE) x its   |
|                           | first fifth's, Z standard errors beyond noise (shrinking: the mirror)       |
"""

from __future__ import annotations

import math
import statistics

from tools.symptoms import KL_HIGH, Finding
from tools.trend import Z, gain, number, series

FLOOR_STEPS = 10  # steps beta must sit at its floor (the band preset holds beta for 10 steps between moves)
FLOOR_FALL = 10.0  # without a logged beta_min: the fall from the run's largest beta that makes a floor
RATIO_EXTREME = 100.0  # pi/pi_old beyond x100 either way: the clipped update has no gradient left there
# pi/ref beyond x1e6 either way at a sampled token: the README's healthy job has a step maximum of log(pi/ref)
# with median 5.4, 90% quantile 8.4 and highest 9.8 over 200 steps (its ratio_min: median 0.46, lowest 0.018)
REF_RATIO_EXTREME = 1e6
REPEAT = 0.3  # share of repeated 3-grams per response (the healthy job's: a few percent)
LENGTH_CHANGE = 0.25  # a change of the mean response length by a quarter over the run
ENTROPY_ZERO = 0.05  # nats per token


def check_beta_zero(rows, window: int) -> Finding | None:
    beta = series(rows, "beta")[-window:]
    if len(beta) < 3 or any(b != 0.0 for b in beta):
        return None
    kl = series(rows, "kl_mean")[-window:]
    kt = f"; the mean KL is {kl[-1]:.3g} nats/token" if kl else ""
    if series(rows, "ds_drop_rate"):  # dynamic sampling: a DAPO run, which drops the penalty by design
        kt += " (algo.recipe=dapo sets beta 0 by design: expected there, the KL then only grows)"
    return Finding("beta_zero", f"beta is exactly 0 on the last {len(beta)} steps: no KL penalty{kt}",
                   "kl_ctl.beta=0 (and kl_ctl.beta_min=0), or a controller that drove it to 0: nothing holds the "
                   "policy near the reference, so the KL only grows",
                   "set kl_ctl.beta > 0 (e.g. 0.02) with kl_ctl.beta_min > 0, or an adaptive preset "
                   "(kl_ctl.preset=ziegler) with a target")


def check_beta_floor(rows, window: int) -> Finding | None:
    beta = series(rows, "beta")
    if len(beta) < FLOOR_STEPS + 2 or beta[-1] <= 0:
        return None
    tail = beta[-FLOOR_STEPS:]
    floors = series(rows, "beta_min")
    if floors:
        floor = floors[-1]
        pinned = floor > 0 and all(b <= floor * (1 + 1e-6) for b in tail) and beta[0] > floor * (1 + 1e-6)
    else:
        floor = min(beta)
        pinned = all(abs(b - floor) <= 1e-9 * floor for b in tail) and max(beta) >= FLOOR_FALL * floor
    if not pinned:
        return None
    kl = series(rows, "kl_mean")[-FLOOR_STEPS:]
    kt = f" while the mean KL is {statistics.median(kl):.3g} nats/token" if kl else ""
    return Finding("beta_floor", f"beta fell from {max(beta):.4g} to its floor {floor:.4g} and has sat there for "
                                 f"the last {len(tail)} steps{kt}",
                   "the adaptive controller keeps lowering beta (the KL is under kl_ctl.target) and the floor stops "
                   "it: the penalty is switched off in all but name, and the reward can be chased freely",
                   "lower kl_ctl.target to the KL you want held, or freeze beta (kl_ctl.mode=fixed); read the "
                   "high-reward samples for hacking")


def _extreme_hits(rows, window, lo_key, hi_key, bound, log_space):
    hits, seen = [], 0
    for r in rows[-window:]:
        lo, hi = number(r.get(lo_key)), number(r.get(hi_key))
        if lo is None or hi is None:
            continue
        seen += 1
        if log_space:
            lo, hi = math.exp(max(min(lo, 700.0), -700.0)), math.exp(max(min(hi, 700.0), -700.0))
        if not (math.isfinite(lo) and math.isfinite(hi)) or hi >= bound or lo <= 1.0 / bound:
            hits.append((r, lo, hi))
    return hits, seen


def check_ratio_extreme(rows, window: int) -> Finding | None:
    hits, seen = _extreme_hits(rows, window, "ratio_min", "ratio_max", RATIO_EXTREME, False)
    if len(hits) < max(2, seen // 3):
        return None
    r, lo, hi = hits[-1]
    return Finding("ratio_extreme", f"pi/pi_old reaches [{lo:.3g}, {hi:.3g}] (step {r.get('step')}) on {len(hits)}"
                                    f"/{seen} recent steps: beyond x{RATIO_EXTREME:g} either way",
                   "the policy moves far within one step's update (learning rate too high, too many epochs over the "
                   "batch, stale old log-probs): where the ratio is clipped (near 0 or huge) the gradient is 0",
                   "lower optim.lr or algo.epochs; check the old log-probs are the sampling policy's; roll back to "
                   "the last good checkpoint")


def check_ref_ratio_extreme(rows, window: int) -> Finding | None:
    hits, seen = _extreme_hits(rows, window, "ref_log_ratio_min", "ref_log_ratio_max", REF_RATIO_EXTREME, True)
    if len(hits) < max(2, seen // 3):
        return None
    r, lo, hi = hits[-1]
    return Finding("ref_ratio_extreme", f"pi/ref at the sampled tokens reaches [{lo:.3g}, {hi:.3g}] (step "
                                        f"{r.get('step')}) on {len(hits)}/{seen} recent steps: beyond "
                                        f"x{REF_RATIO_EXTREME:g} either way",
                   "the policy has left the reference's support on some tokens: importance weights pi/ref (or "
                   "ref/pi) explode, the per-token k3 value and its gradient with them",
                   "raise kl_ctl.beta; a value / log-ratio clamp (kl.value_clamp, kl.log_ratio_clamp); the exact "
                   "KL (kl.exact=true); lower optim.lr")


def check_entropy_collapse(rows, window: int) -> Finding | None:
    ent = series(rows, "entropy")[-window:]
    if not ent:
        return None
    # a run a guard stopped within a few steps is judged too when its entropy is already gone (no noise
    # reaches 0.05 nats/token from a healthy start)
    if len(ent) < 6:
        if len(ent) < 2 or ent[-1] >= ENTROPY_ZERO:
            return None
    last = sum(ent[-3:]) / 3 if len(ent) >= 6 else ent[-1]
    short = ent[-10:]
    fast = len(short) >= 6 and short[0] > 0.2 and last < 0.4 * short[0]
    if not (last < ENTROPY_ZERO or fast):
        return None
    return Finding("entropy_collapse", f"entropy {last:.3g} nats/token (from {short[0]:.3g} {len(short)} steps "
                                       "before)",
                   "the policy turned deterministic: learning rate too high, no entropy bonus, rewards that favour "
                   "one answer, or a low sampling temperature",
                   "loss.entropy_target (e.g. half the start entropy) or loss.entropy_coef; lower optim.lr; "
                   "rollout.temperature=1.0")


def check_entropy_max(rows, window: int) -> Finding | None:
    recent = [(number(r.get("entropy")), number(r.get("entropy_max")), r) for r in rows[-window:]]
    recent = [(e, m, r) for e, m, r in recent if e is not None and m is not None and m > 0 and math.isfinite(e)]
    if len(recent) < 3:
        return None
    hits = [(e, m, r) for e, m, r in recent if e >= 0.8 * m]
    if len(hits) < max(3, len(recent) // 2):
        return None
    e, m, _ = hits[-1]
    return Finding("entropy_max", f"entropy {e:.3g} of at most {m:.3g} nats/token in {len(hits)}/{len(recent)} "
                                  "recent steps: near uniform",
                   "the policy blew up: learning rate far too high, an entropy bonus too large (or an entropy "
                   "target too high), a non-finite step that was not skipped",
                   "lower optim.lr; lower loss.entropy_coef or loss.entropy_target; resume from an earlier "
                   "checkpoint")


def check_repetition_kl_not_high(rows, window: int) -> Finding | None:
    rep, kl = series(rows, "repetition_rate")[-window:], series(rows, "kl_mean")[-window:]
    if len(rep) < 6 or len(kl) < 6:
        return None
    r, k = statistics.median(rep), statistics.median(kl)
    if r < REPEAT or k >= KL_HIGH:
        return None
    return Finding("repetition_kl_not_high", f"{r:.0%} of the responses' 3-grams repeat (median of {len(rep)} "
                                             f"steps) while the mean KL is only {k:.3g} nats/token",
                   "the per-token mean hides a local problem: a few positions (late in the response) repeat; or "
                   "the reference itself repeats (the KL pins the policy to a degenerate start), or sampling is "
                   "too greedy",
                   "look at kl_p99/kl_max and the KL by position (python -m tools.plot RUN); a shorter "
                   "rollout.max_new_tokens; rollout.temperature=1.0; a repetition penalty in the reward")


def _length_change(rows):
    ln = series([r for r in rows if r.get("step") != 0], "response_len")
    if len(ln) < 20:
        return None
    d, se, head, tail = gain(ln, max(5, len(ln) // 5))
    if head <= 0 or abs(d) < LENGTH_CHANGE * head or abs(d) < Z * se:
        return None
    return d, se, head, tail, len(ln)


def check_response_length_growing(rows, window: int) -> Finding | None:
    c = _length_change(rows)
    if c is None or c[0] <= 0:
        return None
    d, se, head, tail, n = c
    return Finding("response_length_growing", f"mean response length {head:.3g} -> {tail:.3g} tokens (first and "
                                              f"last fifth of {n} steps; +{d / head:.0%}, {d / max(se, 1e-12):.0f} "
                                              "standard errors)",
                   "the reward (or a reward model) prefers longer answers, or the KL summed per response favours "
                   "them less than the reward does: length hacking, padding the answer",
                   "read the long samples; a length penalty or a length-normalised reward; loss.agg and kl.where "
                   "consistent (per-token); a smaller rollout.max_new_tokens")


def check_response_length_shrinking(rows, window: int) -> Finding | None:
    c = _length_change(rows)
    if c is None or c[0] >= 0:
        return None
    d, se, head, tail, n = c
    return Finding("response_length_shrinking", f"mean response length {head:.3g} -> {tail:.3g} tokens (first and "
                                                f"last fifth of {n} steps; {d / head:.0%}, "
                                                f"{-d / max(se, 1e-12):.0f} standard errors)",
                   "a per-response KL penalty (kl.where=reward summed over tokens) makes every token cost, so "
                   "shorter answers pay less; or the reward favours terse answers",
                   "put the KL per token (kl.where=loss, loss.agg=token-mean); lower kl_ctl.beta; read the short "
                   "samples")


CHECKS = (check_beta_zero, check_beta_floor, check_ratio_extreme, check_ref_ratio_extreme, check_entropy_collapse,
          check_entropy_max, check_repetition_kl_not_high, check_response_length_growing,
          check_response_length_shrinking)
