"""The RL step: rollout, old/reference log-probs, advantages, clipped updates, KL control.

One `RLTrainer.step()`:
  1. rollout      -- this DP rank's prompts, G samples each (rl/experience/rollout.py), scored
  2. old log-probs -- policy, no grad, through the fused head (+ entropy, + exact KL if asked)
  3. ref log-probs -- the frozen reference's hidden states and head weight, then its log-probs
  4. KL per token  -- exact full-vocabulary KL or a sampled estimator; into the reward (PPO
                      default) or the loss (GRPO default), scaled by the controller's beta
  5. advantages    -- GRPO group-normalised, or GAE over critic values (PPO)
  6. update        -- `algo.epochs` x `algo.mini_batches` optimizer steps; losses normalised by
                      global counts (rl/objectives/losses.py), so the update does not depend on the DP split
  7. control       -- beta update, reference sync, KL guards, metrics
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from core.runtime.metrics import PhaseTimer, peak_memory, reset_peak_memory
from core.runtime.monitor import Monitor
from parallel import comm
from parallel.dims import derive_seed
from parallel.fsdp import set_gradient_sync, sync_replicated_grads
from rl.config import RLConfig
from rl.experience.rollout import Rollout, collect_rollout, evaluate
from rl.health.signals import WindowCorr, loss_term_grad_norms, repetition_rate
from rl.models.reference import ReferenceSync
from rl.objectives.advantages import broadcast_to_tokens, gae, grpo_advantages, kl_shaped_rewards, whiten
from rl.objectives.controller import EntropyController, KLController
from rl.objectives.kl import HEAD_DIRECTION, kl_by_position, kl_from_config, kl_quantiles, masked_mean, sanitize
from rl.objectives.kl_place import future_kl
from rl.objectives.losses import TokenPolicyLoss, aggregate, clipped_value_loss, loss_scale, token_weights
from rl.update.logprobs import (
    TokenStats,
    critic_values,
    logprobs_from_hidden,
    packed_fused_loss,
    packed_token_stats,
    policy_fused_loss,
    policy_token_stats,
    reference_hidden,
)
from rl.update.micro_batches import MicroBatch, by_row_count, by_token_budget
from rl.update.shared_layout import LayoutCost, share_rollout, shared_by_row_count, shared_by_token_budget
from rl.update.update_stats import UpdateStats


def _max_abs(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(torch.where(mask, x.abs(), torch.zeros((), device=x.device)).max()) if mask.any() else 0.0


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


class RLTrainer:
    """One GRPO/PPO run's step on this rank: `step(s)` does, in order,
    1. `make_experience`: rollout (G samples per prompt, scored), old log-probs and entropy (policy, no
       grad), reference log-probs (and hidden states for the exact KL), the per-token KL with padding
       replaced, KL into the reward if asked, advantages (GRPO group-normalised, or GAE over the critic);
    2. `update`: epochs x mini-batches x micro-batches of `_micro_step` (forward through the head with
       the per-token loss, backward), one optimizer step per mini-batch;
    3. control: beta from the measured KL (clock: samples per step), reference sync, KL guards, metrics.
    """

    def __init__(self, cfg: RLConfig, state, policy, reference, optimizer, tokenizer, task, reward_fn,
                 reward_norm, critic=None, critic_optimizer=None, eval_prompts=None):
        """`task`: a prompt source (rl.experience.rollout.TaskPrompts / DataPrompts) or a built-in task; `eval_prompts`:
        the held-out [(ids, meta)] scored every `rollout.eval_every` steps (None: no eval)."""
        self.cfg, self.state = cfg, state
        self.policy, self.ref, self.opt = policy, reference, optimizer
        self.critic, self.critic_opt = critic, critic_optimizer
        self.tok, self.task, self.reward_fn, self.reward_norm = tokenizer, task, reward_fn, reward_norm
        self.controller = KLController(cfg.kl_ctl)
        self.ent_ctl = EntropyController(cfg.loss)
        self.reward_kl = WindowCorr(cfg.monitor.corr_window)
        self.monitor = None
        if state.is_main and (cfg.monitor.tensorboard or cfg.monitor.wandb != "off"):
            self.monitor = Monitor(cfg.train.out_dir, cfg.monitor.tensorboard, cfg.monitor.wandb, asdict(cfg))
        if cfg.kl_ctl.preset and state.is_main:
            print(f"kltron: {cfg.kl_ctl.preset_summary}", flush=True)
        self.ref_sync = ReferenceSync(cfg.reference, cfg.kl_ctl.target)
        # log-probs, entropy and the exact KL (policy and reference alike) are taken over the ids the
        # tokenizer has, the same vocabulary the sampler draws from: a padded embedding's extra rows are
        # never read, so the update is exactly on-policy
        self.vocab = min(policy.cfg.vocab_size, getattr(tokenizer, "vocab_size", None) or policy.cfg.vocab_size)
        self.eval_prompts = eval_prompts or None
        self.tp_group, self.dp_group = state.tp_group, state.dp_group
        self.world_group = None if state.mesh is None else torch.distributed.group.WORLD
        self.layout_cost = LayoutCost.of(policy.cfg)  # the shared-prompt layout's plan (rl/update/shared_layout.py)
        self.timer = PhaseTimer(state.device, memory={"rollout": "rollout", "ref_logprobs": "ref",
                                                      "old_logprobs": "old", "update": "update"})
        self.rollout_stats: dict = {}  # this rank's last generation: rollout_tokens, rollout_s
        if cfg.algo.name == "ppo" and critic is None:
            raise ValueError("algo.name='ppo' needs a critic")

    # -----------------------------------------------------------------------------------------
    # 1-5: experience

    def _token_stats(self, model, ro: Rollout, **kw):
        return policy_token_stats(model, ro.sequences, ro.attention_mask, ro.prompt_len, tp_group=self.tp_group,
                                  vocab_size=self.vocab, temperature=self._temperature,
                                  chunk_size=self.cfg.algo.kl_chunk_size, mask=ro.response_mask, **kw)

    def _fused_loss(self, ro: Rollout, token_loss, **kw):
        return policy_fused_loss(self.policy, ro.sequences, ro.attention_mask, ro.prompt_len, token_loss,
                                 tp_group=self.tp_group, vocab_size=self.vocab, temperature=self._temperature,
                                 chunk_size=self.cfg.algo.kl_chunk_size, mask=ro.response_mask, **kw)

    @property
    def _temperature(self) -> float:
        t = self.cfg.rollout.temperature
        return t if t > 0 else 1.0

    @torch.no_grad()
    def make_experience(self, step: int) -> StepData:
        cfg, st = self.cfg, self.state
        with self.timer("rollout"):
            ro = collect_rollout(self.policy, self.tok, self.task, self.reward_fn, cfg.rollout, seed=cfg.train.seed,
                                 step=step, dp_rank=st.dp_rank, dp_size=st.dims.dp, tp_group=self.tp_group,
                                 dp_group=self.dp_group, device=st.device, world_group=self.world_group,
                                 stats=self.rollout_stats)
        mask = ro.response_mask
        exact = cfg.kl.exact
        # each prompt once (rl/update/shared_layout.py), in the plan the layout cost model prices lowest
        shared = share_rollout(ro, cost=self.layout_cost) if cfg.algo.share_prompts else None
        with self.timer("ref_logprobs"):
            ref_h, ref_w = reference_hidden(self.ref, ro.sequences, ro.attention_mask, ro.prompt_len, packed=shared)
            ref_logp = logprobs_from_hidden(ref_h, ref_w, ro.responses_ids, tp_group=self.tp_group,
                                            vocab_size=self.vocab, temperature=self._temperature,
                                            chunk_size=cfg.algo.kl_chunk_size, mask=mask)
        deferred = self._deferred_rows(ro, step)
        with self.timer("old_logprobs"):
            kl_dir = HEAD_DIRECTION[cfg.kl.direction] if exact else None
            old = self._old_pass(ro, shared, deferred, entropy=True, kl=kl_dir, ref_hidden=ref_h, ref_weight=ref_w)
        # padding is replaced here, once, before anything reaches advantages, losses or the heads
        old_logp, ref_logp = sanitize(old.logprobs, mask), sanitize(ref_logp, mask)
        kl = sanitize(old.kl.float(), mask) if exact else kl_from_config(cfg.kl, old_logp, ref_logp, mask)
        scores = ro.scores
        if self.reward_norm is not None:
            scores = self.reward_norm.normalize_(scores.clone(), self.dp_group)
        data = StepData(ro, mask, old_logp, ref_logp, ref_h if exact else None, ref_w if exact else None,
                        kl, sanitize(old.entropy, mask), advantages=None, deferred=deferred)
        if cfg.algo.name == "grpo":
            if cfg.kl.where == "reward":  # the response's summed KL penalty enters its reward
                scores = scores - self.controller.beta * kl.sum(1)
            adv = grpo_advantages(scores, cfg.rollout.group_size, cfg.algo.adv_std_norm)
            data.advantages = broadcast_to_tokens(adv, mask)
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
        return data

    def _deferred_rows(self, ro: Rollout, step: int) -> torch.Tensor | None:
        """Epoch 0's first mini-batch (local rows), whose old values its on-policy update forward provides
        (`algo.old_from_update`), or None where the old-log-prob pass must compute every row: something
        reads old log-probs before the update (the KL in the reward, grad_ratio's beta), or the option is off."""
        c = self.cfg
        if not c.algo.old_from_update or c.kl.where != "loss" or c.kl_ctl.mode == "grad_ratio" or \
                c.kl.gradient == "sequence":  # its future-KL returns read every row's KL before the update
            return None
        return self._mini_batches(ro.row_ids.cpu(), step, 0)[0]

    def _old_pass(self, ro: Rollout, shared, deferred: torch.Tensor | None, **kw) -> TokenStats:
        """The old-log-prob pass (policy, no grad) over every local row but `deferred`: TokenStats [B, N],
        0 on the deferred rows (filled in by the update). With every row deferred (one mini-batch) no
        forward runs, on every rank alike (the same count of rows is deferred on each)."""
        if deferred is None:
            return self._token_stats(self.policy, ro, packed=shared, **kw)
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
            return self._token_stats(self.policy, ro, packed=packed, **kw)
        # padded (or no row with a response token): the kept rows' own forward, scattered back
        mb = MicroBatch(rows, ro.prompt_len, N)
        rh = kw.pop("ref_hidden")
        out = self._token_stats(self.policy, mb.rollout(ro), ref_hidden=mb.row_tokens(rh), **kw)

        def back(t):
            if t is None:
                return None
            full = t.new_zeros((B, N) + tuple(t.shape[2:]))
            full[rows] = t
            return full
        return TokenStats(*(back(t) for t in out))

    def _fill_deferred(self, data: StepData, mb: MicroBatch, cur: TokenStats, mask: torch.Tensor) -> None:
        """Write an on-policy micro-batch's own values (its tokens' log-probs, entropy, exact KL: what
        the old-log-prob pass would have computed, up to float rounding order) into the step's data."""
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
        if self.cfg.kl.exact:
            put(data.kl, cur.kl.float())

    # -----------------------------------------------------------------------------------------
    # 6: update

    def _mini_batches(self, row_ids: torch.Tensor, step: int, epoch: int) -> list[torch.Tensor]:
        """Local row indices of each mini-batch. The split depends only on global row ids, so it is
        the same whatever the DP layout, and every rank gets the same number of rows per
        mini-batch (no rank waits in an FSDP collective for another): within each prompt's group
        the samples are shuffled (keyed by seed, step, epoch, prompt), then global position p goes
        to mini-batch p mod n. `algo.group_mini_batches`: whole prompt groups instead, global prompt
        id mod n (each rank's prompts are contiguous, so each gets the same count when n divides them)."""
        n, G = self.cfg.algo.mini_batches, self.cfg.rollout.group_size
        if n == 1:
            return [torch.arange(row_ids.numel(), device=self.state.device)]
        if row_ids.numel() % n:
            raise ValueError(f"algo.mini_batches={n} must divide the {row_ids.numel()} rows each DP rank holds")
        if self.cfg.algo.group_mini_batches:  # whole prompt groups: global prompt id mod n
            if (row_ids.numel() // G) % n:
                raise ValueError(f"algo.group_mini_batches: algo.mini_batches={n} must divide the "
                                 f"{row_ids.numel() // G} prompts each DP rank holds")
            mb = (row_ids // G) % n
            return [torch.nonzero(mb == k).flatten().to(self.state.device) for k in range(n)]
        pos, perms = [], {}
        for rid in row_ids.tolist():
            prompt, j = divmod(rid, G)
            if prompt not in perms:  # one permutation per prompt, not per row
                # the key as first defined (runs stay bit-compatible with earlier ones); it repeats once prompts
                # reach 131 per step or epochs 61
                key = derive_seed(self.cfg.train.seed, step * 7919 + epoch * 131 + prompt)
                perms[prompt] = torch.randperm(G, generator=torch.Generator().manual_seed(key), device="cpu").tolist()
            pos.append(prompt * G + perms[prompt][j])
        mb = torch.tensor(pos, device="cpu") % n
        return [torch.nonzero(mb == k).flatten().to(self.state.device) for k in range(n)]

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
        """Step 6, the policy (and critic) update on this step's rollouts, in order:

        for each of `algo.epochs` epochs,
          for each mini-batch (rows split by global row id, so the same for any DP layout):
            a. the mini-batch's global valid-token and sequence counts (one all-reduce): the loss scale
            b. for each micro-batch (`_micro_batches`: by rows, or by a token budget, trimmed or packed,
               the same count on every DP rank), `_micro_step`: forward through the head with the per-token loss,
               backward (FSDP gradient sync on the last micro-batch only), statistics
            c. replicated gradients summed over DP, optimizer step (policy, then critic)
          then stop early once the epoch's approx KL(old||new) exceeds `algo.early_stop_kl`.
        Returns the statistics reduced over micro-batches and DP ranks (see `_UpdateStats`)."""
        cfg = self.cfg
        acc, opt_stats, stop_early = UpdateStats(), [], False
        for epoch in range(cfg.algo.epochs):
            for mb, rows in enumerate(self._mini_batches(data.ro.row_ids.cpu(), step, epoch)):
                micros = self._micro_batches(data, rows)
                scale = loss_scale(data.mask[rows], self.dp_group)
                acc.start_mini_batch()
                for i, r in enumerate(micros):
                    # the first mini-batch after the rollout is on-policy: its old policy IS the current one
                    acc.add(self._micro_step(data, r, scale, on_policy=epoch == 0 and mb == 0,
                                             last=i == len(micros) - 1))
                sync_replicated_grads(self.policy, self.dp_group)
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
        out = acc.summary(self.dp_group)
        out.update(grad_norm=opt_stats[-1].grad_norm, lr=opt_stats[-1].lr,
                   skipped=sum(int(s.skipped) for s in opt_stats), skipped_total=opt_stats[-1].skipped_total,
                   early_stopped=stop_early, optimizer_steps=len(opt_stats))
        return out

    def _micro_step(self, data: StepData, mb: MicroBatch, scale, on_policy: bool, last: bool) -> dict:
        """Forward, loss and backward of micro-batch `mb` (padded rows, or one packed sequence); returns
        its statistics.

        One per-token loss (`TokenPolicyLoss`) serves both paths: with `algo.fused_loss` the fused head
        calls it chunk by chunk and forms the gradient in its forward; otherwise the head returns
        log-probs with grad and the loss is called once on all tokens. Either way the statistics
        come from what the loss recorded while it ran, not from a second evaluation. On-policy
        (first mini-batch), the old log-probs are the current ones, detached (ratio exactly 1);
        `drift` is how far they were from the rollout's, a float-noise check."""
        cfg = self.cfg
        set_gradient_sync(self.policy, last)
        mask, tok = mb.mask(data.mask), mb.tokens
        exact = cfg.kl.exact and cfg.kl.in_loss
        fill = on_policy and data.deferred is not None  # this micro-batch's old values come from here
        kw = dict(kl=HEAD_DIRECTION[cfg.kl.direction] if exact else None,
                  ref_hidden=tok(data.ref_hidden) if exact else None, ref_weight=data.ref_weight if exact else None,
                  entropy=self.ent_ctl.coef != 0.0 or fill)
        weights = tok(token_weights(data.mask, cfg.loss.agg, scale, cfg.loss.norm_len))  # per row: split-invariant
        fn = TokenPolicyLoss(cfg.loss, weights, mask, tok(data.old_logp), tok(data.advantages), kl_cfg=cfg.kl,
                             beta=self.controller.beta, ref_logp=tok(data.ref_logp), on_policy=on_policy,
                             entropy_coef=self.ent_ctl.coef, kl_future=self._kl_future(data, tok))
        loss, cur = self._policy_loss(data.ro, mb, mask, fn, kw)
        loss.backward()
        stats = fn.stats()
        stats["drift"] = _max_abs(cur.logprobs.detach() - tok(data.old_logp), mask) if on_policy and not fill else 0.0
        if fill:
            self._fill_deferred(data, mb, cur, mask)
        if self.critic is not None:
            self._critic_backward(data, mb, scale, last)
        return stats

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
            kw = dict(kw, tp_group=self.tp_group, vocab_size=self.vocab, temperature=self._temperature,
                      chunk_size=self.cfg.algo.kl_chunk_size, mask=mask)
            if fused:
                return packed_fused_loss(self.policy, mb.packed, fn, **kw)
            cur = packed_token_stats(self.policy, mb.packed, **kw)
        else:
            sub = mb.rollout(ro)
            if fused:
                return self._fused_loss(sub, fn, **kw)
            cur = self._token_stats(self.policy, sub, **kw)
        flat = lambda t: None if t is None else t.reshape(-1)
        return fn(flat(cur.logprobs), flat(cur.entropy), flat(cur.kl), slice(None)).sum(), cur

    def _critic_backward(self, data: StepData, mb: MicroBatch, scale, last: bool) -> None:
        set_gradient_sync(self.critic, last)
        sub = mb.rollout(data.ro)  # padded rows (trimmed) even when the policy's are packed
        values = critic_values(self.critic, sub.sequences, sub.attention_mask, sub.prompt_len)
        vloss, _ = clipped_value_loss(values, mb.row_tokens(data.old_values), mb.row_tokens(data.returns),
                                      sub.response_mask, self.cfg.critic.value_clip)
        aggregate(vloss, sub.response_mask, "token-mean", scale).backward()

    # -----------------------------------------------------------------------------------------
    # 7: one whole step

    def evaluate(self, step: int) -> dict:
        """The held-out eval (rl.experience.rollout.evaluate) when it is due before `step` ({} otherwise): every
        `rollout.eval_every` steps and before the run's last step."""
        ro, st = self.cfg.rollout, self.state
        due = ro.eval_every and (step % ro.eval_every == 0 or step == self.cfg.train.steps - 1)
        if not self.eval_prompts or not due:
            return {}
        with self.timer("eval"):
            return evaluate(self.policy, self.tok, self.eval_prompts, self.reward_fn, ro, seed=self.cfg.train.seed,
                            step=step, dp_rank=st.dp_rank, dp_size=st.dims.dp, tp_group=self.tp_group,
                            dp_group=self.dp_group, device=st.device, world_group=self.world_group)

    def step(self, step: int) -> dict:
        cfg = self.cfg
        reset_peak_memory(self.state.device)
        evals = self.evaluate(step)  # the policy before this step's update, outside the step's clock
        t0 = time.perf_counter()
        data = self.make_experience(step)
        grads = self._balance_beta(data)
        ent_coef = self.ent_ctl.coef
        with self.timer("update"):
            upd = self.update(data, step)
        mask, dpg = data.mask, self.dp_group
        kl_mean = float(masked_mean(data.kl, mask, dp_group=dpg))
        beta = self.controller.beta
        # Ziegler et al.'s clock: the KL was measured on this many samples (global); horizon is in samples
        new_beta = self.controller.update(kl_mean, n_samples=cfg.rollout.prompts_per_step * cfg.rollout.group_size)
        synced = self.ref_sync.maybe_sync(step, kl_mean, self.policy, self.ref, self.opt)
        q = kl_quantiles(data.kl, mask, dp_group=dpg)
        pos_mean, _ = kl_by_position(data.kl, mask, n_buckets=min(8, cfg.rollout.max_new_tokens),
                                     max_len=cfg.rollout.max_new_tokens, dp_group=dpg)
        scores = data.ro.scores.double()  # float64: sums of squares of large (bounded) rewards stay finite
        stats = torch.stack([scores.sum(), (scores ** 2).sum(), scores.new_tensor(float(scores.numel())),
                             mask.sum().double(), data.advantages.abs().sum().double()])
        comm.all_reduce(stats, "sum", dpg)  # reward sums, counts and tokens over DP for global means
        n = stats[2].item()
        r_mean = stats[0].item() / n
        r_std = max(stats[1].item() / n - r_mean ** 2, 0.0) ** 0.5
        tokens = stats[3].item()
        elapsed = time.perf_counter() - t0
        times = self.timer.pop()
        entropy = float(masked_mean(data.entropy, mask, dp_group=dpg))
        self.ent_ctl.update(entropy)
        rec = {"step": step, "reward_mean": r_mean, "reward_std": r_std, "kl_mean": kl_mean,
               "kl_p50": q["p50"], "kl_p90": q["p90"], "kl_p99": q["p99"], "kl_max": q["max"],
               "kl_top1_share": q["top1_share"],
               "kl_by_position": [float(x) for x in pos_mean], "beta": beta, "beta_next": new_beta,
               "entropy": entropy, "entropy_max": math.log(self.vocab), "entropy_coef": ent_coef, **grads,
               "repetition_rate": repetition_rate(data.ro.responses_ids, mask, 3, dpg),
               "clipfrac": upd.get("clipfrac", 0.0), "ratio_mean": upd.get("ratio_mean", 1.0),
               "ratio_min": upd.get("ratio_min", 1.0), "ratio_max": upd.get("ratio_max", 1.0),
               "approx_kl_old": upd.get("approx_kl_old", 0.0), "pg_loss": upd.get("pg_loss", 0.0),
               "kl_loss": upd.get("kl_loss", 0.0), "adv_abs_mean": stats[4].item() / max(tokens, 1.0),
               "grad_norm": upd["grad_norm"], "lr": upd["lr"], "skipped": upd["skipped"],
               "skipped_total": upd["skipped_total"], "early_stopped": upd["early_stopped"],
               "samples": int(n), "response_len": tokens / n, "tokens_per_s": tokens / max(elapsed, 1e-9),
               # response tokens of every DP rank over this rank's generation time (the ranks decode in step)
               "rollout_tokens_per_s": tokens / max(self.rollout_stats.get("rollout_s", 0.0), 1e-9),
               "logp_drift": upd["logp_drift"], "ref_synced": synced, "step_time_s": elapsed,
               **times, **peak_memory(self.state.device)}
        if "critic_grad_norm" in upd:
            rec["critic_grad_norm"] = upd["critic_grad_norm"]
        rec.update(evals)
        corr = self.reward_kl.add(r_mean, kl_mean)
        if corr is not None:
            rec["reward_kl_corr"] = corr
        g = cfg.guard  # limits on the mean KL per response token; None: off
        rec["kl_warning"] = g.kl_warn_per_token is not None and kl_mean > g.kl_warn_per_token
        if g.kl_stop_per_token is not None and kl_mean > g.kl_stop_per_token:
            rec["kl_stop"] = True
        if self.monitor is not None:
            self.monitor.log(rec, step)
        return rec

    def _balance_beta(self, data: StepData) -> dict:
        """kl_ctl.mode=grad_ratio: beta for this step's update from the two loss terms' gradient norms
        (global over DP, rl/health/signals.py); returns them as metrics ({} in other modes)."""
        if self.cfg.kl_ctl.mode != "grad_ratio":
            return {}
        g_pg, g_kl = loss_term_grad_norms(self.cfg.loss, self.cfg.kl, data.old_logp, data.ref_logp, data.advantages,
                                          data.mask, self.dp_group)
        self.controller.set_from_grad_norms(g_pg, g_kl)
        return {"pg_grad_norm": g_pg, "kl_grad_norm": g_kl}
