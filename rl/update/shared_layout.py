"""The shared-prompt layout: each distinct prompt of a micro-batch once, its responses after it.

GRPO samples every prompt G times, so the rows of a rollout come in groups with identical prompts.
Instead of [left-padded prompt | response] per row, a shared micro-batch holds each prompt group
once, [prompt | response 1 | response 2 | ...], several groups per row, the rows padded to the
longest:

    input_ids, position_ids, document_ids, prefix_ids: [R, W]   (R rows, W the longest row's tokens)

Within a row each group's prompt gets a document id, each of its responses the next ids, padding -1;
prefix ids: the group's prompt id on each of its tokens, -1 on padding. A token attends to the
earlier tokens of its own document and of document prefix_ids (core/model.py `document_mask_4d`):
a response sees its prompt and its own earlier tokens, never another response or group. Positions
are the padded path's (the attention mask's cumulative count): a response continues from its
prompt's length. So each response token's hidden state is the one the row-by-row forward computes
(up to float rounding order), and in backward the prompt's activations receive the sum of their
responses' gradients, as the separate rows' copies did. Response token 0 of every member is
predicted by the prompt's last position: `head_pos` repeats it and the gather's backward sums.

The result is a `PackedRows` (rl/update/micro_batches.py) whose `head_pos` index the flattened [R * W]
positions, so the packed heads (rl/update/logprobs.py) read it unchanged. Groups are found by equality of
the real prompt token ids (so prompt length too), not by row order. Rows without a valid response
token are left out: they contribute exactly nothing, as on the padded path.

| plan                     | groups -> pieces                       | pieces -> rows of the layout             |
|--------------------------|----------------------------------------|------------------------------------------|
| `share_rows` (row count; | a group over twice the median group    | first-fit decreasing into rows of        |
| the experience passes)   | length split into pieces that repeat   | max(longest piece, twice the median)     |
|                          | the prompt                             |                                          |
| `shared_by_token_budget` | a group over the budget T split into   | first-fit decreasing over micro-batches: |
| (micro_batch_tokens=T)   | pieces of <= T tokens that repeat the  | a piece joins the first micro-batch with |
|                          | prompt (a prompt + one response over   | a row of room for it, or a new row there |
|                          | T: a piece alone, over budget)         | if R x W stays <= T (W: its first,       |
|                          |                                        | longest piece), else opens one           |

Under the budget every micro-batch's R x W <= T, except a piece of one response over T, which runs
alone (as by_token_budget runs an over-budget row alone). The micro-batch count is agreed over DP as
by_token_budget's (one max all-reduce, halving, zero-weight fillers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.generation.generate import distinct_prompts
from rl.experience.rollout import Rollout
from rl.update.micro_batches import MicroBatch, PackedRows, agreed_count, by_row_count, filler, row_lengths, split_to


def prompt_keys(ro: Rollout, rows: torch.Tensor) -> list[int]:
    """A group id per row of `rows` [k] (local indices): equal iff the rows' real prompt tokens are equal."""
    P = ro.prompt_len
    if P == 0 or rows.numel() == 0:
        return [0] * int(rows.numel())
    return distinct_prompts(ro.sequences[rows, :P], ro.attention_mask[rows, :P])[0]


def _layout(rows: list[int], p: list[int], n: list[int], keys: list[int]):
    """The pieces of the layout, one per group key (first appearance order), rows without a response
    left out: (prompt row, prompt tokens p_g, [(row, response extent n_i) of each member in order]).
    Per row, not per token: `_assemble` expands them to tokens with tensor ops."""
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        if n[i] > 0:
            groups.setdefault(k, []).append(i)
    return [(rows[m[0]], p[m[0]], [(rows[i], n[i]) for i in m]) for m in groups.values()]


def _piece_len(piece) -> int:
    return piece[1] + sum(ni for _, ni in piece[2])


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


def _pack_groups(lengths: list[int], spread: int = 2) -> list[list[int]]:
    """Groups of `lengths` tokens -> rows of the shared layout (lists of group indices), first-fit
    decreasing into rows of max(longest group, `spread` x the median group) tokens, so that groups of
    different sizes (a mini-batch holds a varying number of each prompt's rows; a prompt drawn twice
    makes one long group) are not each padded to the longest (spread 0: rows of the longest group, short
    groups sharing a row only where they fit beside each other). Within a row groups keep their order;
    rows are sorted by first group."""
    cap = max(max(lengths), spread * sorted(lengths)[len(lengths) // 2])
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


@dataclass(frozen=True)
class LayoutCost:
    """The relative cost of a forward (and backward) over an [R, W] layout under a dense mask, per layer:
    each token's projections and MLP (2 (2 H^2 + 2 H Hkv) + 6 H I multiply-adds) and each of the R W^2
    attention scores (4 H: Q K^T and P V). With a dense mask every score is computed (neither SDPA's CPU
    kernel nor its CUDA ones skip masked blocks), so the score term grows with the square of a row: a
    group of G long responses in one row costs G^2 times one response's attention. tp divides both.
    Rows of one prompt and one response run causal attention instead (core/causal_layout.py), about half
    the modelled scores: the model overprices only the plan it already picks at long responses."""

    per_token: float
    per_score: float

    def attention_share(self, width: int) -> float:
        """The share of a row of `width` tokens' modelled cost spent in attention scores."""
        return width * self.per_score / (self.per_token + width * self.per_score)

    @classmethod
    def of(cls, cfg) -> LayoutCost:
        """From a ModelConfig."""
        H, hkv = cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim
        return cls(2.0 * (2 * H * H + 2 * H * hkv) + 6.0 * H * cfg.intermediate_size, 4.0 * H)

    def __call__(self, rows: int, width: int) -> float:
        return rows * width * (self.per_token + width * self.per_score)


# The model counts arithmetic, not per-row overheads, which decide short rows on a CPU: at the tiny bench
# shapes (attention 16% of the modelled cost) one group a row measured 1.2x slower than two, although the
# model priced it 19% cheaper. So other plans are priced only where the default's rows spend at least
# ATTENTION_SHARE of their modelled cost in attention (rows of >= (per_token / per_score) / 3 tokens: ~130
# at the tiny model, ~520 at H=256, ~8.9k at Llama-3-8B), and one is taken only at <= SWITCH_MARGIN of the
# default's modelled cost.
ATTENTION_SHARE = 0.25
SWITCH_MARGIN = 0.9


def _split_pieces(groups: list, k: int) -> list:
    """Each piece (`_layout`'s) with more than k responses -> consecutive pieces of at most k, each
    repeating the prompt."""
    return [(prow, pg, answers[i:i + k]) for prow, pg, answers in groups for i in range(0, len(answers), k)]


def _cheapest_plan(groups: list, cost: LayoutCost):
    """(pieces, rows) of the lowest modelled cost among: the default (`groups` as they are, packed two
    median groups a row; kept outright where its rows spend under ATTENTION_SHARE in attention) and the
    pieces of at most k responses (k halving from the largest group's count to 1) packed either way (two
    medians a row, or the longest piece a row), taken only when it costs at most SWITCH_MARGIN of the
    default. k = 1 is the padded layout without its padding: one response per
    row after its prompt. Long responses make it the cheapest: with a dense mask a group of G responses
    of N tokens in one row runs G^2 N^2 scores, G rows of one response G N^2."""
    def priced(pieces, spread):
        lengths = [_piece_len(g) for g in pieces]
        bins = _pack_groups(lengths, spread)
        width = max(sum(lengths[i] for i in b) for b in bins)
        return cost(len(bins), width), pieces, bins, width

    default = priced(groups, 2)
    if cost.attention_share(default[3]) < ATTENTION_SHARE:
        return default[1:3]
    best = default
    k = max(len(g[2]) for g in groups)
    while True:
        pieces = _split_pieces(groups, k)
        for spread in (2, 0):
            cand = priced(pieces, spread)
            if cand[0] < best[0]:
                best = cand
        if k == 1:
            break
        k = (k + 1) // 2
    return best[1:3] if best[0] <= SWITCH_MARGIN * default[0] else default[1:3]


def _check_prompts(p: list[int], n: list[int]) -> None:
    if any(ni > 0 and pi < 1 for pi, ni in zip(p, n)):
        raise ValueError("shared prompts: a row with a response has no prompt token (nothing predicts its first)")


def share_rows(ro: Rollout, rows: list[int], p: list[int], n: list[int], keys: list[int],
               cost: LayoutCost | None = None):
    """Local rows `rows` (p_i real prompt tokens, response extent n_i, prompt group keys[i]) in the
    shared layout -> PackedRows ([R, W] inputs, M head tokens), or None when no row has a valid
    response token. Every group must have p_g >= 1 (a response needs a predicting position). `cost`
    (the model's LayoutCost): the plan `_cheapest_plan` prices lowest; None: the default plan."""
    _check_prompts(p, n)
    groups = _layout(rows, p, n, _split_long_groups(p, n, keys))
    if not groups:
        return None
    if cost is not None:
        return _assemble(ro, *_cheapest_plan(groups, cost))
    return _assemble(ro, groups, _pack_groups([_piece_len(g) for g in groups]))


def _assemble(ro: Rollout, groups: list, bins: list[list[int]]) -> PackedRows:
    """`groups` (`_layout`'s pieces) placed in the rows `bins` (lists of piece indices, in row order)
    -> PackedRows [R, W], W the longest row. Python walks the segments (a piece's prompt, each of its
    responses: O(rows)); the tokens are laid out by tensor ops on the rollout's device from one table."""
    dev, P = ro.sequences.device, ro.prompt_len
    R, T = len(bins), max(sum(_piece_len(groups[i]) for i in b) for b in bins)
    # one row per segment: flat start in [R * T], source row, source column, length, document id,
    # prefix id, predicting flat position of its token 0 (a response: its prompt's last; a prompt: -1)
    seg, resp, total, n_resp = [], [], 0, 0  # seg: the table, flat (7 per segment); resp: response segments
    for r, members in enumerate(bins):
        at, base = r * T, 0  # this piece's first flat position, its prompt's document id
        for i in members:
            prow, pg, answers = groups[i]
            seg += (at, prow, P - pg, pg, base, base, -1)
            last, at, total = at + pg - 1, at + pg, total + pg
            for d, (row, ni) in enumerate(answers, 1):
                resp.append(len(seg) // 7)
                seg += (at, row, P, ni, base + d, base, last)
                at, total, n_resp = at + ni, total + ni, n_resp + ni
            base += len(answers) + 1
    table = torch.tensor(seg, dtype=torch.long, device="cpu").view(-1, 7).to(dev)
    start, src_row, src_col, length, doc, prefix, pred0 = table.unbind(1)
    first = length.cumsum(0) - length  # each segment's first token
    sid = torch.repeat_interleave(torch.arange(table.shape[0], device=dev), length, output_size=total)
    off = torch.arange(total, device=dev) - first[sid]  # the token's place in its segment
    flat = start[sid] + off
    tok_row, tok_col = src_row[sid], src_col[sid] + off

    def spread(values: torch.Tensor, pad: int) -> torch.Tensor:  # token values -> [R, T], `pad` elsewhere
        return torch.full((R * T,), pad, dtype=torch.long, device=dev).index_put_((flat,), values).view(R, T)

    valid = torch.zeros(R * T, dtype=torch.bool, device=dev).index_fill_(0, flat, True).view(R, T)
    srow, scol = spread(tok_row, 0), spread(tok_col, 0)
    pos = ro.attention_mask.long().cumsum(-1) - 1  # the padded path's positions
    zero = torch.zeros((), dtype=torch.long, device=dev)
    ids = torch.where(valid, ro.sequences[srow, scol], zero)
    pos = torch.where(valid, pos[srow, scol], zero)
    # the response tokens, in layout order, by a second expansion over the response segments only (a
    # boolean selection would make the host wait for the device)
    rs = torch.tensor(resp, dtype=torch.long, device="cpu").to(dev)
    rlen = length[rs]
    rsid = torch.repeat_interleave(torch.arange(len(resp), device=dev), rlen, output_size=n_resp)
    src_cols = torch.arange(rsid.numel(), device=dev) - (rlen.cumsum(0) - rlen)[rsid]
    at = first[rs][rsid] + src_cols  # index into the layout's tokens
    src_rows = tok_row[at]
    head_pos = torch.where(src_cols == 0, pred0[rs][rsid], flat[at] - 1)  # token t is predicted at t - 1
    return PackedRows(ids, pos, spread(doc[sid], -1), src_rows, src_cols, head_pos,
                      ro.sequences[src_rows, P + src_cols], prefix_ids=spread(prefix[sid], -1))


def share_rollout(ro: Rollout, rows: torch.Tensor | None = None, cost: LayoutCost | None = None):
    """The shared layout of rows `rows` [k] of `ro` (default: all), or None when none has a response token."""
    rows = torch.arange(ro.sequences.shape[0], device=ro.sequences.device) if rows is None else rows
    p, n = row_lengths(ro, rows)
    return share_rows(ro, rows.tolist(), p, n, prompt_keys(ro, rows), cost)



def shared_by_row_count(ro: Rollout, rows: torch.Tensor, size: int, cost: LayoutCost | None = None) -> list[MicroBatch]:
    """by_row_count's micro-batches (`size` rows in the given order, 0: all), each in the shared
    layout (`share_rows`), or padded [m, P + N] when none of its rows has a response token (it still
    runs: every DP rank runs as many micro-batches)."""
    out = by_row_count(ro, rows, size)
    for mb in out:
        p, n = row_lengths(ro, mb.rows)
        mb.packed = share_rows(ro, mb.rows.tolist(), p, n, prompt_keys(ro, mb.rows), cost)
    return out


# ---------------------------------------------------------------------------------------------
# Under a token budget. A plan is a list of micro-batches; a micro-batch a list of rows of the
# layout; a row a list of pieces; a piece a list of row ids of one prompt group (its prompt once,
# then these rows' responses).


def members_per_piece(pg: int, ns: list[int], cost: LayoutCost) -> int:
    """How many of a group's responses (lengths `ns`, prompt `pg` tokens) one piece should hold, each
    piece a row of its own: the k (halving from all of them to 1) whose consecutive pieces the model
    prices lowest, where that is at most SWITCH_MARGIN of the whole group in one row; else all (and
    all outright where the whole group's row spends under ATTENTION_SHARE in attention)."""
    def priced(k):
        return sum(cost(1, pg + sum(ns[i:i + k])) for i in range(0, len(ns), k))

    if cost.attention_share(pg + sum(ns)) < ATTENTION_SHARE:
        return len(ns)
    whole = priced(len(ns))
    best_k, best, k = len(ns), whole, len(ns)
    while k > 1:
        k = (k + 1) // 2
        v = priced(k)
        if v < best:
            best_k, best = k, v
    return best_k if best <= SWITCH_MARGIN * whole else len(ns)


def budget_pieces(ids: list[int], p: dict, n: dict, keys: dict, budget: int,
                  cost: LayoutCost | None = None) -> list[list[int]]:
    """The prompt groups of row ids `ids` (rows with a response; keys[i]: the group of row i), each
    one piece, or, when p + sum n > budget, consecutive pieces of p + sum n <= budget, each repeating
    the prompt (a prompt and one response over budget: a piece of its own). `cost`: pieces also hold at
    most `members_per_piece` responses."""
    groups: dict[int, list[int]] = {}
    for i in ids:
        groups.setdefault(keys[i], []).append(i)
    out = []
    for members in groups.values():
        k = len(members) if cost is None else members_per_piece(p[members[0]], [n[i] for i in members], cost)
        piece, used = [], p[members[0]]
        for i in members:
            if piece and (used + n[i] > budget or len(piece) >= k):
                out.append(piece)
                piece, used = [], p[members[0]]
            piece.append(i)
            used += n[i]
        out.append(piece)
    return out


def plan_shared(pieces: list[list[int]], length, budget: int) -> list[list[list[list[int]]]]:
    """`pieces` (length(piece): its tokens) -> micro-batches, first-fit decreasing on two levels:
    each piece, longest first, joins the first micro-batch with a row of room for it, or else one
    whose R + 1 rows of its width W (its first, longest piece) stay <= budget, or else opens one.
    So R x W <= budget, but for a lone piece over budget."""
    plans: list[list[list[list[int]]]] = []
    width: list[int] = []
    room: list[list[int]] = []  # per micro-batch, per row: tokens left in W
    for piece in sorted(pieces, key=lambda g: (-length(g), g[0])):
        L = length(piece)
        for j, rows in enumerate(plans):
            r = next((r for r, left in enumerate(room[j]) if left >= L), None)
            if r is not None:
                rows[r].append(piece)
                room[j][r] -= L
                break
            if (len(rows) + 1) * width[j] <= budget:
                rows.append([piece])
                room[j].append(width[j] - L)
                break
        else:
            plans.append([[piece]])
            width.append(L)
            room.append([0])
    return plans


def _halve(mb: list[list[list[int]]]):
    """A micro-batch of >= 2 response rows -> two, each no costlier: its layout rows in halves, else
    its one row's pieces in halves, else its one piece's responses in halves (each repeating the prompt)."""
    if len(mb) > 1:
        return mb[:len(mb) // 2], mb[len(mb) // 2:]
    if len(mb[0]) > 1:
        return [mb[0][:len(mb[0]) // 2]], [mb[0][len(mb[0]) // 2:]]
    g = mb[0][0]
    return [[g[:len(g) // 2]]], [[g[len(g) // 2:]]]


def _micro_batch(ro: Rollout, mb: list[list[list[int]]], p: dict, n: dict, device) -> MicroBatch:
    """One planned micro-batch as a MicroBatch whose `packed` is its shared layout, rows as planned."""
    pieces = [g for row in mb for g in row]
    flat = [i for g in pieces for i in g]
    key = [k for k, g in enumerate(pieces) for _ in g]  # a key per piece: `_layout` keeps their order
    groups = _layout(flat, [p[i] for i in flat], [n[i] for i in flat], key)
    bins, k = [], 0
    for row in mb:
        bins.append(list(range(k, k + len(row))))
        k += len(row)
    idx = torch.tensor(flat, dtype=torch.long, device=device)
    return MicroBatch(idx, max(p[i] for i in flat), max(n[i] for i in flat), packed=_assemble(ro, groups, bins))


def shared_by_token_budget(ro: Rollout, rows: torch.Tensor, budget: int, dp_group=None,
                           cost: LayoutCost | None = None) -> list[MicroBatch]:
    """This rank's micro-batches of mini-batch `rows` [k] in the shared layout, each [R, W] with
    R x W <= `budget` (see the module docstring); the same count on every rank of `dp_group` (one max
    all-reduce; halving, then zero-weight fillers, as `by_token_budget`)."""
    p_list, n_list = row_lengths(ro, rows)
    _check_prompts(p_list, n_list)
    ids = rows.tolist()
    p, n = dict(zip(ids, p_list)), dict(zip(ids, n_list))
    keys = dict(zip(ids, prompt_keys(ro, rows)))
    length = lambda g: p[g[0]] + sum(n[i] for i in g)
    plans = plan_shared(budget_pieces([i for i in ids if n[i] > 0], p, n, keys, budget, cost), length, budget)
    count = agreed_count(len(plans), rows.device, dp_group)
    tokens_run = lambda mb: len(mb) * max(sum(length(g) for g in row) for row in mb)  # R x W
    size = lambda mb: sum(len(g) for row in mb for g in row)
    return [filler(rows, p[ids[0]]) if mb is None else _micro_batch(ro, mb, p, n, rows.device)
            for mb in split_to(plans, count, tokens_run, size=size, halve=_halve)]
