"""The rollout-vs-training mismatch detector of `tools.diagnose` (docs/kl_playbook.md, troubleshooting):

| finding            | symptom                                                                         |
|--------------------|---------------------------------------------------------------------------------|
| rollout_mismatch   | on a third of the recent steps (at least 2) that log it: more than OUT_SHARE of |
|                    | the response tokens have pi_train/pi_rollout outside [0.9, 1.1], or              |
|                    | token_mult_prob_error above MULT_ERROR, or the exact KL(rollout || train) above  |
|                    | KL_MEAN nats/token on average                                                    |

The band: kltron's own rollout and trainer agree to float rounding (the default job: ratio-band share 0,
token_mult_prob_error - 1 below 7e-4 in bf16 and 5e-7 in fp32, docs/benchmarks.md); the peers' bf16 stacks put 5-10%
of tokens outside [0.9, 1.1] (verl #6280, TRL #6789), and NeMo-RL's tests hold token_mult_prob_error under 1.05.
"""

from __future__ import annotations

from tools.symptoms import Finding
from tools.trend import number

OUT_SHARE = 0.01  # share of response tokens whose ratio pi_train / pi_rollout leaves [0.9, 1.1]
MULT_ERROR = 1.02  # NeMo-RL's token_mult_prob_error: mean exp(|log pi_rollout - log pi_train|)
KL_MEAN = 1e-3  # nats per token: mean exact KL(rollout || train)


def _over(r: dict) -> list[str]:
    """The band limits record `r` exceeds, as text ([] within the band or not logged)."""
    out = []
    share, mult, kl = (number(r.get(k)) for k in ("rollout_ratio_out_share", "token_mult_prob_error",
                                                  "rollout_kl_mean"))
    if share is not None and share > OUT_SHARE:
        out.append(f"{share:.1%} of tokens outside [0.9, 1.1]")
    if mult is not None and mult > MULT_ERROR:
        out.append(f"token_mult_prob_error {mult:.4g}")
    if kl is not None and kl > KL_MEAN:
        out.append(f"KL(rollout || train) {kl:.3g} nats/token")
    return out


def check_rollout_mismatch(rows, window: int) -> Finding | None:
    recent = [r for r in rows[-window:] if number(r.get("token_mult_prob_error")) is not None]
    hits = [(r, o) for r in recent if (o := _over(r))]
    if len(hits) < max(2, len(recent) // 3):
        return None
    r, over = hits[-1]
    diff = number(r.get("rollout_logp_diff_max"))
    dt = f"; max |log pi_rollout - log pi_train| {diff:.3g}" if diff is not None else ""
    return Finding("rollout_mismatch", f"the rollout's log-probs leave the trainer's on {len(hits)}/{len(recent)} "
                                       f"recent steps (step {r.get('step')}: {', '.join(over)}{dt})",
                   "the sampler draws from another distribution than the trainer scores: a low-precision rollout "
                   "head or KV cache, a different kernel or batch shape (not batch-invariant), stale weights in "
                   "the rollout; the update is then off-policy by that much and ratios and KL estimates are biased",
                   "compare parallel.mixed_precision=fp32 on a few steps (the mismatch should vanish); check the "
                   "rollout uses the weights of the last update; keep loss.clip_low/high wide enough for the "
                   "measured ratio spread")


CHECKS = (check_rollout_mismatch,)
