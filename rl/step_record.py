"""One RL step's metrics record (the dict `RLTrainer.step` returns and metrics.jsonl holds), and
`kl_ctl.mode=grad_ratio`'s beta balancing, which adds its two gradient norms to that record.

The record's KL, reward, token and entropy statistics are global over DP (all-reduced sums and counts);
the times and peak memory are this rank's.
"""

from __future__ import annotations

import math
import time

import torch

from core.runtime.metrics import PhaseTimer, peak_memory
from parallel import comm
from rl.config import RLConfig
from rl.health.mismatch import mismatch_metrics
from rl.health.signals import WindowCorr, loss_term_grad_norms, repetition_rate
from rl.objectives.controller import KLController
from rl.objectives.kl import kl_by_position, kl_quantiles, masked_mean
from rl.update.step_data import StepData
from rl.update.update_stats import masked_range


def balance_beta(cfg: RLConfig, controller: KLController, data: StepData, dp_group) -> dict:
    """kl_ctl.mode=grad_ratio: beta for this step's update from the two loss terms' gradient norms
    (global over DP, rl/health/signals.py); returns them as metrics ({} in other modes)."""
    if cfg.kl_ctl.mode != "grad_ratio":
        return {}
    g_pg, g_kl = loss_term_grad_norms(cfg.loss, cfg.kl, data.old_logp, data.ref_logp, data.advantages,
                                      data.mask, dp_group)
    controller.set_from_grad_norms(g_pg, g_kl)
    return {"pg_grad_norm": g_pg, "kl_grad_norm": g_kl}


class StepRecorder:
    """Builds each step's record; holds the run's reward-KL correlation window. `timer`'s phase times are
    popped into the record; `rollout_stats` is the rollout's `rollout_s` of this rank's last generation."""

    def __init__(self, cfg: RLConfig, *, vocab: int, timer: PhaseTimer, rollout_stats: dict, dp_group, device):
        self.cfg, self.vocab, self.timer, self.rollout_stats = cfg, vocab, timer, rollout_stats
        self.dp_group, self.device = dp_group, device
        self.reward_kl = WindowCorr(cfg.monitor.corr_window)

    def record(self, step: int, data: StepData, upd: dict, *, t0: float, kl_mean: float, beta: float,
               new_beta: float, ent_coef: float, grads: dict, synced: bool, evals: dict) -> dict:
        """The record of step `step` on `data` after the update `upd` (its statistics), begun at
        `t0` (perf_counter): the control values passed in (`beta` the update ran with, `new_beta` the
        next, `ent_coef`, `grads` from `balance_beta`, `synced` the reference), `evals` merged in."""
        cfg, mask, dpg = self.cfg, data.mask, self.dp_group
        q = kl_quantiles(data.kl_for_control, mask, dp_group=dpg)
        ref_lo, ref_hi = masked_range(data.old_logp - data.ref_logp, mask, dpg)  # log(pi/ref) at the samples
        L = cfg.rollout.episode_tokens if cfg.rollout.env else cfg.rollout.max_new_tokens  # response columns, at most
        pos_mean, _ = kl_by_position(data.kl_for_control, mask, n_buckets=min(8, L), max_len=L, dp_group=dpg)
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
               "ref_log_ratio_min": ref_lo, "ref_log_ratio_max": ref_hi, "beta_min": cfg.kl_ctl.beta_min,
               **times, **peak_memory(self.device)}
        rec.update(mismatch_metrics(data, dpg))  # rollout vs the old-log-prob pass (rl/health/mismatch.py)
        if "critic_grad_norm" in upd:
            rec["critic_grad_norm"] = upd["critic_grad_norm"]
        rec.update({k: upd[k] for k in ("seq_clipfrac", "seq_ratio_mean", "seq_ratio_max") if k in upd})  # GSPO
        # the off-policy correction's weights and the samples' staleness (rl/objectives/off_policy.py)
        rec.update({k: v for k, v in upd.items() if k.startswith(("off_policy_", "staleness_", "stale_"))})
        rec.update(self.rollout_stats.get("recipe_metrics") or {})  # DAPO (rl/experience/dynamic_sampling.py)
        rec.update(evals)
        corr = self.reward_kl.add(r_mean, kl_mean)
        if corr is not None:
            rec["reward_kl_corr"] = corr
        g = cfg.guard  # limits on the mean KL per response token; None: off
        rec["kl_warning"] = g.kl_warn_per_token is not None and kl_mean > g.kl_warn_per_token
        if g.kl_stop_per_token is not None and kl_mean > g.kl_stop_per_token:
            rec["kl_stop"] = True
        return rec
