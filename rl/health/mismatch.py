"""The rollout-vs-training mismatch of one step: how far the log-probs the sampler recorded are from
the trainer's old-log-prob pass (the first policy forward over the rollouts, before any update).

With d = log pi_rollout(y) - log pi_train(y) at each response token y (both tempered, full
vocabulary: `StepData.rollout_logprobs` and `StepData.old_logp`), global over DP:

  rollout_logp_diff_max / _mean  max and mean |d|
  rollout_ratio_out_share        share of tokens whose ratio pi_train / pi_rollout = exp(-d) is outside
                                 [RATIO_BAND_LOW, RATIO_BAND_HIGH] = [0.9, 1.1] (verl #6280, TRL #6789)
  token_mult_prob_error          mean of exp(|d|): NeMo-RL's metric (nemo_rl/algorithms/loss_functions.py,
                                 ClippedPGLossFn: masked mean of exp(|generation_logprobs - prev_logprobs|));
                                 1 when the two agree, 1.01 is a 1% probability error on the average token
  rollout_kl_mean/_p50/_p99/_max exact full-vocabulary KL(rollout || train) per token, from the rollout's
                                 hidden states through the policy head (`rollout.record_hidden`); the rows
                                 `algo.old_from_update` defers get theirs from the update's first forward
  sampler_trunc_kl               mean of log mu(y) - log pi_T(y) = -log(kept mass): the exact KL(mu || pi_T)
                                 per position of the top-k / top-p / min-p truncation (0 without one)
"""

from __future__ import annotations

import torch

from parallel import comm
from rl.objectives.kl import kl_quantiles, masked_mean

RATIO_BAND_LOW, RATIO_BAND_HIGH = 0.9, 1.1


def logp_mismatch(rollout_logp: torch.Tensor, train_logp: torch.Tensor, mask: torch.Tensor,
                  dp_group=None) -> dict[str, float]:
    """The |d| statistics above of rollout_logp, train_logp [B, N] over `mask` [B, N] (bool), every DP rank's
    tokens: max, mean, share outside the ratio band, token_mult_prob_error. No token anywhere: 0, 0, 0, 1."""
    m = mask.bool()
    d = torch.where(m, (rollout_logp.double() - train_logp.double()).abs(), torch.zeros((), dtype=torch.float64,
                                                                                          device=mask.device))
    ratio = torch.exp(-(rollout_logp.double() - train_logp.double()))
    out = (ratio < RATIO_BAND_LOW) | (ratio > RATIO_BAND_HIGH)
    sums = torch.stack([d.sum(), (out & m).sum().double(), torch.where(m, d.exp(), 0.0).sum(), m.sum().double()])
    mx = d.max().reshape(1) if d.numel() else torch.zeros(1, dtype=torch.float64, device=mask.device)
    sums, mx = sums.to(comm.collective_device(dp_group)), mx.to(comm.collective_device(dp_group))
    comm.all_reduce(sums, "sum", dp_group)  # |d| sum, tokens outside the band, exp|d| sum, tokens: over DP
    comm.all_reduce(mx, "max", dp_group)  # the largest |d| of every rank
    n = float(sums[3])
    if n == 0:
        return {"rollout_logp_diff_max": 0.0, "rollout_logp_diff_mean": 0.0, "rollout_ratio_out_share": 0.0,
                "token_mult_prob_error": 1.0}
    return {"rollout_logp_diff_max": float(mx[0]), "rollout_logp_diff_mean": float(sums[0]) / n,
            "rollout_ratio_out_share": float(sums[1]) / n, "token_mult_prob_error": float(sums[2]) / n}


def mismatch_metrics(data, dp_group=None) -> dict[str, float]:
    """The step's mismatch metrics (module docstring) from `data` (rl/update/step_data.py's StepData); {} when
    the rollout recorded no log-probs."""
    if data.rollout_logprobs is None:
        return {}
    mask = data.mask.bool()
    out = logp_mismatch(data.rollout_logprobs, data.old_logp, mask, dp_group)
    if data.rollout_sampled_logprobs is not None:
        gap = data.rollout_sampled_logprobs - data.rollout_logprobs
        out["sampler_trunc_kl"] = float(masked_mean(gap, mask, dp_group=dp_group))
    if data.rollout_kl is not None:
        q = kl_quantiles(data.rollout_kl, mask, qs=(0.5, 0.99), dp_group=dp_group)
        out.update(rollout_kl_mean=float(masked_mean(data.rollout_kl, mask, dp_group=dp_group)),
                   rollout_kl_p50=q["p50"], rollout_kl_p99=q["p99"], rollout_kl_max=q["max"])
    return out
