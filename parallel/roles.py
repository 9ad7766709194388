"""Disjoint rank roles in one launch: T trainer ranks, then R rollout ranks.

`split_roles(trainer, rollout, device, n_heads, n_kv_heads)` divides the world of one launch
(global ranks 0..T-1 train, T..T+R-1 generate) and builds, identically on every rank (every
`new_group` is collective over the world):

- each role's own ("dp", "tp") mesh and its TP / DP groups, and each role's group of all its ranks
  (the "world" that role's collectives, checkpoints and error broadcasts use: `ParallelState.group`);
- each role's KV-replica groups (tp > n_kv_heads), since a role cannot create groups on its own later;
- the weight-sync group: trainer rank 0 (global 0) and every rollout rank.

The trainer ranks come first, so a trainer rank's rank in its role equals its global rank: the
checkpoint writer (group rank 0) is global rank 0 in both readings.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from parallel.dims import LayoutError, ParallelDims, ParallelState

TRAINER, ROLLOUT = "trainer", "rollout"


@dataclass
class RoleLayout:
    """This rank's role and the groups that join the two roles."""

    role: str  # TRAINER or ROLLOUT
    state: ParallelState  # this rank's role: its dims, mesh, TP / DP groups, rank in the role, role group
    kv_group: object | None  # this role's KV-replica group of this rank (None unless tp > n_kv_heads)
    n_trainer: int
    n_rollout: int
    sync_group: object  # global rank 0 and every rollout rank: the weights are broadcast over it
    global_rank: int

    @property
    def is_trainer(self) -> bool:
        return self.role == TRAINER

    @property
    def rollout_leader(self) -> int:
        """Global rank of rollout rank 0: it gathers a step's rollout and sends it to the trainer ranks."""
        return self.n_trainer

    def role_of(self, global_rank: int) -> str:
        return TRAINER if global_rank < self.n_trainer else ROLLOUT

    def name(self, global_rank: int) -> str:
        """'rank 2 (rollout rank 0)': a global rank with its role and its rank in the role."""
        local = global_rank if global_rank < self.n_trainer else global_rank - self.n_trainer
        return f"rank {global_rank} ({self.role_of(global_rank)} rank {local})"

    def names(self) -> dict[int, str]:
        """Every global rank's role name, for messages (the watchdog's)."""
        return {r: self.name(r).split(" (", 1)[1][:-1] for r in range(self.n_trainer + self.n_rollout)}


def check_roles(trainer: ParallelDims, rollout: ParallelDims, world: int, n_heads: int | None = None,
                n_kv_heads: int | None = None) -> None:
    """LayoutError (pure arithmetic, the same on every rank) when the two layouts cannot share `world`."""
    if trainer.world_size + rollout.world_size != world:
        raise LayoutError(f"trainer ranks dp={trainer.dp} x tp={trainer.tp} plus rollout ranks dp={rollout.dp} x "
                          f"tp={rollout.tp} must make the world size {world}, got "
                          f"{trainer.world_size} + {rollout.world_size}")
    trainer.validate(None, n_heads, n_kv_heads)
    rollout.validate(None, n_heads, n_kv_heads)


def _mesh(device_type: str, first: int, dims: ParallelDims) -> DeviceMesh:
    ranks = torch.arange(first, first + dims.world_size, device="cpu").view(dims.dp, dims.tp)
    return DeviceMesh(device_type, ranks, mesh_dim_names=("dp", "tp"))


def _kv_groups(first: int, dims: ParallelDims, n_kv_heads: int | None, rank: int, kw: dict):
    """This role's KV-replica groups (every rank calls new_group for each); the one holding `rank`."""
    if n_kv_heads is None or dims.tp <= n_kv_heads:
        return None
    size, mine = dims.tp // n_kv_heads, None
    for dp_rank in range(dims.dp):
        for lo in range(0, dims.tp, size):
            ranks = [first + dp_rank * dims.tp + lo + i for i in range(size)]
            g = dist.new_group(ranks, **kw)
            if rank in ranks:
                mine = g
    return mine


def split_roles(trainer: ParallelDims, rollout: ParallelDims, device: torch.device, n_heads: int | None = None,
                n_kv_heads: int | None = None, timeout_s: float | None = None) -> RoleLayout:
    """Build both roles' meshes and groups (collective over the world: every rank calls it alike) and
    return this rank's RoleLayout. `timeout_s` bounds the collectives of the groups made here (torch's
    default for a new group is 30 minutes, not the world's timeout)."""
    kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    world, rank = dist.get_world_size(), dist.get_rank()
    check_roles(trainer, rollout, world, n_heads, n_kv_heads)
    T, R = trainer.world_size, rollout.world_size
    meshes = {TRAINER: _mesh(device.type, 0, trainer), ROLLOUT: _mesh(device.type, T, rollout)}
    groups = {TRAINER: dist.new_group(list(range(T)), **kw), ROLLOUT: dist.new_group(list(range(T, T + R)), **kw)}
    kv = {TRAINER: _kv_groups(0, trainer, n_kv_heads, rank, kw), ROLLOUT: _kv_groups(T, rollout, n_kv_heads, rank, kw)}
    sync = dist.new_group([0, *range(T, T + R)], **kw)
    role = TRAINER if rank < T else ROLLOUT
    dims, first = (trainer, 0) if role == TRAINER else (rollout, T)
    mesh, local = meshes[role], rank - first
    state = ParallelState(dims, device, mesh, mesh.get_group("tp"), mesh.get_group("dp"), tp_rank=local % dims.tp,
                          dp_rank=local // dims.tp, rank=local, group=groups[role])
    return RoleLayout(role, state, kv[role], T, R, sync, rank)
