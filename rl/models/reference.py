"""The frozen reference policy: sharded like the policy, never trained, optionally synced to it.

The reference is built with the policy's TP layout and FSDP-sharded over the same DP mesh, so
rank r holds the same slice of both; syncing is then a local copy (or EMA mix) per parameter,
with no communication. It is frozen (`requires_grad=False`, eval), holds no optimizer state, and
may be offloaded to CPU by FSDP2.

Sync policy (`reference` config section): every `sync_every` steps, and/or when the mean KL has
stayed below `sync_below * kl_ctl.target` for `sync_patience` consecutive steps; a hard copy or
an EMA mix `ref <- (1 - alpha) ref + alpha policy`; optionally the policy's AdamW moments are
reset afterwards.
"""

from __future__ import annotations

import torch

from parallel.fsdp import local_tensor
from rl.config import ReferenceConfig


@torch.no_grad()
def sync_reference(policy, ref, mode: str = "hard", alpha: float = 1.0) -> None:
    """Copy (mode "hard") or EMA-mix (mode "ema", weight `alpha` on the policy) the policy's local
    shards into the reference's. Both must be built and sharded identically."""
    pol = dict(policy.named_parameters())
    for name, rp in ref.named_parameters():
        if name not in pol:
            raise KeyError(f"reference parameter '{name}' has no counterpart in the policy")
        src, dst = local_tensor(pol[name]), local_tensor(rp)
        if src.shape != dst.shape:
            raise ValueError(f"reference '{name}' shard {tuple(dst.shape)} differs from the policy's "
                             f"{tuple(src.shape)}: they must be sharded the same way")
        src = src.to(device=dst.device, dtype=dst.dtype)
        if mode == "hard":
            dst.copy_(src)
        else:
            dst.lerp_(src, alpha)


class ReferenceSync:
    def __init__(self, cfg: ReferenceConfig, kl_target: float):
        self.cfg, self.kl_target = cfg, kl_target
        self.below = 0  # consecutive steps with KL under the sync threshold
        self.count = 0  # syncs so far

    def due(self, step: int, kl_mean: float) -> bool:
        c = self.cfg
        if c.sync_below is not None:
            self.below = self.below + 1 if kl_mean < c.sync_below * self.kl_target else 0
        if c.sync_every > 0 and (step + 1) % c.sync_every == 0:
            return True
        return c.sync_below is not None and self.below >= c.sync_patience

    def maybe_sync(self, step: int, kl_mean: float, policy, ref, optimizer=None) -> bool:
        """Sync if due (same decision on every rank: kl_mean is global). Returns whether it did."""
        if not self.due(step, kl_mean):
            return False
        sync_reference(policy, ref, self.cfg.sync_mode, self.cfg.ema_alpha)
        if self.cfg.reset_optimizer and optimizer is not None:
            optimizer.opt.state.clear()
        self.below = 0
        self.count += 1
        return True

    def state_dict(self) -> dict:
        return {"below": self.below, "count": self.count}

    def load_state_dict(self, sd: dict) -> None:
        self.below, self.count = int(sd["below"]), int(sd["count"])
