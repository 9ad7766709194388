"""Saving a checkpoint folder atomically: write into a temporary sibling, hash every file into
manifest.json (written last), rename into place, point `latest` at it, apply retention.

The folder format is described in core/ckpt/manifest.py. A save killed at any point leaves the
previous checkpoints intact: readers ignore `.tmp-*` folders and the next save removes them.
Distributed use: pass the process group spanning every rank that takes part (e.g.
`dist.group.WORLD`); `group=None` means a single process. A failure on any rank raises the same
`CheckpointError` on every rank (core/ckpt/atomic.raise_on_all_ranks), so none hangs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Mapping

from core.ckpt.atomic import CheckpointError, fsync_dir, raise_on_all_ranks, sha256_file, write_bytes_atomic
from core.ckpt.manifest import (
    FORMAT_VERSION,
    INFO_FIELDS,
    KINDS,
    LATEST,
    MANIFEST,
    complete_steps,
    step_dir_name,
)
from parallel import comm


def _remove_stale(root: str) -> None:
    for name in os.listdir(root):
        if name.startswith(".tmp-") or name == LATEST + ".tmp":
            p = os.path.join(root, name)
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.remove(p)


def apply_retention(root: str, keep_last: int | None, new: str) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints at or before `new` (None or 0:
    keep all); returns the names deleted.

    `new` is the folder just sealed, its hashes computed from the bytes on disk: the newest verified
    checkpoint, never deleted. Folders with a later step (a timeline a resume rejected as corrupt,
    or abandoned) are neither deleted nor counted, so a corrupt newer folder cannot push a verified
    one out. Nothing is deleted before `new` is complete.
    """
    if not keep_last or keep_last <= 0:
        return []
    steps = complete_steps(root)
    new_step = next((s for s, n in steps if n == new), None)
    if new_step is None:
        raise CheckpointError(f"{os.path.join(root, new)}: retention found the new checkpoint incomplete")
    older = [n for s, n in steps if s <= new_step and n != new]
    doomed = older[:max(len(older) - (keep_last - 1), 0)]
    for name in doomed:
        shutil.rmtree(os.path.join(root, name))
    later = [n for s, n in steps if s > new_step]
    if later:
        print(f"kltron.checkpoint: retention leaves {later} under {root} alone: newer than {new}, the "
              f"checkpoint just written", file=sys.stderr)
    return doomed


def _seal(tmp: str, step: int, info: Mapping) -> None:
    """Hash every file of `tmp` into its manifest.json, written last."""
    files, sizes = {}, {}
    for dirpath, _, names in os.walk(tmp):
        for n in sorted(names):
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, tmp).replace(os.sep, "/")
            if rel != MANIFEST:
                files[rel], sizes[rel] = sha256_file(p), os.path.getsize(p)
    if not files:
        raise CheckpointError(f"{tmp}: the writer wrote no files")
    manifest = {"format_version": FORMAT_VERSION, **info, "step": step, "files": files, "sizes": sizes}
    write_bytes_atomic(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1).encode("utf-8"))


def _replace(tmp: str, final: str) -> None:
    """Rename `tmp` to `final`; an existing `final` is set aside first and deleted once replaced."""
    parent, name = os.path.split(final)
    old = None
    if os.path.exists(final):
        old = os.path.join(parent, f".tmp-old-{name}-{secrets.token_hex(4)}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(parent)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _finalize(root: str, tmp: str, step: int, info: Mapping) -> str:
    _seal(tmp, step, info)
    name = step_dir_name(step)
    final = os.path.join(root, name)
    _replace(tmp, final)
    write_bytes_atomic(os.path.join(root, LATEST), (name + "\n").encode("utf-8"))
    return final


def _check_info(info: Mapping) -> dict:
    missing = [f for f in INFO_FIELDS if f not in info]
    if missing or info.get("kind") not in KINDS:
        raise CheckpointError(f"save: info lacks {missing} or has kind "
                              f"{info.get('kind')!r} (expected one of {KINDS})")
    reserved = {"format_version", "step", "files", "sizes"} & set(info)
    if reserved:
        raise CheckpointError(f"save: info may not set {sorted(reserved)}")
    return json.loads(json.dumps(dict(info)))  # fail here, on every rank, if not JSON-serialisable


def _run_save(prepare, writer_fn, finish, group, writer_rank: int, all_ranks_write: bool) -> str:
    tmp = raise_on_all_ranks(prepare, group, src=writer_rank)

    def write() -> None:
        writer_fn(tmp)  # its return value is ignored (it need not be picklable)

    try:
        raise_on_all_ranks(write, group, None if all_ranks_write else writer_rank)
        return raise_on_all_ranks(lambda: finish(tmp), group, src=writer_rank)
    except CheckpointError:
        if comm.group_rank(group) == writer_rank:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint_at(path: str, step: int, writer_fn: Callable[[str], object], *, info: Mapping, group=None,
                       writer_rank: int = 0, all_ranks_write: bool = False) -> str:
    """Save one checkpoint folder exactly at `path`, atomically: `writer_fn` fills a temporary
    sibling `.tmp-NAME-xxxx`, which gets its manifest and is renamed over `path`. An existing
    checkpoint at `path` is replaced only once the new one is complete; an existing folder that is
    not a checkpoint (no manifest.json) and not empty is refused. Same contract as
    `save_checkpoint_dir` otherwise (no `latest`, no retention). Returns `path` on every rank."""
    info = _check_info(info)
    path = os.path.abspath(path)
    parent, name = os.path.split(path)

    def prepare() -> str:
        if os.path.exists(path) and not (os.path.isdir(path) and (
                os.path.isfile(os.path.join(path, MANIFEST)) or not os.listdir(path))):
            raise CheckpointError(f"{path} exists and is not a kltron checkpoint; refusing to replace it")
        os.makedirs(parent, exist_ok=True)
        for n in os.listdir(parent):  # a killed earlier save of this same folder
            if n.startswith((f".tmp-{name}-", f".tmp-old-{name}-")):
                shutil.rmtree(os.path.join(parent, n), ignore_errors=True)
        tmp = os.path.join(parent, f".tmp-{name}-{secrets.token_hex(4)}")
        os.mkdir(tmp)
        return tmp

    def finish(tmp: str) -> str:
        _seal(tmp, step, info)
        _replace(tmp, path)
        return path

    return _run_save(prepare, writer_fn, finish, group, writer_rank, all_ranks_write)


def save_checkpoint_dir(root: str, step: int, writer_fn: Callable[[str], object], *, info: Mapping,
                        keep_last: int | None = None, group=None, writer_rank: int = 0,
                        all_ranks_write: bool = False) -> str:
    """Save checkpoint `step` under `root` atomically; returns `root/step-XXXXXXXX` on every rank.

    `writer_fn(tmp_dir)` writes the files (any names, subfolders allowed) into a fresh temporary
    folder. It runs on group rank `writer_rank` only, or on every rank with `all_ranks_write` (then
    ranks must write distinct files). `info` holds the manifest fields kind, model_config, tp,
    dtype, tokenizer_fingerprint (more JSON fields are kept). Then the writer rank hashes every
    file into manifest.json (written last), renames the folder into place, points `latest` at it,
    and keeps the newest `keep_last` complete checkpoints (None or 0: all; see apply_retention: never
    the new one, nothing deleted before it is complete, later folders left alone). A failure on any rank
    removes the temporary folder and raises the same CheckpointError on every rank.
    """
    info = _check_info(info)

    def prepare() -> str:
        os.makedirs(root, exist_ok=True)
        _remove_stale(root)
        tmp = os.path.join(root, f".tmp-{step_dir_name(step)}-{secrets.token_hex(4)}")
        os.mkdir(tmp)
        return tmp

    final = _run_save(prepare, writer_fn, lambda tmp: _finalize(root, tmp, step, info), group, writer_rank,
                      all_ranks_write)
    raise_on_all_ranks(lambda: apply_retention(root, keep_last, os.path.basename(final)), group,
                       src=writer_rank)
    return final
