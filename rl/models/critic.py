"""PPO's value model: the policy's Transformer body (TP + FSDP like the policy) with a scalar head.

The value head is a replicated `Linear(H, 1)` applied to the replicated final hidden states, so
every TP rank computes the same values and the same head gradient; it is not passed through
`copy_to_tp` (that would multiply the body's gradient by tp).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from core.config import ModelConfig
from core.model import Transformer


class Critic(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group=None, kv_replica_group=None, device=None, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        self.body = Transformer(cfg, tp_group, kv_replica_group, device=device, dtype=dtype, with_lm_head=False)
        self.value_head = nn.Linear(cfg.hidden_size, 1, device=device, dtype=dtype)
        if str(device) != "meta":
            with torch.no_grad():  # start from V = 0: no opinion before the first update
                self.value_head.weight.zero_()
                self.value_head.bias.zero_()

    @property
    def layers(self):
        return self.body.layers

    def forward(self, input_ids: torch.Tensor, *, attention_mask=None) -> torch.Tensor:
        """input_ids [B, L] -> values [B, L] fp32 (replicated over tp)."""
        return self.body(input_ids, attention_mask=attention_mask,
                         head=lambda h, _w: self.value_head(h).squeeze(-1).float())
