"""kltron checkpoint folders: the format, the atomic save protocol, discovery, integrity, and
validated per-rank loading of layout-independent tensors.

    root/step-00000100/        a complete checkpoint (its manifest.json is written last)
        manifest.json          {format_version, kind: "model"|"train", model_config, tp, dtype,
                                tokenizer_fingerprint, step, files: {name: sha256}, sizes: {name: bytes}}
        model.safetensors      or model-0000i-of-0000N.safetensors + model.safetensors.index.json
        optim.safetensors      kind "train": "exp_avg/<param>", "exp_avg_sq/<param>", scalars
        train_state.json       kind "train": {step, schedule, rng, data, extra}; JSON, no pickle
    root/latest                text file: the name of the newest complete folder
    root/.tmp-step-...         a save in progress, failed or killed: ignored, removed by the next save

Tensors on disk are FULL (core/shards: true vocabulary, the model's own KV heads), so a checkpoint
saved at one tp loads at any other: each rank reads only its slice of each tensor. `tp` in the
manifest is informative.

Distributed use: pass the process group spanning every rank that takes part (e.g.
`dist.group.WORLD`); `group=None` means a single process. Validation runs where the data is, and
`raise_on_all_ranks` turns any failure into the same `CheckpointError` on every rank, so none hangs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping

import torch

from core.checkpoint_checks import check_config, check_tokenizer  # noqa: F401 - re-exported
from core.checkpoint_tensors import (  # noqa: F401 - re-exported
    SliceFn,
    assemble_full,
    iter_tensors,
    read_tensors,
    write_tensors,
)
from core.safetensors_io import CheckpointError, fsync_dir, write_bytes_atomic
from core.train_state import (  # noqa: F401 - re-exported
    TRAIN_STATE,
    capture_rng_states,
    read_train_state,
    restore_rng_states,
    write_train_state,
)
from parallel import comm

__all__ = ["CheckpointError", "FORMAT_VERSION", "save_checkpoint_dir", "save_checkpoint_at", "find_latest",
           "resolve_checkpoint", "read_manifest", "verify_checkpoint", "write_tensors", "iter_tensors", "read_tensors",
           "load_tensors", "assemble_full", "check_config", "check_tokenizer", "raise_on_all_ranks",
           "write_train_state", "read_train_state", "capture_rng_states", "restore_rng_states"]
# also, resolved lazily (see __getattr__ at the end): load_model_weights, save_model_weights,
# save_train_checkpoint, load_train_checkpoint

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
KINDS = ("model", "train")
INFO_FIELDS = ("kind", "model_config", "tp", "dtype", "tokenizer_fingerprint")
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# ---------------------------------------------------------------------------------------------
# errors on every rank


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def raise_on_all_ranks(fn: Callable[[], object], group=None, src: int | None = None):
    """Run `fn` and make its failure every rank's failure.

    src=None: every rank of `group` runs `fn()` and returns its own result; if any rank raised,
    every rank raises `CheckpointError` with the lowest failing rank's message.
    src=r: only group rank r runs `fn()`; its result (a small picklable object) or its error is
    broadcast, so every rank returns the same result or raises the same `CheckpointError`.
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
            raise (err if isinstance(err, CheckpointError) else CheckpointError(_describe(err))) from err
        return result
    import torch.distributed as dist

    if src is None:
        msgs: list = [None] * n
        # control plane: every rank learns every rank's error text (None when it succeeded)
        dist.all_gather_object(msgs, None if err is None else _describe(err), group=group)
        failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
        if failed:
            r, m = failed[0]
            more = f"; {len(failed)} ranks failed" if len(failed) > 1 else ""
            raise CheckpointError(f"{m} (raised on rank {r}{more})") from err
        return result
    box = [None if err is None else _describe(err), result if err is None else None]
    # control plane: rank src's outcome (error text, or its result) to every rank
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
    if box[0] is not None:
        raise CheckpointError(f"{box[0]} (raised on rank {src})") from err
    return box[1]


# ---------------------------------------------------------------------------------------------
# manifest, discovery, integrity


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: str) -> dict:
    """The validated manifest of checkpoint folder `path` (no hashing; see verify_checkpoint)."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no {MANIFEST}: not a complete checkpoint") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath}: cannot read the manifest ({e})") from e
    if not isinstance(m, dict):
        raise CheckpointError(f"{mpath}: the manifest must be a JSON object")
    if m.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format_version {m.get('format_version')!r} is not supported "
                              f"(expected {FORMAT_VERSION})")
    checks = {"kind": lambda v: v in KINDS, "step": lambda v: isinstance(v, int) and v >= 0,
              "model_config": lambda v: isinstance(v, dict), "tp": lambda v: isinstance(v, int) and v >= 1,
              "dtype": lambda v: isinstance(v, str),
              "tokenizer_fingerprint": lambda v: v is None or isinstance(v, str),
              "files": lambda v: isinstance(v, dict) and bool(v) and all(
                  isinstance(k, str) and isinstance(h, str) and len(h) == 64 for k, h in v.items()),
              "sizes": lambda v: isinstance(v, dict) and all(isinstance(s, int) for s in v.values())}
    for field, ok in checks.items():
        if field not in m or not ok(m[field]):
            raise CheckpointError(f"{mpath}: field '{field}' is missing or invalid: {m.get(field)!r}")
    if set(m["sizes"]) != set(m["files"]):
        raise CheckpointError(f"{mpath}: 'sizes' and 'files' list different files")
    for name in m["files"]:
        if name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/"):
            raise CheckpointError(f"{mpath}: file name {name!r} escapes the checkpoint folder")
    return m


def _is_complete(path: str) -> bool:
    """A valid manifest and every listed file present with its recorded size (cheap: no hashing)."""
    try:
        m = read_manifest(path)
    except CheckpointError:
        return False
    for name, size in m["sizes"].items():
        p = os.path.join(path, name)
        if not os.path.isfile(p) or os.path.getsize(p) != size:
            return False
    return True


def _complete_steps(root: str) -> list[tuple[int, str]]:
    """(step, folder name) of the complete checkpoints under root, oldest first."""
    out = []
    for name in os.listdir(root):
        mt = _STEP_RE.match(name)
        if mt and _is_complete(os.path.join(root, name)):
            out.append((int(mt.group(1)), name))
    return sorted(out)


def find_latest(root: str) -> str | None:
    """The checkpoint `root/latest` names if it is complete, else the newest complete step folder,
    else None. Temporary and incomplete folders are ignored."""
    if not os.path.isdir(root):
        return None
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            name = f.read().strip()
        if _STEP_RE.match(name) and _is_complete(os.path.join(root, name)):
            return os.path.join(root, name)
    except (OSError, UnicodeDecodeError):
        pass
    steps = _complete_steps(root)
    return os.path.join(root, steps[-1][1]) if steps else None


def resolve_checkpoint(path: str) -> str:
    """`path` itself when it is a complete checkpoint folder, else the latest complete checkpoint
    under it (a root with `latest` / step folders); raises CheckpointError naming `path` otherwise."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    found = find_latest(path)
    if found is None:
        raise CheckpointError(f"{path}: not a kltron checkpoint (no {MANIFEST}) and no complete checkpoint "
                              f"under it")
    return found


def verify_checkpoint(path: str) -> dict:
    """Recompute every file's sha256 against the manifest; returns the manifest."""
    m = read_manifest(path)
    for name, digest in m["files"].items():
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            raise CheckpointError(f"{p}: file listed in the manifest is missing")
        found = _sha256(p)
        if found != digest:
            raise CheckpointError(f"{p}: sha256 mismatch (manifest {digest}, file {found}): corrupt file")
    return m


# ---------------------------------------------------------------------------------------------
# the atomic save protocol


def _remove_stale(root: str) -> None:
    for name in os.listdir(root):
        if name.startswith(".tmp-") or name == LATEST + ".tmp":
            p = os.path.join(root, name)
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.remove(p)


def _apply_retention(root: str, keep_last: int | None, protect: str) -> None:
    if not keep_last or keep_last <= 0:
        return
    steps = [name for _, name in _complete_steps(root)]
    for name in steps[:-keep_last]:
        if name != protect:
            shutil.rmtree(os.path.join(root, name))


def _seal(tmp: str, step: int, info: Mapping) -> None:
    """Hash every file of `tmp` into its manifest.json, written last."""
    files, sizes = {}, {}
    for dirpath, _, names in os.walk(tmp):
        for n in sorted(names):
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, tmp).replace(os.sep, "/")
            if rel != MANIFEST:
                files[rel], sizes[rel] = _sha256(p), os.path.getsize(p)
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
    and keeps the newest `keep_last` complete checkpoints (None or 0: all) -- never the new one's
    deletion, and nothing is deleted before the new one is complete. A failure on any rank
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
    raise_on_all_ranks(lambda: _apply_retention(root, keep_last, os.path.basename(final)), group,
                       src=writer_rank)
    return final


# ---------------------------------------------------------------------------------------------
# tensors (core/checkpoint_tensors): write full, read each rank's slice


def load_tensors(folder: str, expected: Mapping[str, tuple], slice_fn: SliceFn | None = None, *,
                 group=None, **kwargs) -> dict[str, torch.Tensor]:
    """`read_tensors` on every rank of `group`; a failure on any rank raises on all of them."""
    return raise_on_all_ranks(lambda: read_tensors(folder, expected, slice_fn, **kwargs), group)


_MODEL_GLUE = {"load_model_weights": "core.model_io", "save_model_weights": "core.model_io",
               "save_train_checkpoint": "core.train_checkpoint", "load_train_checkpoint": "core.train_checkpoint"}


def __getattr__(name: str):
    """`core.checkpoint.load_model_weights` etc. live in core/model_io.py and core/train_checkpoint.py,
    which import this module; they are resolved on first use to avoid an import cycle."""
    if name in _MODEL_GLUE:
        import importlib

        return getattr(importlib.import_module(_MODEL_GLUE[name]), name)
    raise AttributeError(f"module 'core.checkpoint' has no attribute {name!r}")
