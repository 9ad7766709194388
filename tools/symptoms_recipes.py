"""tools.diagnose's checks of the metrics the algorithm recipes add (rl/recipes.py, docs/recipes.md):

| finding            | symptom                                                                              |
|--------------------|--------------------------------------------------------------------------------------|
| groups_saturating  | dynamic sampling drops a rising share of prompt groups (rewards all equal), now most |
| groups_short       | dynamic sampling hit its max rounds and filled the batch with zero-signal groups     |
| seq_clip_high      | GSPO clips most responses' sequence ratio: no gradient in off-policy mini-batches    |
| overlong_high      | many responses run to rollout.max_new_tokens without a stop                          |

Each reads keys only the recipe's runs log (ds_drop_rate, ds_filled, seq_clipfrac, overlong_rate), so other runs
are never flagged. Trends are judged with their standard errors (tools/trend.py).
"""

from __future__ import annotations

from tools.symptoms import Finding
from tools.trend import Z, gain, series

DROP_HIGH = 0.5  # most groups carry no signal: half the rollout is thrown away (the tiny task's: 0.19 -> 0.28)
SEQ_CLIP_HIGH = 0.5  # share of responses clipped (recipes_tiny's GSPO: 0.31 over steps 180-199)
OVERLONG_HIGH = 0.1  # share of responses truncated


def check_groups_saturating(rows, window: int) -> Finding | None:
    drop = series(rows, "ds_drop_rate")
    if len(drop) < 2 * 10:
        return None
    part = min(window, len(drop) // 2)
    g, se, head, tail = gain(drop, part)
    if not (tail >= DROP_HIGH and g > Z * se):
        return None
    extra = series(rows, "ds_extra_rollout_s")[-part:]
    cost = f"; {sum(extra) / len(extra):.3g} s of extra rollout per step" if extra else ""
    return Finding("groups_saturating", f"dynamic sampling's drop rate rose from {head:.2f} to {tail:.2f} (+{g:.2f}, "
                                        f"{g / se if se else float('inf'):.1f} standard errors){cost}",
                   "the task saturates for this policy: most prompts' G samples are all right (or all wrong), so "
                   "their groups carry no advantage and each step samples extra rounds to fill the batch",
                   "harder or fresh prompts (a curriculum), a larger rollout.group_size, or stop: the reward has "
                   "little left to teach")


def check_groups_short(rows, window: int) -> Finding | None:
    filled = series(rows, "ds_filled")[-window:]
    if not filled or sum(filled) == 0:
        return None
    n = sum(1 for f in filled if f > 0)
    return Finding("groups_short", f"{n} of the last {len(filled)} steps filled {int(sum(filled))} prompt groups "
                                   "with zero-signal ones (algo.dynamic_sampling_max_rounds reached)",
                   "too few prompts with mixed rewards within the allowed extra rounds: the batch is diluted, as "
                   "without dynamic sampling",
                   "raise algo.dynamic_sampling_max_rounds, or rollout.group_size; harder prompts if the drop rate is "
                   "high")


def check_seq_clip_high(rows, window: int) -> Finding | None:
    sc = series(rows, "seq_clipfrac")[-window:]
    if len(sc) < 5:
        return None
    mean = sum(sc) / len(sc)
    if mean < SEQ_CLIP_HIGH:
        return None
    return Finding("seq_clip_high", f"GSPO clipped {mean:.0%} of responses' sequence ratios over the last {len(sc)} "
                                    "steps",
                   "the policy drifts from pi_old faster than loss.clip_low/clip_high allow (the paper's 3e-4 / 4e-4 "
                   "suit its learning rate and mini-batch count): most off-policy mini-batches give no gradient",
                   "fewer algo.mini_batches or algo.epochs, a lower optim.lr, or a wider clip (e.g. loss.clip_low="
                   "1e-3 loss.clip_high=2e-3)")


def check_overlong_high(rows, window: int) -> Finding | None:
    ov = series(rows, "overlong_rate")[-window:]
    if len(ov) < 5:
        return None
    mean = sum(ov) / len(ov)
    if mean < OVERLONG_HIGH:
        return None
    return Finding("overlong_high", f"{mean:.0%} of responses ran to rollout.max_new_tokens without a stop over the "
                                    f"last {len(ov)} steps",
                   "the generation budget is too short for the task, or the policy rambles (with algo.overlong_filter "
                   "those responses do not train at all)",
                   "raise rollout.max_new_tokens; keep algo.overlong_buffer's soft punishment to pull lengths back")


CHECKS = (check_groups_saturating, check_groups_short, check_seq_clip_high, check_overlong_high)
