"""Statistics of one RL update (rl/update/update.py's `PolicyUpdate.update`), reduced over micro-batches and DP
ranks the way the losses were normalised."""

from __future__ import annotations

import torch

from parallel import comm


class UpdateStats:
    """Update statistics reduced the way they were normalised: the scaled losses (each micro-batch
    holds its share of the mini-batch loss) are summed over micro-batches and DP ranks and
    averaged over mini-batches; ratio and clip statistics are weighted by valid tokens."""

    SCALED = ("pg_loss", "kl_loss", "distill_loss")
    WEIGHTED = ("clipfrac", "dual_clipfrac", "ratio_mean", "approx_kl_old")

    def __init__(self):
        self.scaled = {k: [] for k in self.SCALED}
        self.wsum = {k: 0.0 for k in self.WEIGHTED}
        self.tokens = 0.0
        self.epoch_kl = [0.0, 0.0]  # token-weighted approx KL to the old policy in this epoch
        self.rmin, self.rmax = float("inf"), float("-inf")
        self.drift = 0.0
        self.critic_norms: list[float] = []
        self.seq = None  # GSPO's per-response statistics: [seq_clipfrac x n, seq_ratio_mean x n, n], max ratio

    def start_mini_batch(self):
        for k in self.SCALED:
            self.scaled[k].append(0.0)

    def add(self, stats: dict):
        for k in self.SCALED:
            if k in stats:
                self.scaled[k][-1] += float(stats[k])
        self.drift = max(self.drift, float(stats.get("drift", 0.0)))
        n = float(stats["valid_tokens"])
        for k in self.WEIGHTED:
            self.wsum[k] += float(stats[k]) * n
        self.tokens += n
        if "valid_seqs" in stats:
            ns = float(stats["valid_seqs"])
            prev = self.seq or [0.0, 0.0, 0.0, 0.0]
            self.seq = [prev[0] + stats["seq_clipfrac"] * ns, prev[1] + stats["seq_ratio_mean"] * ns, prev[2] + ns,
                        max(prev[3], stats["seq_ratio_max"] if ns else 0.0)]
        self.epoch_kl[0] += float(stats["approx_kl_old"]) * n
        self.epoch_kl[1] += n
        if n > 0:
            self.rmin, self.rmax = min(self.rmin, float(stats["ratio_min"])), max(self.rmax, float(stats["ratio_max"]))

    def epoch_approx_kl(self, dp_group) -> float:
        t = torch.tensor(self.epoch_kl, dtype=torch.float64, device=comm.collective_device(dp_group))
        comm.all_reduce(t, "sum", dp_group)  # token-weighted drift from the old policy over DP
        self.epoch_kl = [0.0, 0.0]
        return float(t[0] / t[1].clamp(min=1))

    def summary(self, dp_group) -> dict:
        # each rank's micro-batch losses add up to its share of the mini-batch loss; shares add over DP
        vals = [sum(self.scaled[k]) / max(len(self.scaled[k]), 1) for k in self.SCALED]
        vals += [self.wsum[k] for k in self.WEIGHTED] + [self.tokens]
        t = torch.tensor(vals, dtype=torch.float64, device=comm.collective_device(dp_group))
        comm.all_reduce(t, "sum", dp_group)  # loss shares and token-weighted sums over DP
        mm = torch.tensor([-self.rmin, self.rmax, self.drift], dtype=torch.float64, device=t.device)
        comm.all_reduce(mm, "max", dp_group)  # extreme ratios and the largest log-prob drift over DP
        out = {k: float(t[i]) for i, k in enumerate(self.SCALED)}
        n = max(float(t[-1]), 1.0)
        for j, k in enumerate(self.WEIGHTED):
            out[k] = float(t[len(self.SCALED) + j]) / n
        out["ratio_min"] = -float(mm[0]) if self.tokens else 1.0
        out["ratio_max"] = float(mm[1]) if self.tokens else 1.0
        out["logp_drift"] = float(mm[2])
        if self.critic_norms:
            out["critic_grad_norm"] = self.critic_norms[-1]
        if self.seq is not None:  # every rank has it alike (one loss.policy)
            s = torch.tensor(self.seq[:3], dtype=torch.float64, device=t.device)
            comm.all_reduce(s, "sum", dp_group)  # response-weighted sums over DP
            mx = torch.tensor([self.seq[3]], dtype=torch.float64, device=t.device)
            comm.all_reduce(mx, "max", dp_group)  # the largest sequence ratio over DP
            out.update(seq_clipfrac=float(s[0] / s[2].clamp(min=1)), seq_ratio_mean=float(s[1] / s[2].clamp(min=1))
                       if s[2] > 0 else 1.0, seq_ratio_max=float(mx[0]) if s[2] > 0 else 1.0)
        return out


def masked_range(values: torch.Tensor, mask: torch.Tensor, dp_group) -> tuple[float, float]:
    """(min, max) of `values` [B, S] over the valid tokens (`mask` [B, S], bool) of every DP rank; (0.0, 0.0)
    where no rank has one. A metric: e.g. log(pi_old/ref) at the sampled tokens, whose extremes are those of
    the importance weight pi/ref."""
    v = values.detach().double()
    inf = torch.tensor(float("inf"), dtype=v.dtype, device=v.device)
    mm = torch.stack([-torch.where(mask, v, inf).min(), torch.where(mask, v, -inf).max()]) if v.numel() else \
        torch.full((2,), -float("inf"), dtype=v.dtype, device=v.device)
    mm = mm.to(comm.collective_device(dp_group))
    comm.all_reduce(mm, "max", dp_group)  # the extremes over DP (min as max of the negation)
    if not torch.isfinite(mm).all():
        return 0.0, 0.0
    return -float(mm[0]), float(mm[1])
