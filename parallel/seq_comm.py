"""Sequence parallelism (Megatron's): the conjugate autograd collectives along the sequence.

With `parallel.sequence_parallel` the regions between the tensor-parallel pairs (RMSNorms, residual
adds, the embedding's output) hold this rank's slice of the sequence, [B, S/tp, H], instead of a
replica of [B, S, H]. The "f" / "g" pair of `parallel.comm` becomes:

| function                 | forward                             | backward                            |
|--------------------------|-------------------------------------|-------------------------------------|
| `gather_seq`   (f, SP)   | all-gather along the sequence       | reduce-scatter(SUM) along sequence  |
| `scatter_seq`  (g, SP)   | reduce-scatter(SUM) along sequence  | all-gather along the sequence       |
| `gather_from_tp(dim=1)`  | all-gather along the sequence       | keep this rank's slice              |

`gather_seq` stands before the column-parallel linears (q, k, v; gate, up), `scatter_seq` after the
row-parallel ones (wo, w_down) and the vocab-parallel embedding. An all-reduce is a reduce-scatter
followed by an all-gather, so the pair moves the same bytes as the all-reduce it replaces; what
it buys is that the norms, residuals and their saved activations shrink to 1/tp per rank.

Before the LM head the normed hidden states are gathered with `parallel.comm.gather_from_tp` (the
backward keeps this rank's slice, no sum): a vocab-parallel head passes them through `copy_to_tp`,
whose backward already all-reduces dL/dhidden, and a replicated head (a value head) computes the
same dL/dhidden on every rank; a reduce-scatter there would count every gradient tp times.

The norms' weights see only this rank's tokens: their gradients are partial and must be summed over
tp (`reduce_grad_over_tp`). With tp = 1 or no group everything here is an identity.
"""

from __future__ import annotations

import torch

from parallel import invariant
from parallel.comm import all_gather_along, copy_to_tp, group_size, ordered_sum, reduce_scatter_along, split_along
from parallel.dims import LayoutError


class SequenceSplitError(LayoutError):
    """A sequence that does not split evenly over the tensor-parallel ranks (pure arithmetic on S and tp,
    so every rank raises it before the collective)."""


class _GatherSeq(torch.autograd.Function):
    """f under SP: all-gather the sequence shards before the column-parallel linears."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        # the column shards need every token: each rank holds only its slice of the sequence
        return all_gather_along(x.contiguous(), dim, group)

    @staticmethod
    def backward(ctx, grad):
        # each rank's column shard produced a partial dL/dx for every token: sum them, and each rank
        # keeps the tokens it owns (the reduce-scatter replacing f's all-reduce)
        return reduce_scatter_along(grad.contiguous(), ctx.dim, ctx.group), None, None


class _ScatterSeq(torch.autograd.Function):
    """g under SP: sum the row-parallel partial outputs, each rank keeping its slice of the sequence."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        # each rank holds a partial product over its slice of the input features for every token
        if invariant.enabled():  # added in rank order, the bits of g's ordered sum (parallel/comm.py)
            return split_along(ordered_sum(x, group), dim, group)
        return reduce_scatter_along(x.contiguous(), dim, group)

    @staticmethod
    def backward(ctx, grad):
        # the row shards need dL/dy for every token, and each rank holds only its tokens' part
        return all_gather_along(grad.contiguous(), ctx.dim, ctx.group), None, None


def check_sequence_split(seq_len: int, group) -> None:
    """Raise `SequenceSplitError` naming S and tp when S does not split evenly over `group`."""
    tp = group_size(group)
    if seq_len % tp:
        raise SequenceSplitError(
            f"sequence parallelism splits the sequence over tp: S={seq_len} is not divisible by tp={tp} "
            "(the model pads its input to a multiple of tp; a direct caller must too)")


def gather_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """[B, S/tp, H] -> [B, S, H]; backward: reduce-scatter of dL/dx along `dim`."""
    if group_size(group) == 1:
        return x
    return _GatherSeq.apply(x, dim % x.dim(), group)


def scatter_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Partial [B, S, H] -> the sum's [B, S/tp, H] slice of this rank; backward: all-gather."""
    if group_size(group) == 1:
        return x
    check_sequence_split(x.shape[dim], group)
    return _ScatterSeq.apply(x, dim % x.dim(), group)


def reduce_grad_over_tp(w: torch.Tensor, group) -> torch.Tensor:
    """Use `w` (a weight applied to this rank's tokens only, e.g. an RMSNorm's) so that its gradient is
    summed over tp in backward: the "f" collective on a weight, as for a KV head shared by TP ranks.
    Under FSDP2 `w` is the gathered parameter, so the sum happens before FSDP's reduce-scatter over dp."""
    return copy_to_tp(w, group)
