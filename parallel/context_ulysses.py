"""Ulysses attention (parallel/context.py's `cp_impl=ulysses`): all-to-all from sequence-sharded to
head-sharded, plain attention over the whole sequence, all-to-all back.

Before: q [B, nh_l, S/cp, hd] (this rank's tokens, every local head). The heads are cut into cp
groups; group j goes to rank j, which receives every rank's tokens of its nh_l/cp heads, in rank
order, then puts them in sequence order (the inverse of the load-balanced layout): [B, nh_l/cp, S, hd].
Attention there is the single-rank attention (SDPA, causal, or under the document mask built from
the gathered document ids [B, S] -- integers, the only extra traffic), and the output goes back by
the conjugate all-to-all. Each all-to-all's backward is the other one.

KV heads: with nkv_l (= max(n_kv_heads/tp, 1)) KV heads per TP rank, nkv_l >= cp splits them like
the queries (cp | nkv_l). nkv_l < cp replicates each KV head cp/nkv_l times before the all-to-all
(`repeat_interleave`, whose backward sums the copies' gradients), so every rank gets the KV head of
its query heads; any other combination is refused by `check_context` (use the ring). Query head i
uses KV head i // (nh_l/nkv_l) throughout, as `enable_gqa` does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.context_layout import balanced_index, visible


def _a2a(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    inp = torch.stack(x.chunk(n, scatter_dim), 0).contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)
    return torch.cat(out.unbind(0), gather_dim)


class _AllToAll(torch.autograd.Function):
    """Split `scatter_dim` over the group, concatenate what arrives along `gather_dim`; backward: the reverse."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _a2a(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        s, g = ctx.dims
        return _a2a(grad, g, s, ctx.group), None, None, None


def _rank_order(S: int, n: int, device) -> torch.Tensor:
    """Global indices of the rank-ordered concatenation of every rank's tokens [S]."""
    return torch.cat([balanced_index(S, n, r, device) for r in range(n)])


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, att) -> torch.Tensor:
    cp = att.cp
    n, group = cp.size, cp.group
    nh, nkv = q.shape[1], k.shape[1]
    if nh % n or (nkv % n and n % nkv):
        raise ValueError(f"ulysses attention: {nh} query / {nkv} KV heads per rank and cp={n} "
                         "(see parallel.context.check_context)")
    if nkv < n:  # replicate KV heads: rank j gets the KV head of its query heads
        k, v = k.repeat_interleave(n // nkv, dim=1), v.repeat_interleave(n // nkv, dim=1)
    S = att.seq_len
    order = _rank_order(S, n, q.device)
    inv = torch.argsort(order)
    to_heads = lambda x: _AllToAll.apply(x, 1, 2, group).index_select(2, inv)  # (B, h/n, S, hd), sequence order
    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    gqa = qh.shape[1] != kh.shape[1]
    if att.document_ids is None:
        y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        doc = cp.gather(att.document_ids)
        pre = doc if att.prefix_ids is None else cp.gather(att.prefix_ids)
        idx = torch.arange(S, device=q.device)
        mask = visible(idx, idx, doc, doc, pre).unsqueeze(1)  # (B, 1, S, S)
        y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return _AllToAll.apply(y.index_select(2, order), 2, 1, group)  # (B, nh, S/n, hd)
