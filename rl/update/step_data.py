"""What the update needs of one step's rollouts on this rank (steps 2-5 of rl/trainer.py's step).

`ExperienceMaker.make_experience(ro, step)` turns a scored rollout into `StepData`, in order:
  2. ref log-probs -- the frozen reference's hidden states and head weight, then its log-probs
  3. old log-probs -- policy, no grad, through the fused head (+ entropy, + exact KL if asked), over
                      every row but the deferred ones (below)
  4. KL per token  -- exact full-vocabulary KL or a sampled estimator, padding replaced once; into the
                      reward when `kl.where=reward`, scaled by the controller's beta. With a truncated
                      sampler (top-k / top-p / min-p) the samples come from mu, not pi, so a sampled
                      estimator misreads KL(pi||ref): the old pass then also computes the exact KL,
                      which the controller and guards read (`kl_for_control`)
  5. advantages    -- GRPO group-normalised, or GAE over critic values (PPO)

Deferred rows (`algo.old_from_update`): epoch 0's first mini-batch is on-policy, so its update forward
computes the very log-probs, entropy (and exact KL) the old pass would; the old pass skips those rows
and the update writes them in (`fill_deferred`), with the exact KL(rollout || train) of those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.runtime.metrics import PhaseTimer
from rl.config import RLConfig
from rl.experience.rollout import Rollout
from rl.objectives.advantages import gae, kl_shaped_rewards, outcome_advantages, whiten
from rl.objectives.controller import KLController
from rl.objectives.kl import HEAD_DIRECTION, kl_from_config, sanitize
from rl.objectives.off_policy import TOKEN_LEVEL
from rl.update.distill_step import distill_advantages, teacher_pass
from rl.update.logprobs import (
    PolicyHeads,
    TokenStats,
    critic_values,
    logprobs_from_hidden,
    reference_hidden,
    stats_from_hidden,
)
from rl.update.micro_batches import MicroBatch
from rl.update.mini_batches import mini_batches
from rl.update.shared_layout import LayoutCost, share_rollout


@dataclass
class StepData:
    """Everything the update needs for one step's rollouts on this rank. Tensors [B, N] unless noted."""

    ro: Rollout
    mask: torch.Tensor  # response mask (bool)
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    ref_hidden: torch.Tensor | None  # [B, N, H] when the exact KL is used
    ref_weight: torch.Tensor | None  # [Vp/tp, H]
    kl: torch.Tensor  # per-token KL (no grad), the metric and the reward-shaping term
    entropy: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor | None = None  # PPO
    old_values: torch.Tensor | None = None  # PPO
    # local rows of epoch 0's first mini-batch whose old log-probs, entropy (and exact KL) its on-policy update
    # forward fills in (`algo.old_from_update`); None: the old-log-prob pass computed every row
    deferred: torch.Tensor | None = None
    # the rollout's recorded log-probs (rl/experience/rollout.py), aligned with old_logp, 0 off the mask:
    # log pi_T (tempered, full vocabulary: what old_logp estimates) and log mu (what was drawn from)
    rollout_logprobs: torch.Tensor | None = None
    rollout_sampled_logprobs: torch.Tensor | None = None
    # exact KL(rollout || train) per token: the old pass's, the deferred rows' from the update's first forward
    rollout_kl: torch.Tensor | None = None
    kl_exact_metric: torch.Tensor | None = None  # exact KL(pi||ref) when `kl` is a sampled estimate off mu
    # the weights' version that drew each row [B] (int) and the version the update starts from: staleness =
    # current_version - policy_version (rl/update/staleness.py); None: a synchronous step (staleness 0)
    policy_version: torch.Tensor | None = None
    current_version: int | None = None
    # distillation (rl/distill): the teacher's hidden states [B, N, H_t] and head weight [Vp/tp, H_t]; its
    # top-k (ids, probs) [B, N, k] for distill.loss=topk_forward_kl; log t(sampled token) [B, N]
    teacher_hidden: torch.Tensor | None = None
    teacher_weight: torch.Tensor | None = None
    teacher_topk: tuple | None = None
    teacher_logp: torch.Tensor | None = None

    @property
    def kl_for_control(self) -> torch.Tensor:
        """The per-token KL the controller, the reference sync and the guards read: the exact KL
        where the sampler truncates and `kl` is a sampled estimate (its samples come from mu, not pi)."""
        return self.kl if self.kl_exact_metric is None else self.kl_exact_metric


def defers_old_rows(c: RLConfig, has_teacher: bool = False) -> bool:
    """Whether epoch 0's first mini-batch takes its old values from its own on-policy update forward
    (`algo.old_from_update`), so the old-log-prob pass skips those rows. Not where something reads old
    log-probs before the update: the KL in the reward, grad_ratio's beta, kl.gradient=sequence's future-KL
    returns, a correction that weighs a row by all its tokens' pi_old (seq_tis, geo_rs), the controller's exact
    KL under a truncating sampler, the sampled distillation baseline's advantages."""
    if not c.algo.old_from_update or c.kl.where != "loss" or c.kl_ctl.mode == "grad_ratio" or \
            c.kl.gradient == "sequence":
        return False
    if c.algo.off_policy.correction not in ("none", *TOKEN_LEVEL):
        return False
    if truncates(c) and not c.kl.exact:  # the exact KL the controller reads comes from the old pass
        return False
    return not (has_teacher and c.distill.loss == "sampled_reverse_kl")


def truncates(cfg: RLConfig) -> bool:
    """Does the rollout sample from a truncated distribution mu != pi (top-k, top-p or min-p on)?"""
    r = cfg.rollout
    return r.temperature > 0 and (r.top_k > 0 or r.top_p < 1.0 or r.min_p > 0.0)


class ExperienceMaker:
    """Steps 2-5 for one run: the models and controllers they read, passed in."""

    def __init__(self, cfg: RLConfig, *, policy, reference, critic, reward_norm, controller: KLController,
                 heads: PolicyHeads, layout_cost: LayoutCost, timer: PhaseTimer, dp_group, device, teacher=None):
        self.cfg, self.policy, self.ref, self.critic = cfg, policy, reference, critic
        self.teacher = teacher  # the distillation teacher (rl/distill), or None
        self.reward_norm, self.controller, self.heads = reward_norm, controller, heads
        self.layout_cost, self.timer, self.dp_group, self.device = layout_cost, timer, dp_group, device

    @torch.no_grad()
    def make_experience(self, ro: Rollout, step: int) -> StepData:
        cfg = self.cfg
        mask = ro.response_mask
        exact = cfg.kl.exact
        # each prompt once (rl/update/shared_layout.py), in the plan the layout cost model prices lowest
        shared = share_rollout(ro, cost=self.layout_cost) if cfg.algo.share_prompts else None
        with self.timer("ref_logprobs"):
            ref_h, ref_w = reference_hidden(self.ref, ro.sequences, ro.attention_mask, ro.prompt_len, packed=shared)
            ref_logp = logprobs_from_hidden(ref_h, ref_w, ro.responses_ids, **self.heads.settings(), mask=mask,
                                            invariant=getattr(self.ref, "batch_invariant", False))
        deferred = self._deferred_rows(ro, step)
        with self.timer("old_logprobs"):
            kl_dir = HEAD_DIRECTION[cfg.kl.direction] if exact or truncates(cfg) else None
            old = self._old_pass(ro, shared, deferred, entropy=True, kl=kl_dir, ref_hidden=ref_h, ref_weight=ref_w,
                                 rollout_hidden=ro.rollout_hidden)
        # padding is replaced here, once, before anything reaches advantages, losses or the heads
        old_logp, ref_logp = sanitize(old.logprobs, mask), sanitize(ref_logp, mask)
        kl = sanitize(old.kl.float(), mask) if exact else kl_from_config(cfg.kl, old_logp, ref_logp, mask)
        scores = ro.scores
        if self.reward_norm is not None:
            scores = self.reward_norm.normalize_(scores.clone(), self.dp_group)
        opt = lambda t: None if t is None else sanitize(t.float(), mask)
        rollout_kl = opt(old.rollout_kl)
        if rollout_kl is None and ro.rollout_hidden is not None:  # every row deferred: the update fills it in
            rollout_kl = torch.zeros_like(old_logp, dtype=torch.float32)
        data = StepData(ro, mask, old_logp, ref_logp, ref_h if exact else None, ref_w if exact else None,
                        kl, sanitize(old.entropy, mask), advantages=None, deferred=deferred,
                        rollout_logprobs=opt(ro.rollout_logprobs),
                        rollout_sampled_logprobs=opt(ro.rollout_sampled_logprobs), rollout_kl=rollout_kl,
                        kl_exact_metric=sanitize(old.kl.float(), mask) if kl_dir and not exact else None)
        if self.teacher is not None:
            with self.timer("teacher"):
                teacher_pass(data, self.teacher, cfg, self.heads, shared,
                             (ref_h, ref_w) if self.teacher is self.ref else None)
        if cfg.algo.name == "distill":  # no reward: the distillation term, or the sampled estimator's advantage
            data.advantages = distill_advantages(data, cfg.distill, step)
        elif cfg.algo.name == "grpo":  # critic-free: algo.advantage (rl/objectives/advantages.py)
            data.advantages = outcome_advantages(cfg.algo.advantage, scores, mask, cfg.rollout.group_size,
                                                 std_norm=cfg.algo.adv_std_norm, kl=kl, beta=self.controller.beta,
                                                 kl_in_reward=cfg.kl.where == "reward", dp_group=self.dp_group)
        else:
            with self.timer("critic_values"):
                values = critic_values(self.critic, ro.sequences, ro.attention_mask, ro.prompt_len)
            beta = self.controller.beta if cfg.kl.where == "reward" else 0.0
            valid = mask.any(1)
            rewards = torch.zeros_like(kl)
            if valid.any():  # an empty response has no token to carry its score
                rewards[valid] = kl_shaped_rewards(scores[valid], kl[valid], mask[valid], beta)
            adv, ret = gae(rewards, values, mask.float(), cfg.algo.gamma, cfg.algo.lam)
            if cfg.algo.whiten_advantages:
                adv = whiten(adv, mask, self.dp_group)
            data.advantages, data.returns, data.old_values = adv, ret, values
        if cfg.algo.name != "distill" and data.teacher_hidden is not None:  # RL + the sampled baseline's term
            data.advantages = data.advantages + distill_advantages(data, cfg.distill, step)
        return data

    def _deferred_rows(self, ro: Rollout, step: int) -> torch.Tensor | None:
        """Epoch 0's first mini-batch (local rows), whose old values its on-policy update forward provides
        (`defers_old_rows`), or None where the old-log-prob pass must compute every row."""
        if not defers_old_rows(self.cfg, self.teacher is not None):
            return None
        return mini_batches(self.cfg, ro.row_ids.cpu(), step, 0, self.device)[0]

    def _old_pass(self, ro: Rollout, shared, deferred: torch.Tensor | None, **kw) -> TokenStats:
        """The old-log-prob pass (policy, no grad) over every local row but `deferred`: TokenStats [B, N],
        0 on the deferred rows (filled in by the update). With every row deferred (one mini-batch) no
        forward runs, on every rank alike (the same count of rows is deferred on each)."""
        if getattr(self.policy, "batch_invariant", False) and ro.rollout_hidden is not None:
            return self._old_from_rollout(ro, deferred, **kw)
        if deferred is None:
            return self.heads.token_stats(self.policy, ro, packed=shared, **kw)
        B, N = ro.response_mask.shape
        keep = torch.ones(B, dtype=torch.bool, device=ro.response_mask.device)
        keep[deferred] = False
        rows = torch.nonzero(keep).flatten()
        if rows.numel() == 0:
            dt = torch.promote_types(next(self.policy.parameters()).dtype, torch.float32)
            zero = torch.zeros(B, N, dtype=dt, device=ro.response_mask.device)
            return TokenStats(zero, zero if kw["entropy"] else None, zero if kw["kl"] else None)
        packed = share_rollout(ro, rows, self.layout_cost) if self.cfg.algo.share_prompts else None
        if packed is not None:  # the head's [1, M] values land on their rows, 0 elsewhere
            return self.heads.token_stats(self.policy, ro, packed=packed, **kw)
        # padded (or no row with a response token): the kept rows' own forward, scattered back
        mb = MicroBatch(rows, ro.prompt_len, N)
        rh, xh = kw.pop("ref_hidden"), kw.pop("rollout_hidden")
        out = self.heads.token_stats(self.policy, mb.rollout(ro), ref_hidden=mb.row_tokens(rh),
                                     rollout_hidden=None if xh is None else mb.row_tokens(xh), **kw)

        def back(t):
            if t is None:
                return None
            full = t.new_zeros((B, N) + tuple(t.shape[2:]))
            full[rows] = t
            return full
        return TokenStats(*(back(t) for t in out))


    def _old_from_rollout(self, ro: Rollout, deferred: torch.Tensor | None, *, rollout_hidden, **kw) -> TokenStats:
        """The old-log-prob pass without its forward: in batch-invariant mode the rollout's recorded final
        hidden states are bit for bit the ones a forward of the policy that sampled would give, so the
        head alone on them gives the old log-probs, entropy and exact KL (0 on the `deferred` rows, which
        the update fills as usual). The rollout-vs-training KL of these rows is 0 by construction; the
        deferred rows measure it against the update's own forward."""
        mask = ro.response_mask.clone()
        if deferred is not None:
            mask[deferred] = False
        out = stats_from_hidden(self.policy, ro.rollout_hidden, ro.responses_ids, **self.heads.settings(),
                                mask=mask, **kw)
        return out._replace(rollout_kl=torch.zeros(mask.shape, dtype=torch.float32, device=mask.device))


def fill_deferred(data: StepData, mb: MicroBatch, cur: TokenStats, mask: torch.Tensor, exact: bool) -> None:
    """Write an on-policy micro-batch's own values (its tokens' log-probs, entropy, exact KL (`exact`): what
    the old-log-prob pass would have computed, up to float rounding order) into the step's data;
    `mask`: the micro-batch's response mask, as `cur`'s tensors are laid out."""
    if mb.filler:
        return

    def put(full: torch.Tensor, vals: torch.Tensor) -> None:
        vals = sanitize(vals.detach().to(full.dtype), mask)
        if mb.packed is not None:
            full[mb.packed.src_rows, mb.packed.src_cols] = vals.reshape(-1)
        else:
            full[mb.rows, :mb.response_cols] = vals
    put(data.old_logp, cur.logprobs)
    put(data.entropy, cur.entropy)
    if exact:
        put(data.kl, cur.kl.float())
    if data.rollout_kl is not None and cur.rollout_kl is not None:
        put(data.rollout_kl, cur.rollout_kl.float())
