"""Shared-prompt layout: each distinct prompt of a micro-batch once, its responses after it.

GRPO samples every prompt G times, so the rows of a rollout come in groups with identical prompts.
Instead of [left-padded prompt | response] per row, a shared micro-batch holds one sequence per
prompt group, [prompt | response 1 | response 2 | ...], the groups padded to the longest:

    input_ids, position_ids, document_ids, prefix_ids: [R, T]   (R groups, T = max_g p_g + sum n_i)

Document ids: the prompt 0, the group's k-th response k (1-based), padding -1; prefix ids: 0 on the
prompt and every response, -1 on padding. A token attends to the earlier tokens of its own document
and of document prefix_ids (core/model.py `document_mask_4d`): a response sees its prompt and its own
earlier tokens, never another response. Positions are the padded path's (the attention mask's
cumulative count): a response continues from its prompt's length. So each response token's hidden
state is the one the row-by-row forward computes (up to float rounding order), and in backward the
prompt's activations receive the sum of their responses' gradients, as the separate rows' copies
did. Response token 0 of every member is predicted by the prompt's last position: `head_pos`
repeats it and the gather's backward sums.

The result is a `PackedRows` (rl/micro_batches.py) whose `head_pos` index the flattened [R * T]
positions, so the packed heads (rl/logprobs.py) read it unchanged. Groups are found by equality of
the real prompt token ids (so prompt length too), not by row order. Rows without a valid response
token are left out: they contribute exactly nothing, as on the padded path.
"""

from __future__ import annotations

import torch

from rl.rollout import Rollout


def prompt_keys(ro: Rollout, rows: torch.Tensor) -> list[int]:
    """A group id per row of `rows` [k] (local indices): equal iff the rows' real prompt tokens are equal."""
    P = ro.prompt_len
    seq, am = ro.sequences[rows, :P], ro.attention_mask[rows, :P].bool()
    key = torch.where(am, seq, torch.full_like(seq, -1))  # padding never equals a token id
    if P == 0 or key.shape[0] == 0:
        return [0] * int(rows.numel())
    return torch.unique(key, dim=0, return_inverse=True)[1].tolist()


def _layout(rows: list[int], p: list[int], n: list[int], keys: list[int], P: int):
    """Per group (first appearance order): the (row, column) of each token in the rollout, its
    document id, and for each response token its (row, response column, position in the group's row)."""
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        if n[i] > 0:
            groups.setdefault(k, []).append(i)
    out = []
    for members in groups.values():
        pg = p[members[0]]
        srow, scol, doc = [rows[members[0]]] * pg, list(range(P - pg, P)), [0] * pg
        hrow, hcol, hpos = [], [], []
        for d, i in enumerate(members, 1):
            start = len(srow)
            srow += [rows[i]] * n[i]
            scol += list(range(P, P + n[i]))
            doc += [d] * n[i]
            hrow += [rows[i]] * n[i]
            hcol += list(range(n[i]))
            hpos += [pg - 1] + list(range(start, start + n[i] - 1))  # token t is predicted at t - 1
        out.append((srow, scol, doc, hrow, hcol, hpos))
    return out


def share_rows(ro: Rollout, rows: list[int], p: list[int], n: list[int], keys: list[int]):
    """Local rows `rows` (p_i real prompt tokens, response extent n_i, prompt group keys[i]) in the
    shared layout -> PackedRows ([R, T] inputs, M head tokens), or None when no row has a valid
    response token. Every group must have p_g >= 1 (a response needs a predicting position)."""
    from rl.micro_batches import PackedRows  # rl.micro_batches imports this module

    if any(n[i] > 0 and p[i] < 1 for i in range(len(rows))):
        raise ValueError("shared prompts: a row with a response has no prompt token (nothing predicts its first)")
    groups = _layout(rows, p, n, keys, ro.prompt_len)
    if not groups:
        return None
    dev, P = ro.sequences.device, ro.prompt_len
    R, T = len(groups), max(len(g[0]) for g in groups)
    cpu = dict(dtype=torch.long, device="cpu")
    srow, scol = torch.zeros(R, T, **cpu), torch.zeros(R, T, **cpu)
    doc, valid = torch.full((R, T), -1, **cpu), torch.zeros(R, T, dtype=torch.bool, device="cpu")
    hrow, hcol, hpos = [], [], []
    for g, (sr, sc, d, hr, hc, hp) in enumerate(groups):
        L = len(sr)
        srow[g, :L], scol[g, :L], doc[g, :L] = torch.tensor(sr, **cpu), torch.tensor(sc, **cpu), torch.tensor(d, **cpu)
        valid[g, :L] = True
        hrow += hr
        hcol += hc
        hpos += [g * T + x for x in hp]  # flat index into [R * T]
    srow, scol, valid_d = srow.to(dev), scol.to(dev), valid.to(dev)
    pos = ro.attention_mask.long().cumsum(-1) - 1  # the padded path's positions
    zero = torch.zeros((), dtype=torch.long, device=dev)
    ids = torch.where(valid_d, ro.sequences[srow, scol], zero)
    pos = torch.where(valid_d, pos[srow, scol], zero)
    doc = doc.to(dev)
    prefix = torch.where(valid_d, zero, doc)  # 0 (the prompt) for real tokens, -1 for padding
    src_rows, src_cols = torch.tensor(hrow, **cpu).to(dev), torch.tensor(hcol, **cpu).to(dev)
    return PackedRows(ids, pos, doc, src_rows, src_cols, torch.tensor(hpos, **cpu).to(dev),
                      ro.sequences[src_rows, P + src_cols], prefix_ids=prefix)


def share_rollout(ro: Rollout, rows: torch.Tensor | None = None):
    """The shared layout of rows `rows` [k] of `ro` (default: all), or None when none has a response token."""
    from rl.micro_batches import row_lengths

    rows = torch.arange(ro.sequences.shape[0], device=ro.sequences.device) if rows is None else rows
    p, n = row_lengths(ro, rows)
    return share_rows(ro, rows.tolist(), p, n, prompt_keys(ro, rows))


def gather_tokens(packed, t: torch.Tensor | None) -> torch.Tensor | None:
    """A per-token tensor [B, N, ...] -> the head tokens of `packed` [1, M, ...]."""
    return None if t is None else t[packed.src_rows, packed.src_cols].unsqueeze(0)


def scatter_tokens(packed, values: torch.Tensor | None, B: int, N: int) -> torch.Tensor | None:
    """Head-token values [1, M, ...] -> [B, N, ...], 0 where `packed` has no head token."""
    if values is None:
        return None
    out = values.new_zeros((B, N) + tuple(values.shape[2:]))
    out[packed.src_rows, packed.src_cols] = values[0]
    return out
