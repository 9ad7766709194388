"""Trainer -> rollout weight sync over torch.distributed, resharding between the two TP layouts.

Every weight sync is a message on the sync group (global rank 0 = trainer rank 0, and every rollout
rank), from rank 0: a fixed int64 header (`kind`, `version`, `first_step`, `nbytes`), then for
`kind=WEIGHTS` the policy's parameters, FULL and in `param_specs` order (the checkpoint's names and
layout-independent shapes), as raw bytes in buckets of at most `BUCKET_BYTES`.

Trainer side (`send_weights`, collective over every trainer rank): each parameter is gathered whole
(core/ckpt's `gather_full`: the FSDP shards over dp, then the TP pieces over tp, padding dropped) on
trainer rank 0, which copies its bytes into the bucket. Rollout side (`recv_weights`): each full
tensor is cut to this rank's TP slice for the rollout layout's tp (core/shards; zero padding rows
as a checkpoint load adds them) and copied in. The bytes are copied, never cast: the rollout's
weights equal the trainer's bit for bit, whatever the two tp.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from core.ckpt import copy_into, gather_full, param_specs, recompute_rope, tp_info

WEIGHTS, STOP = 1, 0
BUCKET_BYTES = 1 << 26
SYNC_HEADER = ("kind", "version", "first_step", "nbytes")


def _bcast(t: torch.Tensor, group) -> None:
    dist.broadcast(t, src=0, group=group)  # global rank 0, trainer rank 0, is the sync group's source


def send_header(kind: int, version: int, first_step: int, nbytes: int, group, device) -> None:
    _bcast(torch.tensor([kind, version, first_step, nbytes], dtype=torch.long, device=device), group)


def recv_header(group, device) -> dict:
    h = torch.zeros(len(SYNC_HEADER), dtype=torch.long, device=device)
    _bcast(h, group)
    return dict(zip(SYNC_HEADER, h.tolist()))


def _nbytes(specs) -> int:
    return sum(torch.Size(s.full_shape).numel() * s.param.element_size() for s in specs)


@torch.no_grad()
def send_weights(policy, state, sync_group, version: int, first_step: int = 0) -> tuple[float, float]:
    """Trainer side: broadcast the policy's full weights (`version`) to the rollout ranks. Collective over
    the trainer ranks (the gathers) and the sync group (trainer rank 0 only). Returns (seconds waiting for
    the rollout ranks to take the header, seconds of the transfer after it), as trainer rank 0 sees them."""
    t0 = time.perf_counter()
    _, tp, _ = tp_info(state)
    specs = param_specs(policy, policy.cfg, tp)
    sender = state.rank == 0
    device = state.device
    if sender:
        send_header(WEIGHTS, version, first_step, _nbytes(specs), sync_group, device)
    t1 = time.perf_counter()
    bucket, used = None, 0
    for s in specs:
        full = gather_full(s.param, s, policy.cfg, state)
        if not sender:
            continue
        raw = full.detach().contiguous().view(-1).view(torch.uint8)
        if bucket is None:
            bucket = torch.empty(BUCKET_BYTES, dtype=torch.uint8, device=device)
        while raw.numel():  # a tensor larger than what is left spans buckets
            take = min(raw.numel(), BUCKET_BYTES - used)
            bucket[used:used + take].copy_(raw[:take])
            used, raw = used + take, raw[take:]
            if used == BUCKET_BYTES:
                _bcast(bucket, sync_group)
                used = 0
    if sender and used:
        _bcast(bucket[:used].contiguous(), sync_group)
    return t1 - t0, time.perf_counter() - t1


def send_stop(state, sync_group) -> None:
    """Trainer rank 0: tell the rollout ranks no further weights come (the run ends before they need them)."""
    if state.rank == 0:
        send_header(STOP, -1, -1, 0, sync_group, state.device)


@torch.no_grad()
def recv_weights(policy, state, sync_group, head: dict) -> None:
    """Rollout side, after `recv_header` gave `head` (kind WEIGHTS): receive every full tensor and keep this
    rank's TP slice of it (the rollout layout's tp)."""
    _, tp, tp_rank = tp_info(state)
    specs = param_specs(policy, policy.cfg, tp)
    if head["nbytes"] != _nbytes(specs):
        raise RuntimeError(f"weight sync: the trainer sends {head['nbytes']} bytes, this rollout model holds "
                           f"{_nbytes(specs)}: the two were built differently")
    device = state.device
    left = head["nbytes"]
    bucket, pos, have = None, 0, 0

    def take(n: int) -> torch.Tensor:
        nonlocal bucket, pos, have, left
        out = torch.empty(n, dtype=torch.uint8, device=device)
        got = 0
        while got < n:
            if pos == have:  # the next bucket
                size = min(BUCKET_BYTES, left)
                bucket = torch.empty(size, dtype=torch.uint8, device=device)
                _bcast(bucket, sync_group)
                pos, have, left = 0, size, left - size
            k = min(n - got, have - pos)
            out[got:got + k].copy_(bucket[pos:pos + k])
            got, pos = got + k, pos + k
        return out

    for s in specs:
        n = torch.Size(s.full_shape).numel()
        full = take(n * s.param.element_size()).view(s.param.dtype).view(s.full_shape)
        copy_into(s.param, local_slice(full, s.slice(policy.cfg, tp_rank, tp)))
    recompute_rope(policy)


def local_slice(full: torch.Tensor, sl) -> torch.Tensor:
    """This TP rank's piece of `full` (core/shards.TPSlice): rows start:stop along its dim, then zero rows up
    to its padded local size; the whole tensor when replicated."""
    if sl.dim is None:
        return full
    t = full.narrow(sl.dim, sl.start, sl.stop - sl.start)
    if sl.local_size > sl.stop - sl.start:
        pad = [0, 0] * (t.dim() - 1 - sl.dim) + [0, sl.local_size - (sl.stop - sl.start)]
        t = F.pad(t, pad)
    return t
