"""Tensor-parallel communication: the conjugate autograd collectives and a collective counter.

The four autograd functions come in conjugate pairs (Megatron's "f" and "g"):

| function          | forward                        | backward                        |
|-------------------|--------------------------------|---------------------------------|
| `copy_to_tp`  (f) | identity                       | all-reduce(SUM) over tp_group   |
| `reduce_from_tp` (g) | all-reduce(SUM) over tp_group | identity                        |
| `split_to_tp`     | keep this rank's slice of dim  | all-gather along dim            |
| `gather_from_tp`  | all-gather along dim           | keep this rank's slice of dim   |

The sequence-parallel pair (all-gather / reduce-scatter along the sequence) is in
`parallel.seq_comm`. Every collective in kltron goes through `all_reduce`, `all_gather_along`,
`reduce_scatter_along` or `broadcast` below, so
`CommCounter` sees each call's kind and payload bytes. With `tp_group=None` or a group of size 1
(single process, or tp=1) they are identities and no collective is issued, so the same code runs
without `torch.distributed` initialised.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel import invariant

# ---------------------------------------------------------------------------------------------
# counting


@dataclass
class CommRecord:
    kind: str  # "all_reduce:sum", "all_gather", "broadcast", ...
    nbytes: int  # payload bytes this rank contributes
    shape: tuple
    dtype: torch.dtype
    group_size: int


@dataclass
class CommCounter:
    """Collects one `CommRecord` per collective issued while it is active."""

    records: list[CommRecord] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.records)

    @property
    def bytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def by_kind(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for r in self.records:
            n, b = out.get(r.kind, (0, 0))
            out[r.kind] = (n + 1, b + r.nbytes)
        return out

    def max_numel(self) -> int:
        return max((int(torch.Size(r.shape).numel()) for r in self.records), default=0)


_active_counters: list[CommCounter] = []


@contextlib.contextmanager
def count_comm():
    """`with count_comm() as c: ...` records every kltron collective issued inside the block."""
    counter = CommCounter()
    _active_counters.append(counter)
    try:
        yield counter
    finally:
        _active_counters.remove(counter)


def _record(kind: str, t: torch.Tensor, group_size: int) -> None:
    if not _active_counters:
        return
    rec = CommRecord(kind, t.numel() * t.element_size(), tuple(t.shape), t.dtype, group_size)
    for c in _active_counters:
        c.records.append(rec)


# ---------------------------------------------------------------------------------------------
# raw, counted collectives (no autograd)


def group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def collective_device(group=None) -> torch.device:
    """Where a bookkeeping tensor for a collective over `group` must live: the current CUDA device
    under NCCL (which takes no CPU tensors), else the CPU (gloo, or a single rank)."""
    if group_size(group) > 1 and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In-place all-reduce of `t` over `group` (op: sum, max, min); returns `t`."""
    n = group_size(group)
    if n == 1:
        return t
    _record(f"all_reduce:{op}", t, n)
    dist.all_reduce(t, op=_OPS[op], group=group)
    return t


def all_gather_along(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (all ranks must pass the same shape)."""
    n = group_size(group)
    if n == 1:
        return t
    _record("all_gather", t, n)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_along(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Sum every rank's `t` and keep this rank's contiguous slice along `dim` (size divisible by
    the group size): the reduce half of an all-reduce, 1/n of its result per rank."""
    n = group_size(group)
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split evenly over {n} ranks")
    _record("reduce_scatter:sum", t, n)
    parts = [c.contiguous() for c in t.chunk(n, dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def broadcast(t: torch.Tensor, src_group_rank: int = 0, group=None) -> torch.Tensor:
    """In-place broadcast from the rank whose rank *within group* is `src_group_rank`."""
    n = group_size(group)
    if n == 1:
        return t
    _record("broadcast", t, n)
    dist.broadcast(t, src=dist.get_global_rank(group, src_group_rank), group=group)
    return t


def split_along(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's contiguous slice of `t` along `dim` (size must divide evenly)."""
    n = group_size(group)
    if n == 1:
        return t
    size = t.shape[dim]
    if size % n:
        raise ValueError(f"dimension {dim} of size {size} does not split evenly over {n} ranks")
    return t.narrow(dim, group_rank(group) * (size // n), size // n).contiguous()


# ---------------------------------------------------------------------------------------------
# autograd collectives


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward sums the input-gradients every TP rank computed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # each rank's column shard produced a partial dL/dx; the true gradient is their sum
        return all_reduce(grad.contiguous(), "sum", ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: sums row-parallel partial outputs forward; backward passes the gradient through."""

    @staticmethod
    def forward(ctx, x, group):
        # each rank holds a partial product over its slice of the input features; sum them
        if invariant.enabled() and group_size(group) > 1:
            return ordered_sum(x, group)
        return all_reduce(x.contiguous().clone(), "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        # the input was replicated; reassemble the full gradient from every rank's slice
        return all_gather_along(grad.contiguous(), ctx.dim, ctx.group), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        # concatenate the shards so every rank sees the full tensor
        return all_gather_along(x.contiguous(), dim, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.dim, ctx.group), None, None


def ordered_sum(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over `group` of x, added in rank order (batch-invariant mode): a ring all-reduce adds
    an element's partial sums in an order set by the chunk it falls in, i.e. by the tensor's size,
    so one token's row would round differently in a decode step and in a full forward."""
    parts = all_gather_along(x.contiguous()[None], 0, group)
    out = parts[0].clone()
    for r in range(1, parts.shape[0]):
        out += parts[r]
    return out


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def split_to_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _SplitToTP.apply(x, dim % x.dim(), group)


def gather_from_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, dim % x.dim(), group)
