"""The bottom of the checkpoint package: the error type, durable atomic file writes, file hashing,
and `raise_on_all_ranks`, which turns one rank's failure into the same error on every rank.

Nothing here knows the checkpoint format; every other file of core/ckpt builds on this one.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import torch.distributed as dist

from parallel import comm

HASH_CHUNK = 1 << 20  # bytes read per hashing step


class CheckpointError(ValueError):
    """A checkpoint or tensor file that cannot be used; the message names the file and the key."""


def fsync_dir(path: str) -> None:
    """Make a rename or file creation inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str, write) -> None:
    """Call write(f) on `path.tmp`, fsync, os.replace: readers see the old file or the new one,
    and a failure leaves no temporary file behind."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically (see write_file_atomic)."""
    write_file_atomic(path, lambda f: f.write(data))


def sha256_file(path: str) -> str:
    """The hex sha256 of the file at `path`, read sequentially in HASH_CHUNK pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def describe_error(e: BaseException) -> str:
    """A CheckpointError's own message; any other exception prefixed with its type."""
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def raise_on_all_ranks(fn: Callable[[], object], group=None, src: int | None = None):
    """Run `fn` and make its failure every rank's failure.

    src=None: every rank of `group` runs `fn()` and returns its own result; if any rank raised,
    every rank raises `CheckpointError` with the lowest failing rank's message.
    src=r: only group rank r runs `fn()`; its result (a small picklable object) or its error is
    broadcast, so every rank returns the same result or raises the same `CheckpointError`.
    `group=None` means a single process.
    """
    n = comm.group_size(group)
    rank = comm.group_rank(group)
    result, err = None, None
    if src is None or rank == src:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            err = e
    if n == 1:
        if err is not None:
            raise (err if isinstance(err, CheckpointError) else CheckpointError(describe_error(err))) from err
        return result
    if src is None:
        msgs: list = [None] * n
        # control plane: every rank learns every rank's error text (None when it succeeded)
        dist.all_gather_object(msgs, None if err is None else describe_error(err), group=group)
        failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
        if failed:
            r, m = failed[0]
            more = f"; {len(failed)} ranks failed" if len(failed) > 1 else ""
            raise CheckpointError(f"{m} (raised on rank {r}{more})") from err
        return result
    box = [None if err is None else describe_error(err), result if err is None else None]
    # control plane: rank src's outcome (error text, or its result) to every rank
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
    if box[0] is not None:
        raise CheckpointError(f"{box[0]} (raised on rank {src})") from err
    return box[1]
