"""A mini-batch's rows split into micro-batches (gradient accumulation) without padding waste.

Rows of a rollout are [left-padded prompt | right-padded response] over P + N columns. Row i holds
p_i real prompt tokens and a response that ends at column n_i (its last valid token; 0 = none).

| mode (algo.*)                         | a micro-batch is                              | forward shape          |
|---------------------------------------|-----------------------------------------------|------------------------|
| micro_batch_size=m (or 0: all rows)   | m rows in mini-batch order, untrimmed          | [m, P + N]             |
| (share_prompts=false)                 |                                                |                        |
| micro_batch_tokens=T                  | rows sorted by length, cut into runs of        | [k, max p + max n]     |
| (share_prompts=false)                 | k * (max p + max n) <= T; trimmed to that      |                        |
| micro_batch_tokens=T, pack_sequences  | rows concatenated, sum(p_i + n_i) <= T         | [1, sum(p_i + n_i)]    |
| (share_prompts=false)                 | (first-fit decreasing), padding dropped        | block-diagonal causal  |
| share_prompts, micro_batch_size=m     | m rows in mini-batch order; per prompt group   | [R, W]: W = longest    |
|                                       | the prompt once, then each response; groups    | row of groups          |
|                                       | packed into rows (rl/update/shared_layout.py)  | prompt + own response  |
| share_prompts, micro_batch_tokens=T   | prompt groups (split into pieces that repeat   | [R, W], R x W <= T     |
|                                       | the prompt when longer than T) first-fit       | prompt + own response  |
|                                       | decreasing into rows of W, R x W <= T          |                        |

share_prompts defaults to null: on for GRPO, off for PPO (rl/config.py); it does not compose with
pack_sequences (refused), which already concatenates rows into one sequence.

A row (shared: a prompt with one response) longer than T forms a micro-batch of its own. Rows
without a valid response token are left out: their loss, gradient and statistics are exactly 0
(losses are normalised by the mini-batch's global counts, rl/objectives/losses.py, so leaving them out or
splitting rows differently changes nothing but float rounding order).

FSDP's all-gathers and reduce-scatters run per forward/backward, so every DP rank must run the same
number of micro-batches per mini-batch (verl #6176). The token-budget plans (padded, packed or
shared) are agreed with one max all-reduce over DP; a rank with fewer splits its costliest
micro-batch in halves until it matches, and when no micro-batch has two rows left it adds fillers:
one row, one response column, its mask cleared, so it runs the collectives with a loss and a
gradient of exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel import comm
from rl.experience.rollout import Rollout


@dataclass
class PackedRows:
    """k rows concatenated into one sequence of T tokens (each row: its real prompt tokens, then its
    response up to its last valid token), and the M response tokens the head reads.

    input_ids, position_ids (each row's own positions), document_ids (0..k-1): [1, T].
    src_rows, src_cols: [M] local row and response column of each head token, in packed order.
    head_pos: [M] packed position of the hidden state that predicts it; targets: [M] its token id.
    The shared-prompt layout (rl/update/shared_layout.py) has R rows: inputs [R, T], `prefix_ids` [R, T]
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


def by_row_count(ro: Rollout, rows: torch.Tensor, size: int) -> list[MicroBatch]:
    """`size` rows per micro-batch in the given order (0: all), untrimmed: [m, P + N] each (the
    shared-prompt layout of the same plan: rl/update/shared_layout.py's `shared_by_row_count`)."""
    m = size or rows.numel()
    N = ro.response_mask.shape[1]
    return [MicroBatch(rows[i:i + m], ro.prompt_len, N) for i in range(0, rows.numel(), m)]


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


def split_to(groups: list, count: int, cost, size=len, halve=None) -> list:
    """`groups` split until there are `count`: the costliest group of `size` >= 2 rows into halves
    (`halve(g)` -> two groups; default: its first and second half), then None (a filler) for each
    one still missing."""
    halve = halve or (lambda g: (g[:len(g) // 2], g[len(g) // 2:]))
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [j for j, g in enumerate(groups) if size(g) > 1]
        if not splittable:
            break
        j = max(splittable, key=lambda j: cost(groups[j]))
        groups[j:j + 1] = list(halve(groups[j]))
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
    count = agreed_count(len(groups), rows.device, dp_group)
    cost = (lambda g: _packed_cost(g, p, n)) if packed else (lambda g: _padded_cost(g, p, n))
    out = []
    for g in split_to(groups, count, cost):
        if g is None:
            out.append(filler(rows, p[ids[0]]))
            continue
        idx = torch.tensor(g, dtype=torch.long, device=rows.device)
        pk = pack_rows(ro, g, [p[i] for i in g], [n[i] for i in g]) if packed else None
        out.append(MicroBatch(idx, max(p[i] for i in g), max(n[i] for i in g), packed=pk))
    return out


def agreed_count(local: int, device, dp_group=None) -> int:
    """The micro-batch count every DP rank runs: the largest rank's `local` (at least 1)."""
    count = torch.tensor([max(local, 1)], dtype=torch.int64, device=device)
    comm.all_reduce(count, "max", dp_group)  # every DP rank runs as many micro-batches (FSDP steps in unison)
    return int(count)


def filler(rows: torch.Tensor, prompt_cols: int) -> MicroBatch:
    """A zero-weight stand-in: the mini-batch's first row [1], one response column, its mask cleared."""
    return MicroBatch(rows[:1], prompt_cols, 1, filler=True)


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
