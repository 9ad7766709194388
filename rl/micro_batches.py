"""A mini-batch's rows split into micro-batches (gradient accumulation) without padding waste.

Rows of a rollout are [left-padded prompt | right-padded response] over P + N columns. Row i holds
p_i real prompt tokens and a response that ends at column n_i (its last valid token; 0 = none).

| mode (algo.*)                         | a micro-batch is                            | forward shape          |
|---------------------------------------|---------------------------------------------|------------------------|
| micro_batch_size=m (or 0: all rows)   | m rows in mini-batch order, untrimmed        | [m, P + N]             |
| (share_prompts=false)                 |                                              |                        |
| micro_batch_tokens=T                  | rows sorted by length, cut into runs of      | [k, max p + max n]     |
|                                       | k * (max p + max n) <= T; trimmed to that    |                        |
| micro_batch_tokens=T, pack_sequences  | rows concatenated, sum(p_i + n_i) <= T       | [1, sum(p_i + n_i)]    |
|                                       | (first-fit decreasing), padding dropped      | block-diagonal causal  |
| share_prompts (with micro_batch_size) | m rows in mini-batch order; per prompt group | [R groups, max_g       |
|                                       | prompt once, then each response (`share_rows`)| (p_g + sum_i n_i)]     |
|                                       |                                              | prompt + own response  |

share_prompts is off by default (null: on for GRPO without micro_batch_tokens; rl/config.py); it does not
compose with micro_batch_tokens (refused): the shared layout's cost is not the per-row cost the
token-budget plans count.

A row longer than T forms a micro-batch of its own. Rows without a valid response token are left
out: their loss, gradient and statistics are exactly 0 (losses are normalised by the mini-batch's
global counts, rl/losses.py, so leaving them out or splitting rows differently changes nothing but
float rounding order).

FSDP's all-gathers and reduce-scatters run per forward/backward, so every DP rank must run the same
number of micro-batches per mini-batch (verl #6176). The token-budget plans are agreed with one max
all-reduce over DP; a rank with fewer splits its costliest micro-batch in halves until it matches,
and when no micro-batch has two rows left it adds fillers: one row, one response column, its mask
cleared, so it runs the collectives with a loss and a gradient of exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel import comm
from rl.rollout import Rollout


@dataclass
class PackedRows:
    """k rows concatenated into one sequence of T tokens (each row: its real prompt tokens, then its
    response up to its last valid token), and the M response tokens the head reads.

    input_ids, position_ids (each row's own positions), document_ids (0..k-1): [1, T].
    src_rows, src_cols: [M] local row and response column of each head token, in packed order.
    head_pos: [M] packed position of the hidden state that predicts it; targets: [M] its token id.
    The shared-prompt layout (`share_rows`) has R rows: inputs [R, T], `prefix_ids` [R, T]
    set, and head_pos indexes the flattened [R * T] positions (R = 1 when packed)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    src_rows: torch.Tensor
    src_cols: torch.Tensor
    head_pos: torch.Tensor
    targets: torch.Tensor
    prefix_ids: torch.Tensor | None = None


@dataclass
class MicroBatch:
    """Local rows `rows` [k], trimmed to the last `prompt_cols` prompt and first `response_cols`
    response columns; `packed` when they run as one packed sequence; `filler` when it is a
    zero-weight stand-in (mask cleared)."""

    rows: torch.Tensor
    prompt_cols: int
    response_cols: int
    filler: bool = False
    packed: PackedRows | None = None

    def row_tokens(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A per-token tensor [B, N, ...] of the step -> this micro-batch's rows, trimmed [k, n, ...]."""
        return None if t is None else t[self.rows, :self.response_cols]

    def tokens(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A per-token tensor [B, N, ...] -> what the head sees: [k, n, ...] padded, [1, M, ...] packed."""
        if t is None or self.packed is None:
            return self.row_tokens(t)
        return t[self.packed.src_rows, self.packed.src_cols].unsqueeze(0)

    def mask(self, mask: torch.Tensor, packed: bool = True) -> torch.Tensor:
        """The response mask [B, N] -> this micro-batch's (`tokens`, or `row_tokens` with packed=False);
        all False for a filler."""
        m = self.tokens(mask) if packed else self.row_tokens(mask)
        return torch.zeros_like(m) if self.filler else m

    def rollout(self, ro: Rollout) -> Rollout:
        """The rows as a trimmed, padded Rollout (response mask cleared for a filler)."""
        cols = slice(ro.prompt_len - self.prompt_cols, ro.prompt_len + self.response_cols)
        return Rollout(ro.sequences[self.rows, cols], ro.attention_mask[self.rows, cols],
                       self.mask(ro.response_mask, packed=False), self.prompt_cols,
                       ro.scores[self.rows], ro.row_ids[self.rows], ro.metas, [])


def row_lengths(ro: Rollout, rows: torch.Tensor) -> tuple[list[int], list[int]]:
    """(real prompt tokens p_i, response extent n_i: last valid response column + 1, 0 if none) of `rows`."""
    am, rm = ro.attention_mask[rows], ro.response_mask[rows].bool()
    p = am[:, :ro.prompt_len].bool().sum(1)
    cols = torch.arange(1, rm.shape[1] + 1, device=rm.device)
    n = torch.where(rm, cols, torch.zeros_like(cols)).amax(1) if rm.shape[1] else torch.zeros_like(p)
    return p.tolist(), n.tolist()


def by_row_count(ro: Rollout, rows: torch.Tensor, size: int, share: bool = False) -> list[MicroBatch]:
    """`size` rows per micro-batch in the given order (0: all), untrimmed: [m, P + N] each; with
    `share`, each in the shared-prompt layout (`share_rows`), or padded when none of its
    rows has a response token (it still runs: every DP rank runs as many micro-batches)."""
    m = size or rows.numel()
    N = ro.response_mask.shape[1]
    out = [MicroBatch(rows[i:i + m], ro.prompt_len, N) for i in range(0, rows.numel(), m)]
    if share:
        for mb in out:
            p, n = row_lengths(ro, mb.rows)
            mb.packed = share_rows(ro, mb.rows.tolist(), p, n, prompt_keys(ro, mb.rows))
    return out


def _padded_cost(g: list[int], p: dict, n: dict) -> int:
    return len(g) * (max(p[i] for i in g) + max(n[i] for i in g))


def _packed_cost(g: list[int], p: dict, n: dict) -> int:
    return sum(p[i] + n[i] for i in g)


def group_padded(order: list[int], p: dict, n: dict, budget: int) -> list[list[int]]:
    """Runs of consecutive rows of `order` (sorted by length), each of rows x (max p + max n) <= budget
    (a row over budget alone), chosen by dynamic programming to minimise the padded tokens plus
    budget/8 per micro-batch (so that a long row does not pad a run of short ones, nor does the plan
    shatter into tiny forwards to save a few padding tokens)."""
    k, charge = len(order), budget / 8
    best, cut = [0.0] + [float("inf")] * k, [0] * (k + 1)
    for i in range(k):  # best[i]: the cheapest plan of order[:i]; extend it by runs order[i:j]
        mp = mn = 0
        for j in range(i + 1, k + 1):
            mp, mn = max(mp, p[order[j - 1]]), max(mn, n[order[j - 1]])
            cost = (j - i) * (mp + mn)
            if cost > budget and j > i + 1:
                break  # longer runs only cost more
            if best[i] + cost + charge < best[j]:
                best[j], cut[j] = best[i] + cost + charge, i
    groups, j = [], k
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def group_packed(order: list[int], p: dict, n: dict, budget: int) -> list[list[int]]:
    """First-fit decreasing: each row (longest first) into the first bin whose tokens stay <= budget."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        L = p[i] + n[i]
        j = next((j for j, u in enumerate(used) if u + L <= budget), None)
        if j is None:
            bins.append([i])
            used.append(L)
        else:
            bins[j].append(i)
            used[j] += L
    return bins


def split_to(groups: list[list[int]], count: int, cost) -> list[list[int] | None]:
    """`groups` split until there are `count`: the costliest group of >= 2 rows into halves, then
    None (a filler) for each one still missing."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [j for j, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            break
        j = max(splittable, key=lambda j: cost(groups[j]))
        g = groups.pop(j)
        groups[j:j] = [g[:len(g) // 2], g[len(g) // 2:]]
    return groups + [None] * (count - len(groups))


def pack_rows(ro: Rollout, rows: list[int], p: list[int], n: list[int]) -> PackedRows:
    """Local rows `rows` with p_i prompt tokens and response extent n_i as one packed sequence."""
    dev, P = ro.sequences.device, ro.prompt_len
    cpu = dict(dtype=torch.long, device="cpu")
    r, pt, nt = torch.tensor(rows, **cpu), torch.tensor(p, **cpu), torch.tensor(n, **cpu)
    L = pt + nt
    off = torch.cumsum(L, 0) - L  # (k,) where each document starts
    doc = torch.repeat_interleave(torch.arange(len(rows), **cpu), L)  # (T,)
    local = torch.arange(int(L.sum()), **cpu) - off[doc]
    cols, docd = (P - pt[doc] + local).to(dev), doc.to(dev)
    src = r[doc].to(dev)
    pos = (ro.attention_mask[r.to(dev)].long().cumsum(-1) - 1)[docd, cols]  # the padded path's positions
    rdoc = torch.repeat_interleave(torch.arange(len(rows), **cpu), nt)  # (M,)
    t = torch.arange(int(nt.sum()), **cpu) - (torch.cumsum(nt, 0) - nt)[rdoc]
    head_pos = off[rdoc] + pt[rdoc] + t - 1
    src_rows, src_cols = r[rdoc].to(dev), t.to(dev)
    return PackedRows(ro.sequences[src, cols][None], pos[None], docd[None], src_rows, src_cols,
                      head_pos.to(dev), ro.sequences[src_rows, P + src_cols])


def by_token_budget(ro: Rollout, rows: torch.Tensor, budget: int, packed: bool, dp_group=None) -> list[MicroBatch]:
    """This rank's micro-batches of mini-batch `rows` under a token budget (see the module docstring);
    the same count on every rank of `dp_group` (one max all-reduce)."""
    p_list, n_list = row_lengths(ro, rows)
    ids = rows.tolist()
    p, n = dict(zip(ids, p_list)), dict(zip(ids, n_list))
    order = sorted((i for i in ids if n[i] > 0), key=lambda i: (-(p[i] + n[i]), -n[i], i))
    groups = (group_packed if packed else group_padded)(order, p, n, budget)
    count = torch.tensor([max(len(groups), 1)], dtype=torch.int64, device=rows.device)
    comm.all_reduce(count, "max", dp_group)  # every DP rank runs as many micro-batches (FSDP steps in unison)
    cost = (lambda g: _packed_cost(g, p, n)) if packed else (lambda g: _padded_cost(g, p, n))
    out = []
    for g in split_to(groups, int(count), cost):
        if g is None:  # a zero-weight stand-in: one row, one response column, mask cleared
            out.append(MicroBatch(rows[:1], p[ids[0]], 1, filler=True))
            continue
        idx = torch.tensor(g, dtype=torch.long, device=rows.device)
        pk = pack_rows(ro, g, [p[i] for i in g], [n[i] for i in g]) if packed else None
        out.append(MicroBatch(idx, max(p[i] for i in g), max(n[i] for i in g), packed=pk))
    return out

# ---------------------------------------------------------------------------------------------
# Shared-prompt layout: each distinct prompt of a micro-batch once, its responses after it.
#
# GRPO samples every prompt G times, so the rows of a rollout come in groups with identical prompts.
# Instead of [left-padded prompt | response] per row, a shared micro-batch holds one sequence per
# prompt group, [prompt | response 1 | response 2 | ...], the groups padded to the longest:
#
#     input_ids, position_ids, document_ids, prefix_ids: [R, T]   (R groups, T = max_g p_g + sum n_i)
#
# Document ids: the prompt 0, the group's k-th response k (1-based), padding -1; prefix ids: 0 on the
# prompt and every response, -1 on padding. A token attends to the earlier tokens of its own document
# and of document prefix_ids (core/model.py `document_mask_4d`): a response sees its prompt and its own
# earlier tokens, never another response. Positions are the padded path's (the attention mask's
# cumulative count): a response continues from its prompt's length. So each response token's hidden
# state is the one the row-by-row forward computes (up to float rounding order), and in backward the
# prompt's activations receive the sum of their responses' gradients, as the separate rows' copies
# did. Response token 0 of every member is predicted by the prompt's last position: `head_pos`
# repeats it and the gather's backward sums.
#
# The result is a `PackedRows` (above) whose `head_pos` index the flattened [R * T]
# positions, so the packed heads (rl/logprobs.py) read it unchanged. Groups are found by equality of
# the real prompt token ids (so prompt length too), not by row order. Rows without a valid response
# token are left out: they contribute exactly nothing, as on the padded path.


def prompt_keys(ro: Rollout, rows: torch.Tensor) -> list[int]:
    """A group id per row of `rows` [k] (local indices): equal iff the rows' real prompt tokens are equal."""
    P = ro.prompt_len
    seq, am = ro.sequences[rows, :P], ro.attention_mask[rows, :P].bool()
    key = torch.where(am, seq, torch.full_like(seq, -1))  # padding never equals a token id
    if P == 0 or key.shape[0] == 0:
        return [0] * int(rows.numel())
    tuples = [tuple(r) for r in key.tolist()]  # one host copy; hashing beats unique(dim=0)'s per-row compares
    rank = {t: i for i, t in enumerate(sorted(set(tuples)))}  # ids in sorted order, as unique(dim=0) numbers them
    return [rank[t] for t in tuples]


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


def _split_long_groups(p: list[int], n: list[int], keys: list[int]) -> list[int]:
    """Group keys with every group longer than twice the median group length (e.g. a prompt drawn twice
    in one step) split into pieces of at most that many tokens, each piece repeating the prompt, so one
    long group does not set the padded length of every row."""
    members: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        if n[i] > 0:
            members.setdefault(k, []).append(i)
    if not members:
        return keys
    length = {k: p[m[0]] + sum(n[i] for i in m) for k, m in members.items()}
    cap = max(2 * sorted(length.values())[len(length) // 2], max(p[i] + n[i] for m in members.values() for i in m))
    out, fresh = list(keys), max(keys) + 1
    for k, m in members.items():
        if length[k] <= cap:
            continue
        used = p[m[0]]
        for i in m:
            if used + n[i] > cap:  # start a new piece (it repeats the prompt)
                fresh, used = fresh + 1, p[m[0]]
            out[i] = fresh
            used += n[i]
        fresh += 1
    return out


def _pack_groups(lengths: list[int]) -> list[list[int]]:
    """Groups of `lengths` tokens -> rows of the shared layout (lists of group indices), first-fit
    decreasing into rows of max(longest group, twice the median group) tokens, so that groups of
    different sizes (a mini-batch holds a varying number of each prompt's rows; a prompt drawn twice
    makes one long group) are not each padded to the longest. Within a row groups keep their order;
    rows are sorted by first group."""
    cap = max(max(lengths), 2 * sorted(lengths)[len(lengths) // 2])
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = next((j for j, left in enumerate(room) if left >= lengths[i]), None)
        if j is None:
            rows.append([i])
            room.append(cap - lengths[i])
        else:
            rows[j].append(i)
            room[j] -= lengths[i]
    return sorted(sorted(r) for r in rows)


def share_rows(ro: Rollout, rows: list[int], p: list[int], n: list[int], keys: list[int]):
    """Local rows `rows` (p_i real prompt tokens, response extent n_i, prompt group keys[i]) in the
    shared layout -> PackedRows ([R, T] inputs, M head tokens), or None when no row has a valid
    response token. Every group must have p_g >= 1 (a response needs a predicting position)."""
    if any(n[i] > 0 and p[i] < 1 for i in range(len(rows))):
        raise ValueError("shared prompts: a row with a response has no prompt token (nothing predicts its first)")
    groups = _layout(rows, p, n, _split_long_groups(p, n, keys), ro.prompt_len)
    if not groups:
        return None
    dev, P = ro.sequences.device, ro.prompt_len
    bins = _pack_groups([len(g[0]) for g in groups])
    R, T = len(bins), max(sum(len(groups[i][0]) for i in b) for b in bins)
    srow, scol, doc, prefix, valid = ([] for _ in range(5))  # flat [R * T] host lists, one tensor each
    hrow, hcol, hpos = [], [], []
    for r, members in enumerate(bins):
        at, base = 0, 0  # this group's first column in row r, its prompt's document id
        for i in members:
            sr, sc, d, hr, hc, hp = groups[i]
            L = len(sr)
            srow += sr
            scol += sc
            doc += [x + base for x in d]
            prefix += [base] * L  # every token of the group also sees the group's prompt
            hrow += hr
            hcol += hc
            hpos += [r * T + at + x for x in hp]  # flat index into [R * T]
            at, base = at + L, base + max(d) + 1
        pad = T - at
        srow += [0] * pad
        scol += [0] * pad
        doc += [-1] * pad
        prefix += [-1] * pad
        valid += [True] * at + [False] * pad
    cpu = dict(dtype=torch.long, device="cpu")
    srow, scol, doc, prefix = (torch.tensor(v, **cpu).view(R, T) for v in (srow, scol, doc, prefix))
    valid = torch.tensor(valid, dtype=torch.bool, device="cpu").view(R, T)
    srow, scol, valid_d = srow.to(dev), scol.to(dev), valid.to(dev)
    pos = ro.attention_mask.long().cumsum(-1) - 1  # the padded path's positions
    zero = torch.zeros((), dtype=torch.long, device=dev)
    ids = torch.where(valid_d, ro.sequences[srow, scol], zero)
    pos = torch.where(valid_d, pos[srow, scol], zero)
    doc, prefix = doc.to(dev), prefix.to(dev)
    src_rows, src_cols = torch.tensor(hrow, **cpu).to(dev), torch.tensor(hcol, **cpu).to(dev)
    return PackedRows(ids, pos, doc, src_rows, src_cols, torch.tensor(hpos, **cpu).to(dev),
                      ro.sequences[src_rows, P + src_cols], prefix_ids=prefix)


def share_rollout(ro: Rollout, rows: torch.Tensor | None = None):
    """The shared layout of rows `rows` [k] of `ro` (default: all), or None when none has a response token."""
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
