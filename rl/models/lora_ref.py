"""The reference as the policy's base: the same modules with the LoRA adapters switched off.

With LoRA (parallel/lora.py) the frozen base weights ARE the reference policy, so the KL penalty's
reference pass needs no second model: `BaseReference(policy)` calls the policy inside
`adapters_disabled`, which skips every adapter (not a multiplication by zero), so its log-probs are
bitwise the base model's. It holds no parameters of its own and no optimizer state; FSDP gathers
the policy's shards for it as for any policy forward.

Reference sync: a hard sync merges the adapters into the base (W <- W + s B A, then B <- 0): the
new reference is the current policy and training continues from it with fresh (zero) adapter
deltas. After such a merge the base differs from the checkpoint the run started from, so the run's
checkpoints then hold the whole policy (see core/ckpt/adapters.py). An EMA sync is refused at
config time (rl/config.py): mixing the base towards the adapted policy would need a second copy.
"""

from __future__ import annotations

import torch.nn as nn

from parallel.lora import adapters_disabled, merge_adapters


class BaseReference(nn.Module):
    """Callable like a `Transformer` (same forward keywords, `head=` included)."""

    merges_on_sync = True  # rl/models/reference.py: a hard sync merges instead of copying

    def __init__(self, policy: nn.Module):
        super().__init__()
        object.__setattr__(self, "policy", policy)  # not a submodule: the reference owns no parameters

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)

    def sync_from_policy(self) -> None:
        merge_adapters(self.policy, reset=True)
