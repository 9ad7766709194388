"""The checkpoint folder: its format, its manifest, discovery under a root, and integrity.

    root/step-00000100/        a complete checkpoint (its manifest.json is written last)
        manifest.json          {format_version, kind: "model"|"train", model_config, tp, dtype,
                                tokenizer_fingerprint, step, files: {name: sha256}, sizes: {name: bytes}}
        model.safetensors      or model-0000i-of-0000N.safetensors + model.safetensors.index.json
        model-optim.safetensors  kind "train": "exp_avg/<param>", "exp_avg_sq/<param>", "step/<param>"
        train_state.json       kind "train": {step, schedule, rng, data, extra}; JSON, no pickle
    root/latest                text file: the name of the newest complete folder
    root/.tmp-step-...         a save in progress, failed or killed: ignored, removed by the next save

Integrity: every loader verifies the files it opens against the manifest's sha256 before it
trusts a byte of them (`verify_files`: the files are split over the ranks, so the folder is
hashed once in all, not once per rank; train_state.json is hashed as it is read). A mismatch, a
missing or truncated file is one `CheckpointError` naming the file, on every rank.
"""

from __future__ import annotations

import json
import os
import re

from core.ckpt.atomic import CheckpointError, raise_on_all_ranks, sha256_file
from parallel import comm

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
KINDS = ("model", "train")
INFO_FIELDS = ("kind", "model_config", "tp", "dtype", "tokenizer_fingerprint")
STEP_RE = re.compile(r"^step-(\d{8,})$")
_SHARD_RE = re.compile(r"^(.+)-\d{5}-of-\d{5}\.safetensors$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _field_checks() -> dict:
    return {"kind": lambda v: v in KINDS, "step": lambda v: isinstance(v, int) and v >= 0,
            "model_config": lambda v: isinstance(v, dict), "tp": lambda v: isinstance(v, int) and v >= 1,
            "dtype": lambda v: isinstance(v, str),
            "tokenizer_fingerprint": lambda v: v is None or isinstance(v, str),
            "files": lambda v: isinstance(v, dict) and bool(v) and all(
                isinstance(k, str) and isinstance(h, str) and len(h) == 64 for k, h in v.items()),
            "sizes": lambda v: isinstance(v, dict) and all(
                isinstance(s, int) and not isinstance(s, bool) for s in v.values())}


def read_manifest(path: str) -> dict:
    """The validated manifest of checkpoint folder `path` (no hashing; see verify_files)."""
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
    for field, ok in _field_checks().items():
        if field not in m or not ok(m[field]):
            raise CheckpointError(f"{mpath}: field '{field}' is missing or invalid: {m.get(field)!r}")
    if set(m["sizes"]) != set(m["files"]):
        raise CheckpointError(f"{mpath}: 'sizes' and 'files' list different files")
    for name in m["files"]:
        if name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/"):
            raise CheckpointError(f"{mpath}: file name {name!r} escapes the checkpoint folder")
    return m


def check_sizes(path: str, m: dict, names=None) -> None:
    """Every file in `names` (default: all the manifest lists) present with its recorded size."""
    for name in m["files"] if names is None else names:
        p = os.path.join(path, name)
        if name not in m["files"]:
            raise CheckpointError(f"{p}: not listed in {os.path.join(path, MANIFEST)}; refusing an unverified file")
        if not os.path.isfile(p):
            raise CheckpointError(f"{p}: file listed in the manifest is missing")
        size = os.path.getsize(p)
        if size != m["sizes"][name]:
            raise CheckpointError(f"{p}: {size} bytes, the manifest records {m['sizes'][name]}: truncated or "
                                  f"overwritten")


def checkpoint_problem(path: str) -> str | None:
    """Why folder `path` is not a complete checkpoint (cheap: no hashing), or None when it is."""
    if not os.path.isdir(path):
        return f"{path}: does not exist"
    try:
        check_sizes(path, read_manifest(path))
    except CheckpointError as e:
        return str(e)
    return None


def step_folders(root: str) -> list[tuple[int, str]]:
    """(step, folder name) of every `step-XXXXXXXX` folder under root, complete or not, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted((int(mt.group(1)), name) for name in os.listdir(root) if (mt := STEP_RE.match(name))
                  and os.path.isdir(os.path.join(root, name)))


def complete_steps(root: str) -> list[tuple[int, str]]:
    """(step, folder name) of the complete checkpoints under root, oldest first."""
    return [(s, n) for s, n in step_folders(root) if checkpoint_problem(os.path.join(root, n)) is None]


def read_latest(root: str) -> str | None:
    """The folder name `root/latest` holds, or None when there is no readable pointer."""
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def find_latest(root: str) -> str | None:
    """The checkpoint `root/latest` names if it is complete, else the newest complete step folder,
    else None. Temporary and incomplete folders are ignored. No hashing: see resume_candidates."""
    if not os.path.isdir(root):
        return None
    name = read_latest(root)
    if name and STEP_RE.match(name) and checkpoint_problem(os.path.join(root, name)) is None:
        return os.path.join(root, name)
    steps = complete_steps(root)
    return os.path.join(root, steps[-1][1]) if steps else None


def resume_candidates(root: str) -> tuple[list[str], str | None]:
    """Every step folder under `root`, newest first (complete or not: a loader says why it rejects
    one), and a note when `root/latest` is dangling (names no step folder), else None."""
    names = [n for _, n in reversed(step_folders(root))]
    name = read_latest(root) if os.path.isdir(root) else None
    note = None
    if name is not None and name not in names:
        note = f"{os.path.join(root, LATEST)} names {name!r}, which is not a checkpoint folder (dangling)"
    return names, note


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


def open_checkpoint(path: str) -> tuple[str, dict]:
    """(folder, validated manifest) of the checkpoint `path` resolves to (see resolve_checkpoint)."""
    ckpt = resolve_checkpoint(path)
    return ckpt, read_manifest(ckpt)


def files_with_prefix(m: dict, prefix: str) -> list[str]:
    """The manifest's files that make up the tensor set PREFIX: `PREFIX.safetensors`, or its index
    and `PREFIX-0000i-of-0000N.safetensors` shards."""
    out = []
    for name in m["files"]:
        shard = _SHARD_RE.match(name)
        if name in (f"{prefix}.safetensors", f"{prefix}.safetensors.index.json") or (shard and shard[1] == prefix):
            out.append(name)
    return sorted(out)


def tensor_files(path: str, m: dict, prefix: str) -> list[str]:
    """`files_with_prefix`, refusing a set the manifest does not list (it could not be verified)."""
    names = files_with_prefix(m, prefix)
    if not names:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: lists no {prefix}.safetensors (nor its shards)")
    return names


def check_hash(path: str, m: dict, name: str) -> None:
    """File `name` of checkpoint `path` against its manifest size and sha256; raises naming it."""
    check_sizes(path, m, [name])
    p = os.path.join(path, name)
    found = sha256_file(p)
    if found != m["files"][name]:
        raise CheckpointError(f"{p}: sha256 mismatch (manifest {m['files'][name]}, file {found}): corrupt file")


def split_by_size(names: list[str], sizes: dict, n: int) -> list[list[str]]:
    """`names` over n bins, largest first into the lightest bin (deterministic on every rank)."""
    bins: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for name in sorted(names, key=lambda x: (-sizes.get(x, 0), x)):
        i = min(range(n), key=lambda r: (load[r], r))
        bins[i].append(name)
        load[i] += sizes.get(name, 0)
    return bins


def verify_files(path: str, m: dict, names: list[str], group=None) -> None:
    """Hash `names` of checkpoint `path` against manifest `m`; collective over `group` (None: one
    process). Each rank hashes its share (split by size), so every byte is read once in all; any
    mismatch, missing, unlisted or truncated file raises one CheckpointError naming it on every rank."""
    rank, world = comm.group_rank(group), comm.group_size(group)

    def check_mine() -> None:
        check_sizes(path, m, names)  # cheap, on every rank: truncation and unlisted files
        for name in split_by_size(list(names), m["sizes"], world)[rank]:
            check_hash(path, m, name)

    raise_on_all_ranks(check_mine, group)


def verify_checkpoint(path: str, group=None) -> dict:
    """Recompute every file's sha256 against the manifest; returns the manifest."""
    m = raise_on_all_ranks(lambda: read_manifest(path), group)
    verify_files(path, m, sorted(m["files"]), group)
    return m
