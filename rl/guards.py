"""Guards on a training step's record beyond the KL limits (`guard.kl_warn` / `guard.kl_stop`, in
`rl.train._report`): collapse of the policy, named with its likely cause.

`collapse_findings(rec, lr)` looks at one step's metrics record (the `RLTrainer.step` record plus
"entropy_max" = ln V, added by `rl.train`) and returns (stop, messages):

| symptom                                                   | verdict | likely cause                        |
|-----------------------------------------------------------|---------|-------------------------------------|
| entropy, KL, loss or grad norm not finite                 | stop    | learning rate too high, overflow    |
| entropy >= 98% of ln V (the policy is uniform: collapsed) | stop    | learning rate too high              |
| grad_norm exactly 0 on a step that was not skipped        | warn    | zero advantages (flat rewards), lr  |
| entropy below 1e-4 nats (the policy is deterministic)     | warn    | entropy collapse, lr, no KL penalty |
| reward flat at exactly 0 over the whole batch             | warn    | task too hard, reward plug-in       |

Every rank computes the same verdict from the same (all-reduced) record, so a stop is agreed.
"""

from __future__ import annotations

import math
import sys

UNIFORM_FRACTION = 0.98
ENTROPY_FLOOR = 1e-4


class Preempted(Exception):
    """The run stopped on SIGTERM / SIGUSR1 after writing its checkpoint (see core.lifecycle)."""


def collapse_findings(rec: dict, lr: float) -> tuple[bool, list[str]]:
    """(stop?, messages) for one step record; see the module table."""
    msgs, stop = [], False
    ent, ent_max = rec.get("entropy"), rec.get("entropy_max")
    bad = [k for k in ("entropy", "kl_mean", "grad_norm", "pg_loss", "reward_mean")
           if isinstance(rec.get(k), float) and not math.isfinite(rec[k])]
    if bad:
        stop = True
        msgs.append(f"{', '.join(bad)} not finite: the weights diverged; learning rate too high? (optim.lr={lr:g})")
    if ent_max and isinstance(ent, float) and math.isfinite(ent) and ent >= UNIFORM_FRACTION * ent_max:
        stop = True
        msgs.append(f"entropy {ent:.3f} is at its maximum ln V = {ent_max:.3f}: the policy collapsed to uniform; "
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


def check_collapse(rec: dict, cfg, is_main: bool) -> str | None:
    """Warn (rank 0, stderr) on every finding; the stop message when the step shows a collapse."""
    step = rec.get("step")
    stop, msgs = collapse_findings(rec, cfg.optim.lr)
    if is_main:
        for m in msgs:
            print(f"kltron: step {step}: {m}", file=sys.stderr)
    if stop:
        return (f"kltron: step {step}: stopping after this checkpoint: {msgs[0]} "
                "(see python -m tools.diagnose)")
    return None
