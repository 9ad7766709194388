"""Context parallelism (CP): the cp ranks of a group split every sequence, each running the whole
model on its own tokens; only attention looks across ranks.

| tensor                  | shape             | layout                                           |
|-------------------------|-------------------|--------------------------------------------------|
| input_ids, position_ids | [B, S/cp]         | this rank's tokens (`ContextParallel.shard`)     |
| document_ids, prefix_ids| [B, S/cp]         | likewise (packed rows: the attention mask)       |
| q                       | [B, nh_l, S/cp, hd] | heads sharded over tp, tokens over cp          |
| k, v                    | [B, nkv_l, S/cp, hd] | likewise                                      |

Load balance. Under a causal mask the last tokens of a sequence attend to the most keys, so a
contiguous split would give the last rank cp times the work of the first. The sequence (length S,
a multiple of 2*cp; `padded_len`) is cut into 2*cp chunks of c = S / (2*cp) tokens, and rank r holds
chunk r and chunk 2*cp-1-r, in that order: every rank then holds the same number of
(query, key) pairs below the diagonal. `global_index(S)` is this rank's global token indices
[S/cp]: the position ids of its tokens, and what causality is decided by.

Attention. `ContextAttention` (built by `ContextParallel.attention`) is handed to the model in
place of a mask; its `attend(q, k, v)` runs one of:
  - ulysses (parallel/context_ulysses.py): one all-to-all turns q, k, v from sequence-sharded to
    head-sharded (each rank: nh_l/cp heads over the whole sequence), plain attention runs, and one
    all-to-all turns the output back. Needs cp | nh_l (= n_heads/tp); KV heads are replicated when
    nkv_l < cp (needs nkv_l | cp) and their gradients summed by the replication's backward;
  - ring (parallel/context_ring.py): q stays; the KV blocks travel around the ring of cp ranks,
    each step's partial attention merged by log-sum-exp; causal masking by global index; a
    hand-written backward passes the KV blocks around again with their gradient accumulators.
Documents (packed rows, shared prompts, padding): a key is visible to a query when it is not
later (global index) and its document is the query's document or the query's prefix document.

The causal label shift (a token's target is the next token, maybe on another rank) is the
caller's: shift the labels over the full sequence, then shard them like the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.comm import group_rank, group_size
from parallel.context_layout import IMPLS, balanced_index, check_context, padded_len, visible
from parallel.context_ring import ring_attention
from parallel.context_ulysses import ulysses_attention

__all__ = ["IMPLS", "ContextAttention", "ContextParallel", "balanced_index", "check_context", "padded_len", "visible"]


@dataclass
class ContextParallel:
    """The cp group of this rank and the attention it runs. `group` None: cp = 1 (a single rank)."""

    group: object = None
    impl: str = "ring"
    multiple: int = 1  # sequences padded to a multiple of 2*cp*multiple (tp under sequence parallelism)

    def __post_init__(self):
        check_context(self.size, self.impl)

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    def global_index(self, S: int, device=None) -> torch.Tensor:
        return balanced_index(S, self.size, self.rank, device)

    def shard(self, x: torch.Tensor, dim: int = 1, pad_value=0) -> torch.Tensor:
        """This rank's tokens of `x` along `dim` (padded with `pad_value` at the end to a multiple of
        2*cp*multiple)."""
        S = x.shape[dim]
        P = padded_len(S, self.size, self.multiple)
        if P != S:
            shape = list(x.shape)
            shape[dim] = P - S
            x = torch.cat([x, torch.full(shape, pad_value, dtype=x.dtype, device=x.device)], dim)
        return x.index_select(dim, self.global_index(P, x.device))

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's tokens `x` (no gradient; tests and small int tensors)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        S = x.shape[dim] * self.size
        order = torch.cat([balanced_index(S, self.size, r, x.device) for r in range(self.size)])
        return torch.cat(parts, dim).index_select(dim, torch.argsort(order))

    def attention(self, local_len: int, document_ids: torch.Tensor | None = None,
                  prefix_ids: torch.Tensor | None = None) -> ContextAttention:
        """The attention for this rank's `local_len` tokens (S = local_len * cp); document_ids and
        prefix_ids [B, local_len]: this rank's shard of the packed layout, or None (causal)."""
        if prefix_ids is not None and document_ids is None:
            raise ValueError("context parallel: prefix_ids need document_ids")
        return ContextAttention(self, local_len * self.size, document_ids, prefix_ids)


@dataclass
class ContextAttention:
    """What the model's attention calls under CP (passed where a mask goes)."""

    cp: ContextParallel
    seq_len: int  # S, global
    document_ids: torch.Tensor | None = None  # [B, S/cp] local
    prefix_ids: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, nh_l, S/cp, hd], k, v [B, nkv_l, S/cp, hd] (this rank's tokens) -> [B, nh_l, S/cp, hd]."""
        if self.cp.impl == "ulysses":
            return ulysses_attention(q, k, v, self)
        return ring_attention(q, k, v, self)
