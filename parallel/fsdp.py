"""FSDP2 over the data-parallel mesh, activation checkpointing, and frozen sharded copies.

Tensor parallelism here is not DTensor based: the TP layers hold plain local tensors (their TP
shard). `fully_shard` over the 1-D dp mesh shards each of those further along dim 0, so a
parameter's local storage on a rank is `[rows_tp_local / dp (ceil), ...]` and its `.grad` is a
DTensor on the dp mesh (use `.to_local()` for this rank's piece).

Order, as torchtitan: TP (done when the model is built) -> activation checkpointing per block ->
`fully_shard` per block -> `fully_shard` on the root (embedding, final norm, LM head).

Gradient reduction *sums* over dp (divide factor 1): callers normalise the loss by the global
token count, so the summed gradient is the gradient of the global mean. Without FSDP (dp == 1,
or `fsdp=False`) `sync_replicated_grads` does the same sum with one all-reduce per parameter.

This module knows nothing of models: it takes the root module and the list of blocks.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

from parallel.comm import all_reduce, group_size

MIXED_PRECISION = ("fp32", "bf16")


@dataclass(frozen=True)
class FSDPOptions:
    """What `parallelize` applies. mixed_precision "bf16": params gathered and computed in bf16,
    gradients reduced in fp32, fp32 master weights kept by the optimizer."""

    fsdp: bool = True
    mixed_precision: str = "fp32"
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    reshard_after_forward: bool = True

    def __post_init__(self):
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"parallel.mixed_precision must be one of {MIXED_PRECISION}, "
                             f"got {self.mixed_precision!r}")


def _blocks_of(model: nn.Module, blocks: Iterable[nn.Module] | None) -> list[nn.Module]:
    if blocks is not None:
        return list(blocks)
    if not hasattr(model, "layers"):
        raise TypeError(f"{type(model).__name__} has no .layers; pass blocks= explicitly")
    return list(model.layers)


def apply_activation_checkpointing(blocks: Iterable[nn.Module]) -> None:
    """Recompute each block's activations in backward (non-reentrant, composable: parameter names
    are unchanged). The recomputation re-issues the block's TP collectives in the same order on
    every rank, so it stays in step."""
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block)


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def apply_fsdp(model: nn.Module, dp_mesh, blocks: Iterable[nn.Module] | None = None,
               mixed_precision: str = "fp32", cpu_offload: bool = False,
               reshard_after_forward: bool = True) -> nn.Module:
    """`fully_shard` every block, then the root, over `dp_mesh` (1-D). Returns `model` (now an
    FSDPModule). Gradients are summed over dp (see the module docstring)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, got {mixed_precision!r}")
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if mixed_precision == "bf16" else MixedPrecisionPolicy())
    # pinned host memory needs CUDA; on a CPU-only machine offload is a no-op kept for testing
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    kw = dict(mesh=dp_mesh, mp_policy=mp, offload_policy=offload)
    blocks = _blocks_of(model, blocks)
    # a model that will run backward keeps the last block and the root gathered after forward
    # (backward needs them first); a frozen one (no backward) reshards everything
    training = any(p.requires_grad for p in model.parameters())
    for i, block in enumerate(blocks):
        keep = training and i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard_after_forward and not keep, **kw)
    fully_shard(model, reshard_after_forward=not training, **kw)
    for m in model.modules():
        if is_fsdp(m):
            m.set_gradient_divide_factor(1.0)  # sum over dp: the loss is already a global mean
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM/AVG)
    return model


def parallelize(model: nn.Module, dp_mesh, options: FSDPOptions = FSDPOptions(),
                blocks: Iterable[nn.Module] | None = None) -> nn.Module:
    """Apply activation checkpointing then FSDP2 as `options` say. FSDP is skipped when the dp
    mesh has one rank (or is None) or `options.fsdp` is False; then call `sync_replicated_grads`
    after backward if dp > 1. Returns `model` (modified in place)."""
    blocks = _blocks_of(model, blocks)
    if options.activation_checkpointing:
        apply_activation_checkpointing(blocks)
    if options.fsdp and dp_mesh is not None and dp_mesh.size() > 1:
        apply_fsdp(model, dp_mesh, blocks, options.mixed_precision, options.cpu_offload,
                   options.reshard_after_forward)
    return model


@torch.no_grad()
def sync_replicated_grads(model: nn.Module, dp_group) -> None:
    """Data parallel without FSDP: sum every gradient over `dp_group` (no-op for one rank)."""
    if group_size(dp_group) == 1 or is_fsdp(model):
        return
    for p in model.parameters():
        if p.grad is not None:
            # each dp rank saw a different part of the global batch; their gradients add up
            all_reduce(p.grad, "sum", dp_group)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """With FSDP, skip the reduce-scatter on micro-steps that only accumulate (enabled=False)."""
    if is_fsdp(model):
        model.set_requires_gradient_sync(enabled)


def freeze(model: nn.Module) -> nn.Module:
    """requires_grad False on every parameter and eval mode. Returns `model`."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def frozen_sharded_copy(model: nn.Module, dp_mesh, options: FSDPOptions = FSDPOptions(),
                        blocks_attr: str = "layers") -> nn.Module:
    """A frozen copy of an *unsharded* model (e.g. the RL reference), sharded over `dp_mesh` like
    the policy: requires_grad False, eval, no optimizer state; CPU offload if `options` say so.
    Pass the model before `parallelize` (its plain TP-local tensors), since FSDP modules are not
    copied. Activation checkpointing is never applied (no backward through the copy)."""
    if is_fsdp(model):
        raise TypeError("frozen_sharded_copy needs the model before fully_shard; build or load the "
                        "reference separately, or copy the policy before parallelize()")
    ref = freeze(copy.deepcopy(model))
    opts = FSDPOptions(fsdp=options.fsdp, mixed_precision=options.mixed_precision,
                       cpu_offload=options.cpu_offload, reshard_after_forward=True)
    return parallelize(ref, dp_mesh, opts, blocks=getattr(ref, blocks_attr))


def is_dtensor(t) -> bool:
    """True for a DTensor (an FSDP-sharded parameter), told without importing torch.distributed.tensor (about
    0.7 s of CPU, a third of every launched process's imports): no DTensor exists before it is imported."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a parameter or gradient: `.to_local()` for an FSDP DTensor, else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The TP-local tensor gathered over dp (collective over dp for a DTensor), else `t`."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
