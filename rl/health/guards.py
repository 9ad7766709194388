"""Guards on a training step's record beyond the per-token KL limits (`guard.kl_warn_per_token` /
`guard.kl_stop_per_token`, in `rl.train._report`): collapse of the policy, named with its likely cause.

`collapse_findings(rec, lr)` looks at one step's metrics record (the `RLTrainer.step` record plus
"entropy_max" = ln V, added by the trainer) and returns (stop, messages):

| symptom                                                   | verdict | likely cause                        |
|-----------------------------------------------------------|---------|-------------------------------------|
| entropy, KL, loss or (unskipped) grad norm not finite      | stop    | learning rate too high, overflow    |
| entropy >= 98% of ln V after it was below 90% in this run | stop    | learning rate too high              |
| (the policy collapsed to uniform; a barely trained start checkpoint is near ln V from step 0 on) |
| grad_norm exactly 0 on a step that was not skipped        | warn    | zero advantages (flat rewards), lr  |
| entropy below 1e-4 nats (the policy is deterministic)     | warn    | entropy collapse, lr, no KL penalty |
| reward flat at exactly 0 over the whole batch             | warn    | task too hard, reward plug-in       |

Every rank computes the same verdict from the same (all-reduced) record, so a stop is agreed.
`CollapseGuard` keeps the run's lowest entropy (the baseline) and warns of each kind once per run.
"""

from __future__ import annotations

import math
import sys

from core.runtime.lifecycle import Preempted  # noqa: F401 - re-exported for rl.train

UNIFORM_FRACTION = 0.98
HEALTHY_FRACTION = 0.9
ENTROPY_FLOOR = 1e-4


def collapse_findings(rec: dict, lr: float, baseline: float | None = None) -> tuple[bool, list[str]]:
    """(stop?, messages) for one step record; `baseline`: the lowest entropy seen earlier in the
    run (None: no earlier step). See the module table."""
    msgs, stop = [], False
    ent, ent_max = rec.get("entropy"), rec.get("entropy_max")
    keys = ("entropy", "kl_mean", "pg_loss", "reward_mean") + (() if rec.get("skipped") else ("grad_norm",))
    bad = [k for k in keys if isinstance(rec.get(k), float) and not math.isfinite(rec[k])]  # a skipped step is fine
    if bad:
        stop = True
        msgs.append(f"{', '.join(bad)} not finite: the weights diverged; learning rate too high? (optim.lr={lr:g})")
    was_healthy = baseline is not None and ent_max and baseline < HEALTHY_FRACTION * ent_max
    if was_healthy and isinstance(ent, float) and math.isfinite(ent) and ent >= UNIFORM_FRACTION * ent_max:
        stop = True
        msgs.append(f"entropy {ent:.3f} is at its maximum ln V = {ent_max:.3f} (it was {baseline:.3f}): the policy "
                    f"collapsed to uniform; "
                    f"learning rate too high? (optim.lr={lr:g})")
    if rec.get("grad_norm") == 0.0 and not rec.get("skipped"):
        msgs.append("grad_norm is exactly 0: nothing was learned this step (all advantages zero? rewards flat "
                    "within every group, or a collapsed policy)")
    if isinstance(ent, float) and 0 <= ent < ENTROPY_FLOOR:
        msgs.append(f"entropy {ent:.2e} is near zero: the policy became deterministic (entropy collapse; "
                    "learning rate too high, or too weak a KL penalty?)")
    if rec.get("reward_mean") == 0.0 and rec.get("reward_std") == 0.0:
        msgs.append("every reward of the batch is exactly 0: no learning signal (task too hard for the start "
                    "checkpoint, or a reward plug-in that always returns 0?)")
    return stop, msgs


class CollapseGuard:
    """`check(rec)` per step: warnings on rank 0 (each kind once per run), the stop message on a collapse."""

    def __init__(self, lr: float, is_main: bool):
        self.lr, self.is_main = lr, is_main
        self.baseline: float | None = None
        self.warned: set[str] = set()

    def check(self, rec: dict) -> str | None:
        step = rec.get("step")
        stop, msgs = collapse_findings(rec, self.lr, self.baseline)
        ent = rec.get("entropy")
        if isinstance(ent, float) and math.isfinite(ent):
            self.baseline = ent if self.baseline is None else min(self.baseline, ent)
        for m in msgs:
            kind = m.split(" ")[0]
            if self.is_main and (stop or kind not in self.warned):
                print(f"kltron: step {step}: {m}", file=sys.stderr)
            self.warned.add(kind)
        if stop:
            return (f"kltron: step {step}: stopping after this checkpoint: {msgs[0]} "
                    "(see python -m tools.diagnose)")
        return None
