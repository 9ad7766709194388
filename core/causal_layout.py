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


def attention_mask_4d(key_valid: torch.Tensor, q_len: int) -> torch.Tensor:
    """key_valid [B, L] (1 = real token) -> bool [B, 1, S, L]: causal over the last S positions,
    no attention to padding, and every query sees itself so padded queries stay finite."""
    L = key_valid.shape[1]
    q_pos = torch.arange(L - q_len, L, device=key_valid.device)
    k_pos = torch.arange(L, device=key_valid.device)
    causal = k_pos[None, :] <= q_pos[:, None]  # (S, L)
    mask = causal[None] & key_valid.bool()[:, None, :]  # (B, S, L)
    mask = mask | (k_pos[None, :] == q_pos[:, None])[None]
    return mask.unsqueeze(1)


def document_mask_4d(document_ids: torch.Tensor, prefix_ids: torch.Tensor | None = None) -> torch.Tensor:
    """document_ids [B, S] (packed sequences: each row several documents, each a contiguous run of
    one id) -> bool [B, 1, S, S]: block-diagonal causal, a query sees the earlier keys of its own
    document only. prefix_ids [B, S] (shared prompts): a query also sees the earlier keys of document
    prefix_ids[q] (its group's prompt); prefix_ids == document_ids gives exactly the mask without."""
    S = document_ids.shape[1]
    pos = torch.arange(S, device=document_ids.device)
    causal = pos[None, :] <= pos[:, None]  # (S, S)
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, S, S)
    if prefix_ids is not None:
        same = same | (prefix_ids[:, :, None] == document_ids[:, None, :])
    return (causal[None] & same).unsqueeze(1)


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """document_ids [B, S] -> position_ids [B, S] that restart at 0 where each document starts."""
    B, S = document_ids.shape
    pos = torch.arange(S, device=document_ids.device).expand(B, S)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, pos, torch.zeros_like(pos)).cummax(-1).values  # (B, S) where each doc starts
    return pos - first


def check_packed(input_ids: torch.Tensor, document_ids, attention_mask, kv_cache, prefix_ids=None,
                 position_ids=None) -> None:
    if prefix_ids is not None and (document_ids is None or position_ids is None):
        raise ValueError("Transformer.forward: prefix_ids (shared prompts) need document_ids and position_ids")
    if document_ids is None:
        return
    if kv_cache is not None or attention_mask is not None:
        raise ValueError("Transformer.forward: document_ids (packed sequences) take no kv_cache and no "
                         "attention_mask (the documents are the mask)")
    for name, t in (("document_ids", document_ids), ("prefix_ids", prefix_ids)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(f"Transformer.forward: {name} {tuple(t.shape)} must have the shape of "
                             f"input_ids {tuple(input_ids.shape)}")
