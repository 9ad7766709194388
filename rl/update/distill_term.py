"""The distillation term of one micro-batch, computed inside the policy's head call from the same
hidden states the policy loss reads (so the model runs once): `DistillTap` is handed to the fused
heads as `tap=` (rl/update/logprobs.py) and called with the response hidden states [M, H_s] (already
copied to tp), the local head weight and the flat token mask; it keeps

    loss = coef * sum_t weights_t * D_t,

D_t the per-token divergence to the teacher (parallel/distill_head.py: exact over the full vocabulary;
or parallel/distill_topk.py's top-k cross-entropy), weights_t the policy loss's token weights (the
aggregation of `loss.agg`, so the term is normalised like the policy loss and the same for any
micro-batch or DP split). The update adds `loss` to the policy loss before the backward.

`fuse_into`: where the policy's head computes no exact reference KL (kl.exact=false) and the term is a KL
(reverse_kl / forward_kl), the teacher takes the reference's place in the policy's own fused head (`kl=`,
ref_hidden, ref_weight) and the term joins the per-token loss there: one pass over the vocabulary, one
weight-gradient buffer, the memory of GRPO's exact-KL step. `in_head`: JSD, top-k and any term beside an
exact reference KL join the same loss-inside head as a chunk term (parallel/distill_chunk.py): the term's
gradient with respect to the student's logits is added to the policy's in each chunk, so again one pass over
the student's vocabulary and one weight-gradient buffer (the teacher's logits are the second matmul, as the
reference's are in GRPO's exact KL). Only without the loss-inside head (algo.fused_loss=false) the term is
a second head call on the same hidden states (`__call__`), with its own weight-gradient buffer.
"""

from __future__ import annotations

import torch

from parallel.distill_chunk import DistillChunkTerm
from parallel.distill_head import distill_divergence
from parallel.distill_topk import topk_cross_entropy
from rl.distill.config import FULL_VOCAB, DistillConfig


class DistillTap:
    """The term of one micro-batch; the update either fuses it into the policy's head (`fuse_into`) or
    passes it as the head's `tap`."""

    def __init__(self, cfg: DistillConfig, *, teacher_hidden, teacher_weight, topk, weights, coef: float,
                 tp_group, vocab_size: int, temperature: float, teacher_temperature: float, chunk_size):
        self.cfg, self.th, self.tw, self.topk = cfg, teacher_hidden, teacher_weight, topk
        self.weights, self.coef = weights, coef
        self.kw = dict(vocab_size=vocab_size, temperature=temperature, chunk_size=chunk_size)
        self.tp_group, self.t_temp = tp_group, teacher_temperature
        self.loss: torch.Tensor | None = None
        self._value = 0.0  # sum_t weights_t * D_t, detached: the metric
        self.inner = None  # the policy's per-token loss, when fused
        self.term: DistillChunkTerm | None = None  # the chunk term, when in the head (`in_head`)

    @property
    def value(self) -> float:
        """sum_t weights_t * D_t of this micro-batch (detached): the metric."""
        if self.term is not None and self.term.values is not None:
            return float((self.weights.reshape(-1).to(self.term.values.dtype) * self.term.values).sum())
        return self._value

    def in_head(self, kw: dict) -> None:
        """Hand the term to the policy's loss-inside head as its `extra` (module docstring)."""
        th = self.th.reshape(-1, self.th.shape[-1]).detach()
        if self.t_temp != self.kw["temperature"]:  # the head divides both sides by the student's temperature
            th = th * (self.kw["temperature"] / self.t_temp)
        topk = None
        if self.cfg.loss not in FULL_VOCAB:
            ids, probs = self.topk
            topk = (ids.reshape(-1, ids.shape[-1]), probs.reshape(-1, probs.shape[-1]))
        self.term = DistillChunkTerm(self.cfg.loss, self.weights.reshape(-1), th, self.tw, topk=topk,
                                     beta=self.cfg.beta, coef=self.coef)
        kw["extra"] = self.term

    def fuse_into(self, kw: dict, token_loss, exact_kl_used: bool):
        """Route the teacher through the policy head's KL slot and return the per-token loss that adds the
        term to `token_loss`'s; None (kw untouched) where the slot is taken or the term is no KL."""
        if exact_kl_used or kw.get("kl") is not None or self.cfg.loss not in ("reverse_kl", "forward_kl"):
            return None
        if getattr(token_loss, "needs_logprobs", False):  # a sequence-level ratio (GSPO) prepares the loss first
            return None
        th = self.th.detach()
        if self.t_temp != self.kw["temperature"]:  # the head divides both sides by the student's temperature
            th = th * (self.kw["temperature"] / self.t_temp)
        # parallel/fused.py's "forward" is KL(policy || reference): here KL(student || teacher)
        kw.update(kl="forward" if self.cfg.loss == "reverse_kl" else "reverse", ref_hidden=th, ref_weight=self.tw)
        self.inner = token_loss
        return self._fused_token_loss

    def _fused_token_loss(self, logp, entropy, kl, tokens):
        base = self.inner(logp, entropy, None, tokens)
        m = self.inner.m[tokens]
        w = self.inner.w[tokens].to(kl.dtype)
        d = torch.where(m, w * kl, kl.new_zeros(()))  # masked positions hold 0 already; never multiplied
        self._value += float(d.detach().sum())
        return base + self.coef * d.to(base.dtype)

    def __call__(self, h: torch.Tensor, w: torch.Tensor, mask: torch.Tensor | None) -> None:
        M = h.shape[0]
        if self.cfg.loss in FULL_VOCAB:
            d = distill_divergence(h, w, self.th.reshape(M, -1), self.tw, self.tp_group, kind=self.cfg.loss,
                                   beta=self.cfg.beta, teacher_temperature=self.t_temp, mask=mask, **self.kw)
        else:  # topk_forward_kl: the teacher's top-k, taken before the update
            ids, probs = self.topk
            d = topk_cross_entropy(h, w, ids.reshape(M, -1), probs.reshape(M, -1), self.tp_group, mask=mask,
                                   **self.kw)
        wd = (self.weights.reshape(M).to(d.dtype) * d).sum()
        self._value = float(wd.detach())
        self.loss = self.coef * wd


def needs_tap(cfg: DistillConfig) -> bool:
    """Does the loss read the teacher's head inside the update (every loss but the sampled estimator)?"""
    return cfg.loss != "sampled_reverse_kl"
