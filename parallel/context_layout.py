"""Context parallelism's arithmetic (parallel/context.py): the load-balanced layout of a sequence over
the cp ranks, the visibility rule of attention by global index and document, and the layout checks.
Pure functions of sizes and indices; no communication.
"""

from __future__ import annotations

import torch

from parallel.dims import LayoutError

IMPLS = ("ulysses", "ring")


def check_context(cp: int, impl: str, tp: int = 1, n_heads: int | None = None, n_kv_heads: int | None = None) -> None:
    """Raise `LayoutError` naming the numbers when `parallel.cp` / `parallel.cp_impl` cannot run this model."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise LayoutError(f"parallel.cp must be a positive integer, got {cp!r}")
    if impl not in IMPLS:
        raise LayoutError(f"parallel.cp_impl must be one of {IMPLS}, got {impl!r}")
    if cp == 1 or impl != "ulysses" or n_heads is None:
        return
    nh_l = n_heads // tp
    if nh_l % cp:
        raise LayoutError(f"parallel.cp_impl=ulysses shards the heads of each TP rank over cp: n_heads={n_heads} / "
                          f"tp={tp} = {nh_l} heads per rank, not divisible by cp={cp}; use parallel.cp_impl=ring")
    if n_kv_heads is not None:
        nkv_l = max(n_kv_heads // tp, 1)
        if nkv_l % cp and cp % nkv_l:
            raise LayoutError(f"parallel.cp_impl=ulysses: {nkv_l} KV heads per TP rank (n_kv_heads={n_kv_heads}, "
                              f"tp={tp}) and cp={cp}: one must divide the other (fewer KV heads than cp replicates "
                              "them); use parallel.cp_impl=ring")


def padded_len(S: int, cp: int, multiple: int = 1) -> int:
    """S rounded up to a multiple of 2*cp*multiple (the load-balanced chunking needs 2*cp equal chunks; with
    sequence parallelism inside TP, multiple = tp, so that each rank's 2 chunks split evenly over tp)."""
    m = 2 * cp * multiple
    return -(-S // m) * m


def balanced_index(S: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global token indices [S/cp] of rank `rank`: chunk `rank` then chunk 2*cp-1-rank of 2*cp chunks."""
    if S % (2 * cp):
        raise ValueError(f"context parallel: the sequence length {S} must be a multiple of 2*cp={2 * cp} "
                         "(pad it: parallel.context.padded_len)")
    c = S // (2 * cp)
    a = torch.arange(rank * c, (rank + 1) * c, device=device)
    b = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([a, b])


def visible(q_idx: torch.Tensor, k_idx: torch.Tensor, q_doc=None, k_doc=None, q_pre=None) -> torch.Tensor:
    """Bool [B|1, Sq, Sk]: key k visible to query q -- k_idx <= q_idx (global indices [Sq], [Sk]) and,
    with documents ([B, Sq], [B, Sk]), k in q's document or in q's prefix document."""
    causal = (k_idx[None, :] <= q_idx[:, None])[None]
    if q_doc is None:
        return causal
    same = k_doc[:, None, :] == q_doc[:, :, None]
    if q_pre is not None:
        same = same | (k_doc[:, None, :] == q_pre[:, :, None])
    return causal & same
