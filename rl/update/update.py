"""The policy (and critic) update on one step's rollouts (step 6 of rl/trainer.py's step).

`PolicyUpdate.update(data, step)`:

for each of `algo.epochs` epochs,
  for each mini-batch (rows split by global row id, so the same for any DP layout: rl/update/mini_batches.py):
    a. the mini-batch's global valid-token and sequence counts (one all-reduce): the loss scale
    b. for each micro-batch (`_micro_batches`: by rows, or by a token budget, trimmed or packed, the same
       count on every DP rank), `_micro_step`: forward through the head with the per-token loss, backward
       (FSDP gradient sync on the last micro-batch only), statistics; the critic's value loss, backward
    c. replicated gradients summed over DP, optimizer step (policy, then critic)
  then stop early once the epoch's approx KL(old||new) exceeds `algo.early_stop_kl`.
"""

from __future__ import annotations

import torch

from parallel.fsdp import set_gradient_sync, sync_replicated_grads
from rl.config import RLConfig
from rl.experience.rollout import Rollout
from rl.objectives.controller import EntropyController, KLController
from rl.objectives.kl import HEAD_DIRECTION, kl_from_config
from rl.objectives.kl_place import future_kl
from rl.objectives.losses import aggregate, clipped_value_loss, loss_scale, token_weights
from rl.objectives.off_policy import LossInputs, correction_metrics, loss_inputs
from rl.objectives.policy_objectives import make_token_loss, sequence_ids
from rl.update.distill_term import DistillTap, needs_tap
from rl.update.logprobs import PolicyHeads, critic_values, packed_fused_loss, packed_token_stats
from rl.update.micro_batches import MicroBatch, by_row_count, by_token_budget
from rl.update.mini_batches import mini_batches
from rl.update.shared_layout import LayoutCost, shared_by_row_count, shared_by_token_budget
from rl.update.step_data import StepData, fill_deferred
from rl.update.update_stats import UpdateStats


def _max_abs(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(torch.where(mask, x.abs(), torch.zeros((), device=x.device)).max()) if mask.any() else 0.0


class PolicyUpdate:
    """Step 6 for one run: the models, optimizers and controllers it reads, passed in. `controller.beta`
    and `ent_ctl.coef` are read when each micro-batch's loss is built."""

    def __init__(self, cfg: RLConfig, *, policy, optimizer, critic, critic_optimizer, controller: KLController,
                 ent_ctl: EntropyController, heads: PolicyHeads, layout_cost: LayoutCost, dp_group, device,
                 grad_group=None):
        self.cfg, self.policy, self.opt = cfg, policy, optimizer
        # gradients sum over dp, or dp x cp under context parallelism (each cp rank: its tokens' part)
        self.grad_group = dp_group if grad_group is None else grad_group
        self.critic, self.critic_opt = critic, critic_optimizer
        self.controller, self.ent_ctl, self.heads = controller, ent_ctl, heads
        self.layout_cost, self.dp_group, self.device = layout_cost, dp_group, device

    def _micro_batches(self, data: StepData, rows: torch.Tensor) -> list[MicroBatch]:
        """Mini-batch `rows` as micro-batches: `algo.micro_batch_size` rows each, or by the token budget
        `algo.micro_batch_tokens` (trimmed or packed; the same count on every DP rank): rl/update/micro_batches.py;
        with `algo.share_prompts` either in the shared-prompt layout: rl/update/shared_layout.py."""
        a = self.cfg.algo
        if a.share_prompts and a.micro_batch_tokens:
            return shared_by_token_budget(data.ro, rows, a.micro_batch_tokens, self.dp_group, self.layout_cost)
        if a.share_prompts:
            return shared_by_row_count(data.ro, rows, a.micro_batch_size, self.layout_cost)
        if not a.micro_batch_tokens:
            return by_row_count(data.ro, rows, a.micro_batch_size)
        return by_token_budget(data.ro, rows, a.micro_batch_tokens, a.pack_sequences, self.dp_group)

    def update(self, data: StepData, step: int) -> dict:
        """The update (module docstring). Returns the statistics reduced over micro-batches and DP ranks
        (rl/update/update_stats.py), with the optimizer's."""
        cfg = self.cfg
        self.distill_coef = cfg.distill.coef_at(step)  # the distillation term's weight this step (rl/distill)
        acc, opt_stats, stop_early = UpdateStats(), [], False
        off = loss_inputs(cfg, data, self.dp_group)  # the clip's anchor, c_t, the KL weight (objectives/off_policy.py)
        for epoch in range(cfg.algo.epochs):
            for mb, rows in enumerate(mini_batches(cfg, data.ro.row_ids.cpu(), step, epoch, self.device)):
                micros = self._micro_batches(data, rows)
                scale = loss_scale(data.mask[rows], self.dp_group)
                acc.start_mini_batch()
                for i, r in enumerate(micros):
                    # the first mini-batch after the rollout is on-policy: its old policy IS the current one
                    acc.add(self._micro_step(data, r, scale, on_policy=epoch == 0 and mb == 0,
                                             last=i == len(micros) - 1, off=off))
                sync_replicated_grads(self.policy, self.grad_group)
                opt_stats.append(self.opt.step())
                if self.critic is not None:
                    sync_replicated_grads(self.critic, self.dp_group)
                    acc.critic_norms.append(self.critic_opt.step().grad_norm)
            if cfg.algo.early_stop_kl is not None and epoch < cfg.algo.epochs - 1:
                if acc.epoch_approx_kl(self.dp_group) > cfg.algo.early_stop_kl:
                    stop_early = True
                    break
        if data.deferred is not None and not cfg.kl.exact:  # the sampled KL of the filled-in rows
            data.kl = kl_from_config(cfg.kl, data.old_logp, data.ref_logp, data.mask)
        if off.deferred_weights is not None:  # every row's pi_old is known now: the correction's metrics
            off.metrics.update(correction_metrics(cfg, data, self.dp_group))
        out = acc.summary(self.dp_group)
        out.update(grad_norm=opt_stats[-1].grad_norm, lr=opt_stats[-1].lr,
                   skipped=sum(int(s.skipped) for s in opt_stats), skipped_total=opt_stats[-1].skipped_total,
                   early_stopped=stop_early, optimizer_steps=len(opt_stats), **off.metrics)
        return out

    def _micro_step(self, data: StepData, mb: MicroBatch, scale, on_policy: bool, last: bool,
                    off: LossInputs | None = None) -> dict:
        """Forward, loss and backward of micro-batch `mb` (padded rows, or one packed sequence); returns
        its statistics.

        One per-token loss (`TokenPolicyLoss`, or loss.policy's: rl/objectives/policy_objectives.py) serves
        both paths: with `algo.fused_loss` the fused head calls it chunk by chunk and forms the gradient in its
        forward; otherwise the head returns log-probs with grad and the loss is called once on all tokens.
        Either way the statistics come from what the loss recorded while it ran, not from a second evaluation. On-policy
        (first mini-batch), the old log-probs are the current ones, detached (ratio exactly 1);
        `drift` is how far they were from the rollout's, a float-noise check. `off`: the three policies' part of
        the loss (rl/objectives/off_policy.py's `loss_inputs`; None: today's synchronous objective)."""
        cfg = self.cfg
        off = off or LossInputs(data.old_logp, None, None, True, {})
        set_gradient_sync(self.policy, last)
        mask, tok = mb.mask(data.mask), mb.tokens
        exact = cfg.kl.exact and cfg.kl.in_loss
        fill = on_policy and data.deferred is not None  # this micro-batch's old values come from here
        kw = dict(kl=HEAD_DIRECTION[cfg.kl.direction] if exact else None,
                  ref_hidden=tok(data.ref_hidden) if exact else None, ref_weight=data.ref_weight if exact else None,
                  entropy=self.ent_ctl.coef != 0.0 or fill)
        if fill and data.rollout_kl is not None and data.ro.rollout_hidden is not None:  # the deferred rows' mismatch
            kw["rollout_hidden"] = tok(data.ro.rollout_hidden)
        weights = tok(token_weights(data.mask, cfg.loss.agg, scale, cfg.loss.norm_len))  # per row: split-invariant
        fn = make_token_loss(cfg.loss, weights, mask, tok(off.old_logp), tok(data.advantages), kl_cfg=cfg.kl,
                             beta=self.controller.beta, ref_logp=tok(data.ref_logp),
                             on_policy=on_policy and off.on_policy_ok, entropy_coef=self.ent_ctl.coef,
                             kl_future=self._kl_future(data, tok), is_weights=tok(off.weights), kl_old=tok(off.kl_old),
                             is_weight_fn=off.deferred_weights if fill else None,
                             **sequence_ids(cfg.loss, data.mask, tok))
        tap, head_fn = self._distill_tap(data, tok, weights), fn
        if tap is not None:  # the distillation term on the same forward's hidden states: inside the policy's
            head_fn = tap.fuse_into(kw, fn, exact_kl_used=cfg.kl.exact)  # head: in its KL slot, else as a
            if head_fn is None:  # chunk term of the loss-inside head; without that head beside it
                head_fn = fn
                if cfg.algo.fused_loss:
                    tap.in_head(kw)
                else:
                    kw["tap"] = tap
        loss, cur = self._policy_loss(data.ro, mb, mask, head_fn, kw)
        if tap is not None and tap.loss is not None:
            loss = loss + tap.loss
        loss.backward()
        stats = fn.stats()
        if tap is not None:
            stats["distill_loss"] = tap.value
        stats["drift"] = _max_abs(cur.logprobs.detach() - tok(data.old_logp), mask) if on_policy and not fill else 0.0
        if fill:
            fill_deferred(data, mb, cur, mask, cfg.kl.exact)
        if self.critic is not None:
            self._critic_backward(data, mb, scale, last)
        return stats

    def _distill_tap(self, data: StepData, tok, weights) -> DistillTap | None:
        """This micro-batch's distillation term (rl/distill/term.py), or None (no teacher, the sampled
        baseline, whose term is in the advantages, or a weight of 0 this step)."""
        c = self.cfg
        if data.teacher_hidden is None or not needs_tap(c.distill) or getattr(self, "distill_coef", 0.0) == 0.0:
            return None
        topk = None if data.teacher_topk is None else tuple(tok(x) for x in data.teacher_topk)
        return DistillTap(c.distill, teacher_hidden=tok(data.teacher_hidden), teacher_weight=data.teacher_weight,
                          topk=topk, weights=weights, coef=self.distill_coef, tp_group=self.heads.tp_group,
                          vocab_size=self.heads.vocab_size, temperature=self.heads.temperature,
                          teacher_temperature=c.teacher.temperature, chunk_size=self.heads.chunk_size)

    def _kl_future(self, data: StepData, tok):
        """kl.gradient=sequence in the loss: each token's future KL (rl/objectives/kl_place.py), this micro-batch's
        tokens."""
        k = self.cfg.kl
        if k.where != "loss" or k.gradient != "sequence" or self.controller.beta == 0.0:
            return None
        return tok(future_kl(data.kl, data.mask))

    def _policy_loss(self, ro: Rollout, mb: MicroBatch, mask, fn, kw):
        """(loss, TokenStats) of `mb` through the fused loss head, or through the head's log-probs then `fn`."""
        fused = self.cfg.algo.fused_loss
        if mb.packed is not None:
            kw = dict(kw, **self.heads.settings(), mask=mask)
            if fused:
                return packed_fused_loss(self.policy, mb.packed, fn, **kw)
            cur = packed_token_stats(self.policy, mb.packed, **kw)
        else:
            sub = mb.rollout(ro)
            if fused:
                return self.heads.fused_loss(self.policy, sub, fn, **kw)
            cur = self.heads.token_stats(self.policy, sub, **kw)
        flat = lambda t: None if t is None else t.reshape(-1)
        if getattr(fn, "needs_logprobs", False):  # a sequence-level ratio: every token's log-prob first
            fn.prepare(flat(cur.logprobs).detach())
        return fn(flat(cur.logprobs), flat(cur.entropy), flat(cur.kl), slice(None)).sum(), cur

    def _critic_backward(self, data: StepData, mb: MicroBatch, scale, last: bool) -> None:
        set_gradient_sync(self.critic, last)
        sub = mb.rollout(data.ro)  # padded rows (trimmed) even when the policy's are packed
        values = critic_values(self.critic, sub.sequences, sub.attention_mask, sub.prompt_len)
        vloss, _ = clipped_value_loss(values, mb.row_tokens(data.old_values), mb.row_tokens(data.returns),
                                      sub.response_mask, self.cfg.critic.value_clip)
        aggregate(vloss, sub.response_mask, "token-mean", scale).backward()
