"""Sequence parallelism's model-side helpers (the collectives are parallel/seq_comm.py's).

`Transformer.sequence_parallel` (config `parallel.sequence_parallel`) holds the activations between
the tensor-parallel pairs as [B, S/tp, H] in full-sequence forwards (training, log-probs, the
reference's pass). A forward with a KV cache (the rollout's prefill and decode) runs without it: the
same weights, the same results, replicated activations (decode has S = 1; nothing to split).

S need not divide by tp: the input is padded at the end to the next multiple of tp and the head
sees the first S positions only. Trailing padding changes nothing before it (attention is causal);
the padding is what each mask already calls padding (attention_mask 0, document id -1), so every
layout keeps its fast path (core/causal_layout.py) and padded queries stay finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sp_active(model, kv_cache) -> bool:
    """Whether this forward of `model` (a core.model.Transformer) runs sequence-parallel."""
    return bool(getattr(model, "sequence_parallel", False)) and model.tp > 1 and kv_cache is None


def pad_to_multiple(tp: int, input_ids, position_ids, attention_mask, document_ids, prefix_ids):
    """Pad [B, S] inputs at the end to S' = ceil(S / tp) * tp -> (S', the five padded; None stays None).
    Padded tokens: id 0, positions continuing each row, attention_mask 0, document and prefix id -1."""
    S = input_ids.shape[1]
    pad = -S % tp
    if pad == 0:
        return S, input_ids, position_ids, attention_mask, document_ids, prefix_ids

    def ext(t, value):
        return None if t is None else F.pad(t, (0, pad), value=value)

    step = torch.arange(1, pad + 1, device=position_ids.device, dtype=position_ids.dtype)
    position_ids = torch.cat([position_ids, position_ids[:, -1:] + step], dim=1)
    return (S + pad, ext(input_ids, 0), position_ids, ext(attention_mask, 0), ext(document_ids, -1),
            ext(prefix_ids, -1))
