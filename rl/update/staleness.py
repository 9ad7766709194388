"""Bounded staleness (`algo.max_staleness = k`): which samples an update may use, given the version of the weights
that drew each one.

A pipeline that samples with older weights (one-step-off, or a queue of rollouts) tags every row with
`policy_version`, the version of the weights that generated it; the update starts from `current_version`, and
staleness = current_version - policy_version. `StalenessBound.apply` DROPS every row staler than k before the
old-log-prob pass (nothing is regenerated here: a pipeline that wants those prompts again samples them anew):
a dropped row keeps its place in the batch, so every DP rank keeps its shape and its collectives, but its response
mask is cleared, so it carries no token into the loss, the loss's counts, the KL or the advantages' tokens. With
group advantages (GRPO, RLOO, ...: the group's other samples are the baseline) a prompt group is dropped whole if
any of its rows is, so no baseline is taken over a partial group. Counts come back as metrics (global over DP):

  stale_dropped        rows dropped this step
  stale_dropped_share  their share of the step's rows
  staleness_seen_mean / staleness_seen_max   over every row before dropping

k = 0 is the synchronous run: every row must carry the current version. A version ahead of the current one is an
error naming the row. The update itself refuses a batch staler than k (rl/objectives/off_policy.py's
`staleness_metrics`), so the bound is never skipped silently.
"""

from __future__ import annotations

import dataclasses

import torch

from parallel import comm


class StalenessBound:
    """Drops samples older than `max_staleness` versions (module docstring). `group_size` G > 1: rows are
    prompt-major groups of G consecutive rows (rl/experience/rollout.py), dropped whole."""

    def __init__(self, max_staleness: int, group_size: int = 1):
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"algo.max_staleness must be an integer >= 0, got {max_staleness!r}")
        if group_size < 1:
            raise ValueError(f"StalenessBound: group_size must be >= 1, got {group_size}")
        self.k, self.G = max_staleness, group_size

    @classmethod
    def from_config(cls, cfg) -> StalenessBound:
        """The bound of an RLConfig: algo.max_staleness; whole groups for the critic-free group advantages."""
        grouped = cfg.algo.name == "grpo" and cfg.algo.advantage in ("grpo", "rloo", "reinforce_pp_baseline")
        return cls(cfg.algo.max_staleness, cfg.rollout.group_size if grouped else 1)

    def staleness(self, policy_version: torch.Tensor, current_version: int, check: bool = True) -> torch.Tensor:
        """[B] int64: current_version - policy_version; with `check`, a version ahead of the current raises
        naming the row."""
        if policy_version.dim() != 1 or policy_version.dtype.is_floating_point:
            raise ValueError(f"policy_version must be a [B] integer tensor, got {tuple(policy_version.shape)} "
                             f"{policy_version.dtype}")
        s = int(current_version) - policy_version.to(torch.int64)
        if check and (s < 0).any():
            i = int(torch.nonzero(s < 0)[0])
            raise ValueError(f"row {i} has policy_version {int(policy_version[i])}, ahead of the current version "
                             f"{int(current_version)}")
        return s

    def keep(self, policy_version: torch.Tensor, current_version: int) -> torch.Tensor:
        """[B] bool: the rows within the bound (whole groups of G when G > 1)."""
        return self._keep(self.staleness(policy_version, current_version))

    def _keep(self, s: torch.Tensor) -> torch.Tensor:
        ok = s <= self.k
        if self.G > 1:
            if ok.numel() % self.G:
                raise ValueError(f"StalenessBound: {ok.numel()} rows are not whole groups of {self.G}")
            ok = ok.view(-1, self.G).all(-1, keepdim=True).expand(-1, self.G).reshape(-1)
        return ok

    def apply(self, ro, policy_version: torch.Tensor, current_version: int, dp_group=None):
        """(the rollout `ro` with the dropped rows' response mask cleared, metrics). `ro`: a Rollout (any dataclass
        with a [B, N] `response_mask`); policy_version: [B] ints. Every DP rank must call it (two all-reduces);
        a version ahead of the current one on any rank raises on every rank."""
        if policy_version.shape != ro.response_mask.shape[:1]:
            raise ValueError(f"policy_version has shape {tuple(policy_version.shape)}, the rollout "
                             f"{ro.response_mask.shape[0]} rows")
        s = self.staleness(policy_version, current_version, check=False)
        keep = self._keep(s).to(ro.response_mask.device)
        dev = comm.collective_device(dp_group)
        sums = torch.stack([(~keep).sum().double(), keep.new_tensor(float(keep.numel()), dtype=torch.float64),
                            s.double().sum(), (s < 0).sum().double()]).to(dev)
        mx = (s.max() if s.numel() else s.new_zeros(())).double().reshape(1).to(dev)
        comm.all_reduce(sums, "sum", dp_group)  # dropped rows, rows, staleness sum, rows ahead: over DP
        comm.all_reduce(mx, "max", dp_group)  # the stalest row of any rank
        if float(sums[3]) > 0:
            self.staleness(policy_version, current_version)  # names the row on the rank that has it
            raise ValueError(f"another rank has a row whose policy_version is ahead of the current version "
                             f"{int(current_version)}")
        n = max(float(sums[1]), 1.0)
        metrics = {"stale_dropped": int(sums[0]), "stale_dropped_share": float(sums[0]) / n,
                   "staleness_seen_mean": float(sums[2]) / n, "staleness_seen_max": float(mx[0])}
        if bool(keep.all()):
            return ro, metrics
        return dataclasses.replace(ro, response_mask=ro.response_mask & keep[:, None]), metrics
