"""The frozen reference policy: sharded like the policy, never trained, optionally synced to it.

The reference is built with the policy's TP layout and FSDP-sharded over the same DP mesh, so
rank r holds the same slice of both; syncing is then a local copy (or EMA mix) per parameter,
with no communication. It is frozen (`requires_grad=False`, eval), holds no optimizer state, and
may be offloaded to CPU by FSDP2.

Sync policy (`reference` config section): every `sync_every` steps, and/or when the mean KL has
stayed below `sync_below * kl_ctl.target` for `sync_patience` consecutive steps; a hard copy or
an EMA mix `ref <- (1 - alpha) ref + alpha policy`; optionally the policy's AdamW moments are
reset afterwards.

EMA with a bf16 (or fp16) reference (`reference.dtype=bf16`): mixed in the reference's own dtype,
alpha x (policy - ref) is mostly under half a bf16 ulp of ref and rounds away (a 2-layer model whose
policy moved by 1e-3 relative: 0 of its 30,880 weights moved in 50 syncs at alpha 0.1). So `ReferenceSync`
keeps an fp32 master copy of the reference's local shards (TP shard, then FSDP shard: sharded exactly
like the reference, on the same device, CPU when the reference is offloaded), made from the reference
at the first EMA sync; each sync mixes into it in fp32 and rounds it once into the reference. Its
price: 4 bytes per local reference weight, 2x the bf16 reference's own bytes (core/runtime/budget.py's
`reference_bytes` counts it). It is not in checkpoints: after a resume it restarts from the saved
bf16 reference (one bf16 rounding, which does not accumulate). An fp32 reference needs no copy.
"""

from __future__ import annotations

import torch

from parallel.fsdp import local_tensor
from rl.config import ReferenceConfig


@torch.no_grad()
def sync_reference(policy, ref, mode: str = "hard", alpha: float = 1.0, master: dict | None = None) -> None:
    """Copy (mode "hard") or EMA-mix (mode "ema", weight `alpha` on the policy) the policy's local
    shards into the reference's. Both must be built and sharded identically. `master` (EMA, bf16/fp16
    reference): {parameter name: fp32 copy of the reference's local shard}, filled from the reference
    where missing; the mix runs in it and the reference receives its rounding. A hard copy resets the
    entries it holds to the policy."""
    if getattr(ref, "merges_on_sync", False):  # the policy's own base (rl/models/lora_ref.py): merge the adapters
        ref.sync_from_policy()
        return
    pol = dict(policy.named_parameters())
    for name, rp in ref.named_parameters():
        if name not in pol:
            raise KeyError(f"reference parameter '{name}' has no counterpart in the policy")
        src, dst = local_tensor(pol[name]), local_tensor(rp)
        if src.shape != dst.shape:
            raise ValueError(f"reference '{name}' shard {tuple(dst.shape)} differs from the policy's "
                             f"{tuple(src.shape)}: they must be sharded the same way")
        if mode == "hard":
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
            if master is not None and name in master:
                master[name].copy_(src)
        elif master is not None and dst.dtype in LOW_PRECISION:
            acc = master.get(name)
            if acc is None:  # the first EMA sync: the fp32 copy starts from the reference as it is
                acc = master[name] = dst.to(torch.float32)
            acc.lerp_(src.to(device=acc.device, dtype=torch.float32), alpha)
            dst.copy_(acc)  # one rounding per sync, none carried over
        else:
            dst.lerp_(src.to(device=dst.device, dtype=dst.dtype), alpha)


LOW_PRECISION = (torch.bfloat16, torch.float16)


class ReferenceSync:
    def __init__(self, cfg: ReferenceConfig, kl_target: float):
        self.cfg, self.kl_target = cfg, kl_target
        self.below = 0  # consecutive steps with KL under the sync threshold
        self.count = 0  # syncs so far
        # EMA of a bf16/fp16 reference: fp32 copies of its local shards, by name (see the module docstring)
        self.master: dict[str, torch.Tensor] = {}

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
        sync_reference(policy, ref, self.cfg.sync_mode, self.cfg.ema_alpha, self.master)
        if self.cfg.reset_optimizer and optimizer is not None:
            optimizer.opt.state.clear()
        self.below = 0
        self.count += 1
        return True

    def state_dict(self) -> dict:
        return {"below": self.below, "count": self.count}

    def load_state_dict(self, sd: dict) -> None:
        self.below, self.count = int(sd["below"]), int(sd["count"])
