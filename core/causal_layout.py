"""When a dense attention mask is plain causal attention in disguise, so SDPA can run `is_causal=True`.

SDPA's CPU flash kernel (and the CUDA ones) skip the key blocks above the diagonal only under
`is_causal=True`; with an explicit mask every block is computed and the mask added. Two layouts the
RL passes run are causal for every real token:

  - rows of [left padding | real tokens | trailing padding] (the padded rollout: prompts left-padded,
    responses padded after their stop): rolled left by their leading padding, each row's real tokens
    start at 0 and see exactly the earlier real tokens under a causal mask; the padding, now at the
    end, is seen by no real token. `left_pad_shift` finds the shift, `roll_rows` moves the rows and
    back;
  - shared-prompt rows holding one prompt and one response each (the layout the cost model picks for
    long responses): the document mask lets each real token see every earlier real token, so it is
    causal; `single_piece_rows` recognises it.

Padding positions compute different (finite, unread) values than under the dense mask; every real
token's output is the same up to float summation order.
"""

from __future__ import annotations

import torch


def left_pad_shift(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """attention_mask [B, S] (1 = real) -> leading padding per row [B] when every row is one contiguous
    run of real tokens (padding before and after it), else None. One host sync."""
    m = attention_mask.bool()
    # a run of ones is contiguous iff the row switches from 0 to 1 at most once (counting a start on 1)
    starts = m[:, :1].long().sum(1) + (m[:, 1:] & ~m[:, :-1]).long().sum(1)
    if bool((starts > 1).any()):
        return None
    return torch.where(m.any(1), m.long().argmax(1), torch.zeros_like(starts))


def roll_rows(x: torch.Tensor, shift: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [B, S, ...] with row b rotated left by shift[b] (position j takes j + shift[b] mod S); inverse:
    rotated right (undoes it)."""
    B, S = x.shape[:2]
    sign = -1 if inverse else 1
    idx = (torch.arange(S, device=x.device)[None] + sign * shift[:, None]) % S  # (B, S)
    idx = idx.view(B, S, *([1] * (x.dim() - 2))).expand(x.shape)
    return torch.gather(x, 1, idx)


def single_piece_rows(document_ids: torch.Tensor, prefix_ids: torch.Tensor) -> bool:
    """Shared-prompt rows [B, S] (padding -1 at the end) -> True when each row's real tokens start at 0,
    hold at most two documents (a prompt, then one response) and all see the row's first document:
    `document_mask_4d` is then causal over every real token. One host sync."""
    valid = document_ids >= 0
    new_doc = (document_ids[:, 1:] != document_ids[:, :-1]) & valid[:, 1:]
    ok = (valid[:, 1:] <= valid[:, :-1]).all(1) & (new_doc.long().sum(1) <= 1) \
        & ((prefix_ids == document_ids[:, :1]) | ~valid).all(1)
    return bool(ok.all())
