"""Parallel layout: `ParallelDims(dp, tp, cp)` validated by arithmetic, the ("dp", "tp") mesh --
("dp", "cp", "tp") with context parallelism -- and its sub-groups, this rank's device, seeding
(`seed_everything`, `derive_seed`).

Rank layout: tp is the fastest-varying dimension, so the ranks of one TP group are adjacent (on
one node, over NVLink), then cp (the ranks that split one sequence: parallel/context.py), and DP
spans nodes. Global rank = (dp_rank * cp + cp_rank) * tp + tp_rank. FSDP2 shards parameters over
dp x cp (the flattened "dp_cp" mesh, as torchtitan does): the cp ranks of a dp replica hold the
same parameters and see different tokens, so their gradients are summed like dp's.

Validation is pure arithmetic on numbers every rank already has, so a bad layout raises the same
error on every rank before any collective is issued and nothing hangs.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


class LayoutError(ValueError):
    """A parallel layout that cannot work with this world size or model."""


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    cp: int = 1  # context parallel: ranks that split each sequence (parallel/context.py)

    def validate(self, world_size: int | None = None, n_heads: int | None = None,
                 n_kv_heads: int | None = None) -> ParallelDims:
        """Raise `LayoutError` naming the numbers when the layout cannot work; return self."""
        for name, v in (("dp", self.dp), ("tp", self.tp), ("cp", self.cp)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LayoutError(f"parallel.{name} must be a positive integer, got {v!r}")
        if world_size is not None and self.dp * self.cp * self.tp != world_size:
            if self.cp == 1:
                raise LayoutError(
                    f"dp * tp must equal the world size: dp={self.dp} * tp={self.tp} = "
                    f"{self.dp * self.tp}, but the world size is {world_size}")
            raise LayoutError(
                f"dp * cp * tp must equal the world size: dp={self.dp} * cp={self.cp} * tp={self.tp} = "
                f"{self.dp * self.cp * self.tp}, but the world size is {world_size}")
        if n_heads is not None and n_heads % self.tp:
            raise LayoutError(
                f"tp={self.tp} must divide the number of attention heads n_heads={n_heads}")
        if n_kv_heads is not None:
            if n_kv_heads % self.tp and self.tp % n_kv_heads:
                raise LayoutError(
                    f"tp={self.tp} and n_kv_heads={n_kv_heads}: one must divide the other "
                    "(tp > n_kv_heads replicates KV heads, which needs tp % n_kv_heads == 0)")
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp


def backend_for(device: torch.device | str) -> str:
    """nccl for CUDA devices, gloo for CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def launch_world_size() -> int:
    """The number of ranks of this launch: the process group's size, else torchrun's WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_device(name: str = "auto") -> torch.device:
    """`train.device` -> this rank's device: "auto" is CUDA when available, else CPU; "cuda" is
    the GPU of this rank's LOCAL_RANK; anything else is passed to `torch.device`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


@dataclass
class ParallelState:
    """Everything a component needs to know about where it runs. Passed explicitly, never global."""

    dims: ParallelDims
    device: torch.device
    mesh: object | None  # torch DeviceMesh ("dp", "tp"), ("dp", "cp", "tp") when cp > 1, or None in a single process
    tp_group: object | None
    dp_group: object | None
    tp_rank: int = 0
    dp_rank: int = 0
    rank: int = 0
    cp_group: object | None = None  # the ranks that split one sequence (None when cp == 1)
    cp_rank: int = 0
    dp_cp_group: object | None = None  # dp x cp: where gradients are summed and parameters sharded (cp > 1)
    _fsdp_mesh: object | None = None

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_mesh(self):
        """The 1-D mesh FSDP2 shards over: "dp", or the flattened "dp_cp" when cp > 1."""
        if self.mesh is None:
            return None
        if self.dims.cp == 1:
            return self.mesh["dp"]
        if self._fsdp_mesh is None:
            self._fsdp_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
        return self._fsdp_mesh

    @property
    def grad_group(self):
        """The group gradients are summed over and grad norms reduced over: dp, or dp x cp."""
        return self.dp_group if self.dims.cp == 1 else self.dp_cp_group


def init_parallel(dims: ParallelDims, device: torch.device | str | None = None, n_heads: int | None = None,
                  n_kv_heads: int | None = None, timeout_s: float | None = None) -> ParallelState:
    """Validate `dims` against the launch and the model, then build the ("dp", "tp") mesh.

    Under `torchrun` (or any launcher that initialised `torch.distributed` or set WORLD_SIZE) the
    process group is created here if needed with the backend for `device`. In a plain single
    process with dp = tp = 1 nothing distributed is created: groups are None and every
    collective is an identity. `timeout_s` (`parallel.timeout_s`) bounds every collective: a rank
    that waits longer for a frozen peer raises instead of blocking for torch's default 30 minutes.
    """
    device = torch.device(device) if device is not None else resolve_device("auto")
    world = launch_world_size()
    dims.validate(world, n_heads, n_kv_heads)  # before any collective, identical on every rank
    if world == 1 and not dist.is_initialized():
        return ParallelState(dims, device, None, None, None)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        dist.init_process_group(backend=backend_for(device), **kw)
    rank = dist.get_rank()
    if dims.cp == 1:
        mesh = init_device_mesh(device.type, (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
        return ParallelState(dims, device, mesh, mesh.get_group("tp"), mesh.get_group("dp"),
                             tp_rank=rank % dims.tp, dp_rank=rank // dims.tp, rank=rank)
    mesh = init_device_mesh(device.type, (dims.dp, dims.cp, dims.tp), mesh_dim_names=("dp", "cp", "tp"))
    state = ParallelState(dims, device, mesh, mesh.get_group("tp"), mesh.get_group("dp"),
                          tp_rank=rank % dims.tp, dp_rank=rank // (dims.cp * dims.tp), rank=rank,
                          cp_group=mesh.get_group("cp"), cp_rank=(rank // dims.tp) % dims.cp)
    state.dp_cp_group = state.dp_mesh.get_group()
    return state


SEED_MIX = 1_000_003  # a prime above any step, epoch or row count a key takes, so small keys do not collide


def derive_seed(*keys: int) -> int:
    """One seed from integer keys, e.g. `derive_seed(train.seed, epoch)`: the fold
    h = keys[0]; h = h * SEED_MIX + k for each further key, returned modulo 2**63, a non-negative
    int that `torch.Generator.manual_seed` and `random.Random` both take. For non-negative keys
    whose fold stays below 2**63 the modulo is the identity, so `derive_seed(s, e)` is exactly the
    `s * 1_000_003 + e` the data order, rollout prompts and model init used before."""
    if not keys:
        raise ValueError("derive_seed needs at least one key")
    h = 0
    for i, k in enumerate(keys):
        if not isinstance(k, int) or isinstance(k, bool):
            raise TypeError(f"derive_seed key {i} must be an int, got {type(k).__name__} {k!r}")
        h = k if i == 0 else h * SEED_MIX + k
    return h % 2**63


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch. Model init derives its own generators from the seed
    (layout independent), so this only governs what is meant to be the same on every rank."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def tp_subgroup(state: ParallelState, size: int):
    """The group of `size` consecutive TP ranks this rank belongs to (ranks sharing a replica,
    e.g. a KV head when tp > n_kv_heads). Every rank must call this with the same `size`, since
    `new_group` is collective over the world. Returns None when `size` is 1 or not distributed."""
    tp = state.dims.tp
    if size == 1 or state.mesh is None:
        return None
    if tp % size:
        raise LayoutError(f"a TP subgroup of {size} ranks does not divide tp={tp}")
    mine = None
    for replica in range(state.dims.dp * state.dims.cp):  # each (dp, cp) coordinate has its own TP group
        for first in range(0, tp, size):
            ranks = [replica * tp + first + i for i in range(size)]
            g = dist.new_group(ranks)
            if state.rank in ranks:
                mine = g
    return mine


def kv_replica_group(state: ParallelState, n_kv_heads: int):
    """The group of TP ranks that hold the same KV head (tp > n_kv_heads: tp // n_kv_heads ranks
    each), which sums the replicated K/V projections' gradients; None when every rank holds its own
    KV heads. Collective over the world (`new_group`): every rank calls it, with the same model."""
    tp = state.dims.tp
    return tp_subgroup(state, tp // n_kv_heads) if tp > n_kv_heads else None
