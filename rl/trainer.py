"""The RL step: rollout, old/reference log-probs, advantages, clipped updates, KL control.

One `RLTrainer.step()`:
  1. rollout      -- this DP rank's prompts, G samples each (rl/rollout.py), scored
  2. old log-probs -- policy, no grad, through the fused head (+ entropy, + exact KL if asked)
  3. ref log-probs -- the frozen reference's hidden states and head weight, then its log-probs
  4. KL per token  -- exact full-vocabulary KL or a sampled estimator; into the reward (PPO
                      default) or the loss (GRPO default), scaled by the controller's beta
  5. advantages    -- GRPO group-normalised, or GAE over critic values (PPO)
  6. update        -- `algo.epochs` x `algo.mini_batches` optimizer steps; losses normalised by
                      global counts (rl/losses.py), so the update does not depend on the DP split
  7. control       -- beta update, reference sync, KL guards, metrics
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from core.metrics import PhaseTimer, peak_memory, reset_peak_memory
from parallel import comm
from parallel.fsdp import set_gradient_sync, sync_replicated_grads
from rl.advantages import broadcast_to_tokens, gae, grpo_advantages, kl_shaped_rewards, whiten
from rl.config import RLConfig
from rl.controller import KLController
from rl.kl import kl_by_position, kl_from_config, kl_quantiles, masked_mean
from rl.logprobs import critic_values, policy_token_stats, reference_hidden
from rl.losses import clipped_value_loss, loss_scale, policy_loss
from rl.reference import ReferenceSync
from rl.rollout import Rollout, collect_rollout


class KLStop(RuntimeError):
    """Mean KL passed `guard.kl_stop`: the run stops (after its checkpoint is saved)."""


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


class RLTrainer:
    def __init__(self, cfg: RLConfig, state, policy, reference, optimizer, tokenizer, task, reward_fn,
                 reward_norm, critic=None, critic_optimizer=None):
        self.cfg, self.state = cfg, state
        self.policy, self.ref, self.opt = policy, reference, optimizer
        self.critic, self.critic_opt = critic, critic_optimizer
        self.tok, self.task, self.reward_fn, self.reward_norm = tokenizer, task, reward_fn, reward_norm
        self.controller = KLController(cfg.kl_ctl)
        self.ref_sync = ReferenceSync(cfg.reference, cfg.kl_ctl.target)
        self.vocab = policy.cfg.vocab_size
        self.tp_group, self.dp_group = state.tp_group, state.dp_group
        self.world_group = None if state.mesh is None else torch.distributed.group.WORLD
        self.timer = PhaseTimer(state.device)
        if cfg.algo.name == "ppo" and critic is None:
            raise ValueError("algo.name='ppo' needs a critic")

    # -----------------------------------------------------------------------------------------
    # 1-5: experience

    def _token_stats(self, model, ro: Rollout, **kw):
        return policy_token_stats(model, ro.sequences, ro.attention_mask, ro.prompt_len, tp_group=self.tp_group,
                                  vocab_size=self.vocab, temperature=self._temperature,
                                  chunk_size=self.cfg.algo.kl_chunk_size, **kw)

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
                                 dp_group=self.dp_group, device=st.device, world_group=self.world_group)
        mask = ro.response_mask
        exact = cfg.kl.exact
        with self.timer("ref_logprobs"):
            ref_h, ref_w = reference_hidden(self.ref, ro.sequences, ro.attention_mask, ro.prompt_len)
            ref_logp = self._token_stats(self.ref, ro, entropy=False).logprobs
        with self.timer("old_logprobs"):
            kl_dir = cfg.kl.direction if exact else None
            old = self._token_stats(self.policy, ro, entropy=True, kl=kl_dir, ref_hidden=ref_h, ref_weight=ref_w)
        kl = old.kl if exact else kl_from_config(cfg.kl, old.logprobs, ref_logp)
        kl = torch.where(mask, kl.float(), torch.zeros((), device=kl.device))
        scores = ro.scores
        if self.reward_norm is not None:
            scores = self.reward_norm.normalize_(scores.clone(), self.dp_group)
        data = StepData(ro, mask, old.logprobs, ref_logp, ref_h if exact else None, ref_w if exact else None,
                        kl, old.entropy, advantages=None)
        if cfg.algo.name == "grpo":
            if cfg.kl.where == "reward":  # the response's summed KL penalty enters its reward
                scores = scores - self.controller.beta * kl.sum(1)
            adv = grpo_advantages(scores, cfg.rollout.group_size, cfg.algo.adv_std_norm)
            data.advantages = broadcast_to_tokens(adv, mask)
        else:
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

    # -----------------------------------------------------------------------------------------
    # 6: update

    def _mini_batches(self, B: int, step: int, epoch: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(self.cfg.train.seed * 7919 + step * 131 + epoch)
        order = torch.randperm(B, generator=g)
        n = self.cfg.algo.mini_batches
        if B % n:
            raise ValueError(f"algo.mini_batches={n} must divide the {B} rows each DP rank holds per step")
        return [order[i * (B // n):(i + 1) * (B // n)].to(self.state.device) for i in range(n)]

    def _micro_batches(self, rows: torch.Tensor) -> list[torch.Tensor]:
        m = self.cfg.algo.micro_batch_size or rows.numel()
        return [rows[i:i + m] for i in range(0, rows.numel(), m)]

    def update(self, data: StepData, step: int) -> dict:
        cfg = self.cfg
        beta = self.controller.beta
        stats_acc: dict[str, list[float]] = {}
        opt_stats = []
        stop_early = False
        ro = data.ro
        for epoch in range(cfg.algo.epochs):
            for rows in self._mini_batches(data.mask.shape[0], step, epoch):
                micros = self._micro_batches(rows)
                scale = loss_scale([data.mask[r] for r in micros], self.dp_group)
                for i, r in enumerate(micros):
                    last = i == len(micros) - 1
                    set_gradient_sync(self.policy, last)
                    sub = Rollout(ro.sequences[r], ro.attention_mask[r], ro.response_mask[r], ro.prompt_len,
                                  ro.scores[r], ro.row_ids[r], ro.metas, [])
                    exact = cfg.kl.exact and cfg.kl.where == "loss"
                    cur = self._token_stats(
                        self.policy, sub, entropy=True, kl=cfg.kl.direction if exact else None,
                        ref_hidden=data.ref_hidden[r] if exact else None,
                        ref_weight=data.ref_weight if exact else None)
                    loss, stats = policy_loss(cur.logprobs, data.old_logp[r], data.advantages[r], data.mask[r],
                                              cfg.loss, kl_cfg=cfg.kl, beta=beta, ref_logp=data.ref_logp[r],
                                              kl=cur.kl, entropy=cur.entropy, scale=scale)
                    loss.backward()
                    for k, v in stats.items():
                        stats_acc.setdefault(k, []).append(float(v))
                    if self.critic is not None:
                        self._critic_backward(data, sub, r, scale, last)
                sync_replicated_grads(self.policy, self.dp_group)
                opt_stats.append(self.opt.step())
                if self.critic is not None:
                    sync_replicated_grads(self.critic, self.dp_group)
                    cs = self.critic_opt.step()
                    stats_acc.setdefault("critic_grad_norm", []).append(cs.grad_norm)
            if cfg.algo.early_stop_kl is not None:
                approx = torch.tensor([sum(stats_acc["approx_kl_old"]) / len(stats_acc["approx_kl_old"])])
                comm.all_reduce(approx, "sum", self.dp_group)  # mean over DP of the drift from the old policy
                if approx.item() / comm.group_size(self.dp_group) > cfg.algo.early_stop_kl:
                    stop_early = epoch < cfg.algo.epochs - 1
                    break
        out = {k: sum(v) / len(v) for k, v in stats_acc.items()}
        out["grad_norm"] = opt_stats[-1].grad_norm
        out["lr"] = opt_stats[-1].lr
        out["skipped"] = sum(int(s.skipped) for s in opt_stats)
        out["skipped_total"] = opt_stats[-1].skipped_total
        out["early_stopped"] = stop_early
        out["optimizer_steps"] = len(opt_stats)
        return out

    def _critic_backward(self, data: StepData, sub: Rollout, r, scale, last: bool) -> None:
        set_gradient_sync(self.critic, last)
        values = critic_values(self.critic, sub.sequences, sub.attention_mask, sub.prompt_len)
        vloss, _ = clipped_value_loss(values, data.old_values[r], data.returns[r], data.mask[r],
                                      self.cfg.critic.value_clip)
        from rl.losses import aggregate

        aggregate(vloss, data.mask[r], "token-mean", scale).backward()

    # -----------------------------------------------------------------------------------------
    # 7: one whole step

    def step(self, step: int) -> dict:
        cfg = self.cfg
        reset_peak_memory(self.state.device)
        t0 = time.perf_counter()
        data = self.make_experience(step)
        with self.timer("update"):
            upd = self.update(data, step)
        mask, dpg = data.mask, self.dp_group
        kl_mean = float(masked_mean(data.kl, mask, dp_group=dpg))
        beta = self.controller.beta
        new_beta = self.controller.update(kl_mean)
        synced = self.ref_sync.maybe_sync(step, kl_mean, self.policy, self.ref, self.opt)
        q = kl_quantiles(data.kl, mask, dp_group=dpg)
        pos_mean, _ = kl_by_position(data.kl, mask, n_buckets=min(8, cfg.rollout.max_new_tokens),
                                     max_len=cfg.rollout.max_new_tokens, dp_group=dpg)
        scores = data.ro.scores
        stats = torch.stack([scores.sum(), (scores ** 2).sum(), scores.new_tensor(float(scores.numel())),
                             mask.sum().float(), data.advantages.abs().sum()])
        comm.all_reduce(stats, "sum", dpg)  # reward sums, counts and tokens over DP for global means
        n = stats[2].item()
        r_mean = stats[0].item() / n
        r_std = max(stats[1].item() / n - r_mean ** 2, 0.0) ** 0.5
        tokens = stats[3].item()
        elapsed = time.perf_counter() - t0
        times = self.timer.pop()
        rec = {"step": step, "reward_mean": r_mean, "reward_std": r_std, "kl_mean": kl_mean,
               "kl_p50": q["p50"], "kl_p90": q["p90"], "kl_p99": q["p99"], "kl_max": q["max"],
               "kl_by_position": [float(x) for x in pos_mean], "beta": beta, "beta_next": new_beta,
               "entropy": float(masked_mean(data.entropy, mask, dp_group=dpg)),
               "clipfrac": upd.get("clipfrac", 0.0), "ratio_mean": upd.get("ratio_mean", 1.0),
               "ratio_min": upd.get("ratio_min", 1.0), "ratio_max": upd.get("ratio_max", 1.0),
               "approx_kl_old": upd.get("approx_kl_old", 0.0), "pg_loss": upd.get("pg_loss", 0.0),
               "kl_loss": upd.get("kl_loss", 0.0), "adv_abs_mean": stats[4].item() / max(tokens, 1.0),
               "grad_norm": upd["grad_norm"], "lr": upd["lr"], "skipped": upd["skipped"],
               "skipped_total": upd["skipped_total"], "early_stopped": upd["early_stopped"],
               "response_len": tokens / n, "tokens_per_s": tokens / max(elapsed, 1e-9),
               "ref_synced": synced, "step_time_s": elapsed,
               **times, **peak_memory(self.state.device)}
        if "critic_grad_norm" in upd:
            rec["critic_grad_norm"] = upd["critic_grad_norm"]
        rec["kl_warning"] = kl_mean > cfg.guard.kl_warn
        if kl_mean > cfg.guard.kl_stop:
            rec["kl_stop"] = True
        return rec
