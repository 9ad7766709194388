"""Distillation's entries in a step's metrics record (global over DP)."""

from __future__ import annotations

from rl.objectives.kl import masked_mean


def distill_metrics(cfg, data, upd: dict, step: int, dp_group) -> dict:
    """distill_k1: mean over response tokens of log s - log t at the sampled tokens (the old policy's),
    an unbiased sampled estimate of the per-token reverse KL(student || teacher); distill_loss: the term's
    weighted sum of the per-token divergence (distill.loss; token-mean aggregation: its mean per token)
    before the weight, averaged over mini-batches; distill_coef: the weight this step."""
    k1 = float(masked_mean(data.old_logp.float() - data.teacher_logp, data.mask, dp_group=dp_group))
    return {"distill_k1": k1, "distill_loss": upd.get("distill_loss", 0.0),
            "distill_coef": cfg.distill.coef_at(step)}
