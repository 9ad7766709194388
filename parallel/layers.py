"""Tensor-parallel layers built on the conjugate collectives of `parallel.comm`.

Each layer holds plain local tensors (its TP shard); FSDP2 may shard them further over dp.
Weights are created empty here; the model fills them (layout-independent initialisation or a
checkpoint), so these classes carry no init policy.

| layer / function        | weight (local)        | input            | output              | collectives          |
|-------------------------|-----------------------|------------------|---------------------|----------------------|
| ColumnParallelLinear    | [out/tp, in]          | [*, in] replic.  | [*, out/tp] sharded | f on x (bwd all-red)*|
| RowParallelLinear       | [out, in/tp]          | [*, in/tp] shard | [*, out] replicated | g (fwd all-red)      |
| VocabParallelEmbedding  | [Vp/tp, H]            | [*] global ids   | [*, H] replicated   | g (fwd all-red)      |
| vocab_parallel_logits() | [Vp/tp, H] (or tied)  | [*, H] replic.   | [*, Vp/tp] sharded  | f (bwd all-red)      |

* by the caller, once for all the column-parallel layers reading the same x (q, k, v; gate, up),
  or by the layer itself when built with `copy_input=True`.

Sequence parallelism (`seq_parallel=True`; parallel/seq_comm.py): `column_parallel` gathers the
sequence before the column-parallel layers (and keeps only this rank's slice for their backward),
and the row-parallel layer and the embedding end in a reduce-scatter along the sequence (dim 1 of
[B, S, H]) instead of g's all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel import invariant
from parallel.comm import all_gather_along, copy_to_tp, group_rank, group_size, reduce_from_tp, reduce_scatter_along
from parallel.fused import head_logits
from parallel.seq_comm import gather_seq, scatter_seq


def tie_replicas(w: torch.Tensor, replica_group) -> torch.Tensor:
    """Use `w` in forward so that its gradient is summed over `replica_group` in backward: the
    replicas of one weight (a KV head shared by several TP ranks) each saw part of the heads.
    This is the "f" collective of `parallel.comm`, applied to a weight instead of an activation."""
    return copy_to_tp(w, replica_group)


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T (+ b_local). Output features sharded over `tp_group`.

    `local_out_features` is the shard height (out_features / tp, or a replicated KV head's rows);
    `replica_group` names the ranks holding the same shard (their gradients are summed).
    The input x must already be the output of `copy_to_tp` (the "f" collective, whose backward
    all-reduces dL/dx): the caller applies it once for all the column-parallel layers reading x
    (q, k, v; gate, up), so backward all-reduces dL/dx once. `copy_input=True` makes the layer apply
    it itself, for a layer that alone reads its input.
    """

    def __init__(self, in_features: int, local_out_features: int, tp_group=None, bias: bool = False,
                 replica_group=None, copy_input: bool = False, device=None, dtype=None):
        super().__init__()
        self.tp_group, self.replica_group, self.copy_input = tp_group, replica_group, copy_input
        self.weight = nn.Parameter(torch.empty(local_out_features, in_features, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(local_out_features, device=device, dtype=dtype))
                     if bias else None)
        self.lora = None  # a parallel.lora.LoRAAdapter, attached by apply_lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp(x, self.tp_group)  # backward: every shard contributed a partial dL/dx
        w, b = tie_replicas(self.weight, self.replica_group), self.bias
        if b is not None:
            b = tie_replicas(b, self.replica_group)
        y = linear(x, w, b)
        if self.lora is not None and self.lora.enabled:  # parallel/lora.py: x is already past "f"
            y = y + self.lora(x)
        return y


class RowParallelLinear(nn.Module):
    """y = sum over tp of x_local @ W_local^T. Input features sharded, output replicated. No bias
    (Llama-family models have none on the output projections)."""

    def __init__(self, local_in_features: int, out_features: int, tp_group=None, device=None, dtype=None):
        super().__init__()
        self.tp_group = tp_group
        self.weight = nn.Parameter(torch.empty(out_features, local_in_features, device=device, dtype=dtype))
        self.lora = None  # a parallel.lora.LoRAAdapter, attached by apply_lora

    def forward(self, x_local: torch.Tensor, seq_parallel: bool = False) -> torch.Tensor:
        y = linear(x_local, self.weight)
        if self.lora is not None and self.lora.enabled:  # parallel/lora.py: partial, summed by the same g
            y = y + self.lora(x_local)
        # each rank multiplied its slice of the input features: sum the partial outputs
        if seq_parallel:  # [B, S, H] partial -> this rank's [B, S/tp, H] of the sum
            return scatter_seq(y, self.tp_group)
        return reduce_from_tp(y, self.tp_group)


class VocabParallelEmbedding(nn.Module):
    """Embedding table sharded on the (padded) vocabulary: rank r owns ids [r*Vp/tp, (r+1)*Vp/tp)."""

    def __init__(self, padded_vocab: int, hidden: int, tp_group=None, device=None, dtype=None):
        super().__init__()
        self.tp_group = tp_group
        tp = group_size(tp_group)
        if padded_vocab % tp:
            raise ValueError(f"padded vocabulary {padded_vocab} is not a multiple of tp={tp}")
        self.local_vocab = padded_vocab // tp
        self.vocab_start = group_rank(tp_group) * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden, device=device, dtype=dtype))

    def forward(self, ids: torch.Tensor, seq_parallel: bool = False) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        # exactly one rank owns each id; the sum delivers every row to every rank (under sequence
        # parallelism: each rank's tokens to it, [B, S/tp, H])
        if seq_parallel:
            return scatter_seq(out, self.tp_group)
        return reduce_from_tp(out, self.tp_group)


def vocab_parallel_logits(hidden: torch.Tensor, weight_local: torch.Tensor, tp_group=None) -> torch.Tensor:
    """hidden [*, H] replicated over tp -> logits_local [*, Vp/tp], sharded on the vocabulary.
    Padded columns come out as 0 here; the vocab-parallel functions exclude them by vocab_size."""
    hidden = copy_to_tp(hidden, tp_group)  # backward: sum of every shard's dL/dhidden
    if invariant.enabled():  # the fused heads' logits, bit for bit (fp32 for a bf16 weight, rows padded)
        return head_logits(hidden, weight_local, tp_group)
    return F.linear(hidden, weight_local)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or its batch-invariant form while parallel.invariant's mode is on."""
    return invariant.inv_linear(x, w, b) if invariant.enabled() else F.linear(x, w, b)


def column_parallel(x: torch.Tensor, layers, tp_group, seq_parallel: bool = False) -> list[torch.Tensor]:
    """The column-parallel `layers` (q, k, v; gate, up) reading one input, "f" applied once: x replicated
    [B, S, H] through `copy_to_tp`; with `seq_parallel`, x this rank's [B, S/tp, H], gathered along the
    sequence. The gathered path keeps x's slice, not the gathered x, for the weight gradients and gathers
    it again in backward (Megatron's way; `_GatherLinears`), unless an adapter or the batch-invariant
    mode needs the layers' own forward (then autograd keeps the gathered x, as `gather_seq` does)."""
    if not seq_parallel or group_size(tp_group) == 1:
        x = copy_to_tp(x, tp_group)  # backward: every shard contributed a partial dL/dx; one all-reduce for all
        return [layer(x) for layer in layers]
    if invariant.enabled() or any(layer.lora is not None and layer.lora.enabled for layer in layers):
        x = gather_seq(x, tp_group)
        return [layer(x) for layer in layers]
    ws = [tie_replicas(layer.weight, layer.replica_group) for layer in layers]
    bs = [None if layer.bias is None else tie_replicas(layer.bias, layer.replica_group) for layer in layers]
    return list(_GatherLinears.apply(x, tp_group, len(layers), *ws, *bs))


class _GatherLinears(torch.autograd.Function):
    """All-gather along the sequence, then y_i = x W_i^T (+ b_i) for every layer, as one node that saves
    this rank's [B, S/tp, H] slice of x instead of the gathered [B, S, H]: backward gathers it again for
    dW_i = dy_i^T x, and reduce-scatters dL/dx = sum_i dy_i W_i along the sequence. Under autocast the
    slice is cast to the autocast dtype before the gather (what F.linear would cast) and the products run
    in it; dL/dx is summed in x's own dtype, as autograd sums the separate casts' gradients."""

    @staticmethod
    def forward(ctx, x_local, group, n, *wb):
        dev = x_local.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_local.dtype
        ctx.group, ctx.in_dtype, ctx.dtype = group, x_local.dtype, dtype
        ws, bs = wb[:n], wb[n:]
        ctx.bias_dtypes = [None if b is None else b.dtype for b in bs]
        x_local = x_local.to(dtype).contiguous()
        x = all_gather_along(x_local, 1, group)
        ctx.save_for_backward(x_local, *ws)
        return tuple(F.linear(x, w.to(dtype), None if b is None else b.to(dtype)) for w, b in zip(ws, bs))

    @staticmethod
    def backward(ctx, *grads):
        x_local, *ws = ctx.saved_tensors
        x = all_gather_along(x_local, 1, ctx.group)  # the slice kept in forward, gathered again
        x2 = x.reshape(-1, x.shape[-1])
        dx, dws, dbs = None, [], []
        for w, g, b_dtype in zip(ws, grads, ctx.bias_dtypes):
            g2 = g.reshape(-1, g.shape[-1]).to(ctx.dtype)
            d = (g2 @ w.to(ctx.dtype)).to(ctx.in_dtype)
            dx = d if dx is None else dx + d
            dws.append((g2.t() @ x2).to(w.dtype))
            dbs.append(None if b_dtype is None else g2.sum(0).to(b_dtype))
        # every rank's column shards gave a partial dL/dx for every token: sum, keep this rank's tokens
        dx_local = reduce_scatter_along(dx.view(*x.shape[:-1], -1), 1, ctx.group)
        return (dx_local, None, None, *dws, *dbs)
