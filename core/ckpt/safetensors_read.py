"""A strict reader of the safetensors format: one file, or a sharded set (the writers are in
core/ckpt/safetensors_write.py).

File layout: an 8-byte little-endian unsigned header length N; N bytes of UTF-8 JSON
`{name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str: str}}`;
then the data buffer, which the offsets index (relative to its start). The reader checks everything
before it trusts anything: the file length, the header length, UTF-8, JSON, duplicate keys, each
entry's dtype/shape/offsets, and that the tensors tile the buffer exactly (start at 0, no gap, no
overlap, end at the end of the file). Any violation raises `CheckpointError` naming the file and
the key. Tensors are read lazily through a read-only memory map, so a rank that needs rows
[start, stop) of one tensor touches only those bytes.

A sharded set is the Hugging Face layout: `PREFIX.safetensors`, or shards
`PREFIX-00001-of-0000N.safetensors` listed in `PREFIX.safetensors.index.json`
(`{"metadata": {"total_size": n}, "weight_map": {name: file}}`).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
from typing import NamedTuple

import numpy as np
import torch

from core.ckpt.atomic import CheckpointError

MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

if sys.byteorder != "little":  # the format is little endian and we view the bytes directly
    raise ImportError("core.ckpt.safetensors_read supports little-endian hosts only")


class TensorInfo(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def no_duplicate_keys(path: str):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise CheckpointError(f"{path}: duplicate key '{k}' in the header")
            out[k] = v
        return out
    return hook


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _parse_header(path: str, raw: bytes, header_len: int, file_size: int):
    """(entries: {name: TensorInfo}, metadata) from the header bytes; every check raises."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: header is not valid UTF-8 ({e})") from e
    try:
        header = json.loads(text, object_pairs_hook=no_duplicate_keys(path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must be an object of string values")
    data_start = 8 + header_len
    buffer_len = file_size - data_start
    entries: dict[str, TensorInfo] = {}
    for name, e in header.items():
        where = f"{path}: key '{name}'"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{where}: entry must have exactly dtype, shape, data_offsets; got {e!r}")
        dt = DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if dt is None:
            raise CheckpointError(f"{where}: unknown dtype {e['dtype']!r}")
        shape, offs = e["shape"], e["data_offsets"]
        if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
            raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_count(o) for o in offs)
                and offs[0] <= offs[1]):
            raise CheckpointError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                                  f"got {offs!r}")
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes != offs[1] - offs[0]:
            raise CheckpointError(f"{where}: shape {shape} of {e['dtype']} needs {nbytes} bytes but "
                                  f"data_offsets {offs} span {offs[1] - offs[0]}")
        if offs[1] > buffer_len:
            raise CheckpointError(f"{where}: data_offsets {offs} lie beyond the data buffer of "
                                  f"{buffer_len} bytes (truncated file or bad offsets)")
        entries[name] = TensorInfo(dt, tuple(shape), data_start + offs[0], data_start + offs[1])
    # the tensors must tile the buffer exactly: from 0, no gap, no overlap, to the end of the file
    pos, prev = data_start, None
    for name, info in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin < pos:
            raise CheckpointError(f"{path}: key '{name}' overlaps key '{prev}' (data_offsets overlap)")
        if info.begin > pos:
            what = f"after key '{prev}'" if prev else "at the start of the buffer"
            raise CheckpointError(f"{path}: gap of {info.begin - pos} bytes before key '{name}' {what}")
        pos, prev = info.end, name
    if pos != file_size:
        raise CheckpointError(f"{path}: tensors end at byte {pos - data_start} of the data buffer but the "
                              f"buffer has {buffer_len} bytes (trailing bytes)")
    return entries, metadata


class SafeFile:
    """A validated safetensors file; tensors are read on demand. Use as a context manager."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                file_size = os.fstat(f.fileno()).st_size
                if file_size < 8:
                    raise CheckpointError(f"{path}: truncated file ({file_size} bytes, shorter than the "
                                          f"8-byte header length)")
                (n,) = struct.unpack("<Q", f.read(8))
                if n > file_size - 8:
                    raise CheckpointError(f"{path}: header length {n} is larger than the file "
                                          f"({file_size} bytes): truncated or corrupt")
                if n > MAX_HEADER_BYTES:
                    raise CheckpointError(f"{path}: header length {n} exceeds {MAX_HEADER_BYTES} bytes")
                raw = f.read(n)
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e}") from e
        self._entries, self.metadata = _parse_header(path, raw, n, file_size)
        self._mm = np.memmap(path, dtype=np.uint8, mode="r") if file_size > 8 + n else None

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def info(self, key: str) -> TensorInfo:
        if key not in self._entries:
            raise CheckpointError(f"{self.path}: no key '{key}'")
        return self._entries[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.info(key).shape

    def dtype(self, key: str) -> torch.dtype:
        return self.info(key).dtype

    def get(self, key: str) -> torch.Tensor:
        """The whole tensor, in a fresh CPU buffer."""
        info = self.info(key)
        if not info.shape:
            return self._bytes_to_tensor(self._mm[info.begin:info.end], info.dtype, ())
        return self.get_slice(key, 0, 0, info.shape[0])

    def get_slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """`full.narrow(dim, start, stop - start)`, reading only those bytes (strided for dim > 0)."""
        info = self.info(key)
        shape = info.shape
        if not -len(shape) <= dim < len(shape):
            raise CheckpointError(f"{self.path}: key '{key}' of shape {list(shape)} has no dim {dim}")
        dim %= len(shape)
        if not 0 <= start <= stop <= shape[dim]:
            raise CheckpointError(f"{self.path}: key '{key}': slice [{start}, {stop}) out of range for dim "
                                  f"{dim} of size {shape[dim]}")
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1:]) * info.dtype.itemsize  # bytes per index along dim
        out_shape = shape[:dim] + (stop - start,) + shape[dim + 1:]
        if outer * (stop - start) * inner == 0:
            return torch.empty(out_shape, dtype=info.dtype, device="cpu")
        rows = self._mm[info.begin:info.end].reshape(outer, shape[dim] * inner)
        return self._bytes_to_tensor(rows[:, start * inner:stop * inner], info.dtype, out_shape)

    def _bytes_to_tensor(self, view: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
        buf = torch.from_numpy(np.array(view, order="C", copy=True).reshape(-1))
        self._release(view)
        return buf.view(dtype).reshape(shape)

    def _release(self, view: np.ndarray) -> None:
        """Drop the mapped pages just copied from this process's resident set (they stay in the page
        cache), so streaming a large file tensor by tensor keeps RSS near one tensor."""
        mm = getattr(self._mm, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or view.size == 0:
            return
        base = self._mm.__array_interface__["data"][0]
        first = view.__array_interface__["data"][0] - base
        if view.ndim == 1:
            last = first + view.shape[0]
        else:  # rows of a strided 2-D byte view
            last = first + (view.shape[0] - 1) * view.strides[0] + view.shape[1]
        first -= first % mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, first, min(last, len(mm)) - first)
        except (OSError, ValueError, AttributeError):
            pass  # advisory only

    def close(self) -> None:
        self._mm = None

    def __enter__(self) -> SafeFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_safetensors(path: str) -> SafeFile:
    return SafeFile(path)


class SafeSet:
    """The tensors of a single file or of an indexed set of shards, with `SafeFile`'s interface."""

    def __init__(self, files: dict[str, SafeFile], weight_map: dict[str, str], origin: str):
        self.files = files  # file name -> SafeFile
        self.weight_map = weight_map  # key -> file name
        self.origin = origin  # the single file or the index file, for messages

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def file_of(self, key: str) -> SafeFile:
        if key not in self.weight_map:
            raise CheckpointError(f"{self.origin}: no key '{key}'")
        return self.files[self.weight_map[key]]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.file_of(key).shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.file_of(key).dtype(key)

    def get(self, key: str) -> torch.Tensor:
        return self.file_of(key).get(key)

    def get_slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.file_of(key).get_slice(key, dim, start, stop)

    @property
    def metadata(self) -> dict[str, str]:
        return next(iter(self.files.values())).metadata if self.files else {}

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self) -> SafeSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_safetensors_set(folder: str, prefix: str = "model") -> SafeSet:
    """Open `folder/PREFIX.safetensors` or the shards its `PREFIX.safetensors.index.json` lists.
    Every shard must exist, hold exactly the keys the index assigns to it, and validate."""
    single = os.path.join(folder, f"{prefix}.safetensors")
    index_path = single + ".index.json"
    has_single, has_index = os.path.isfile(single), os.path.isfile(index_path)
    if has_single and has_index:
        raise CheckpointError(f"{folder}: both {prefix}.safetensors and {prefix}.safetensors.index.json "
                              f"exist; remove one")
    if has_single:
        f = SafeFile(single)
        return SafeSet({os.path.basename(single): f}, {k: os.path.basename(single) for k in f.keys()}, single)
    if not has_index:
        raise CheckpointError(f"{folder}: neither {prefix}.safetensors nor {prefix}.safetensors.index.json found")
    try:
        with open(index_path, encoding="utf-8") as fh:
            index = json.load(fh, object_pairs_hook=no_duplicate_keys(index_path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index_path}: cannot read the index ({e})") from e
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{index_path}: 'weight_map' must be an object mapping keys to file names")
    files: dict[str, SafeFile] = {}
    for fname in dict.fromkeys(wm.values()):
        if os.path.basename(fname) != fname or fname in ("", ".", ".."):
            raise CheckpointError(f"{index_path}: shard name {fname!r} must be a plain file name")
        if not os.path.isfile(os.path.join(folder, fname)):
            raise CheckpointError(f"{index_path}: shard file {fname} is missing")
        files[fname] = SafeFile(os.path.join(folder, fname))
    for key, fname in wm.items():
        if key not in files[fname]:
            raise CheckpointError(f"{index_path}: key '{key}' is listed in {fname} but that file lacks it")
    for fname, f in files.items():
        for key in f.keys():
            if wm.get(key) != fname:
                raise CheckpointError(f"{os.path.join(folder, fname)}: key '{key}' is not assigned to this "
                                      f"file by {os.path.basename(index_path)}")
    return SafeSet(files, dict(wm), index_path)
