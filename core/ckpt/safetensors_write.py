"""Writers of the safetensors format (the layout is described in core/ckpt/safetensors_read.py):
`save_safetensors` / `save_safetensors_set` for tensors in memory, and `StreamingWriter`, which
takes one tensor at a time so that peak memory is one tensor, not the set. Every file is written
to a temporary name, fsynced and renamed into place.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping

import torch

from core.ckpt.atomic import fsync_dir, write_bytes_atomic, write_file_atomic
from core.ckpt.safetensors_read import DTYPE_NAMES
from parallel.fsdp import is_dtensor


def _check_tensors(tensors: Mapping[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        if is_dtensor(t):
            raise TypeError(f"'{name}' is a DTensor: pass the full tensor (DTensor.full_tensor()) instead")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"'{name}' must be a dense torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"'{name}' has dtype {t.dtype}, which safetensors cannot store")


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` to `path` atomically (tmp file, fsync, os.replace)."""
    _check_tensors(tensors)
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must map str to str")
    # larger dtypes first so that every tensor is aligned to its item size
    names = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    pos = 0
    for n in names:
        t = tensors[n]
        nbytes = t.numel() * t.dtype.itemsize
        header[n] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * (-(8 + len(hjson)) % 8)

    def write(f):
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for n in names:
            t = tensors[n].detach().to("cpu").contiguous()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)

    write_file_atomic(path, write)


# ---------------------------------------------------------------------------------------------
# sharded sets (Hugging Face layout)


def shard_name(prefix: str, i: int, n: int) -> str:
    return f"{prefix}-{i:05d}-of-{n:05d}.safetensors"


def save_safetensors_set(tensors: Mapping[str, torch.Tensor], folder: str, prefix: str = "model",
                         max_shard_bytes: int | None = None,
                         metadata: Mapping[str, str] | None = None) -> list[str]:
    """Write one file `PREFIX.safetensors`, or shards of at most `max_shard_bytes` (a larger tensor
    gets a shard of its own) plus `PREFIX.safetensors.index.json`, written last. Tensors keep the
    mapping's order across shards. Returns the written file names, relative to `folder`."""
    _check_tensors(tensors)
    sizes = {n: t.numel() * t.dtype.itemsize for n, t in tensors.items()}
    total = sum(sizes.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_safetensors(tensors, os.path.join(folder, f"{prefix}.safetensors"), metadata)
        return [f"{prefix}.safetensors"]
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    groups: list[list[str]] = [[]]
    used = 0
    for n in tensors:
        if groups[-1] and used + sizes[n] > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(n)
        used += sizes[n]
    files, weight_map = [], {}
    for i, group in enumerate(groups, start=1):
        fname = shard_name(prefix, i, len(groups))
        save_safetensors({n: tensors[n] for n in group}, os.path.join(folder, fname), metadata)
        files.append(fname)
        weight_map.update({n: fname for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_bytes_atomic(os.path.join(folder, f"{prefix}.safetensors.index.json"),
                       json.dumps(index, indent=1).encode("utf-8"))
    return [*files, f"{prefix}.safetensors.index.json"]


def stream_order(specs: Mapping[str, tuple]) -> list[str]:
    """The order `StreamingWriter` takes tensors in: larger item sizes first, else as given."""
    return sorted(specs, key=lambda n: -specs[n][0].itemsize)


class StreamingWriter:
    """Write `PREFIX.safetensors` (or shards of at most `max_shard_bytes` plus the index) one tensor
    at a time, so peak memory is one tensor, not the set.

    specs: name -> (dtype, shape), known up front (the headers are written first). Tensors must be
    passed to `write` in `self.order` (larger item sizes first, so every tensor stays aligned;
    otherwise the specs' order). Each file goes to `NAME.tmp` and is fsynced and renamed when its
    last tensor arrives; the index is written last. Use as a context manager: an exception removes
    the temporary file. `close()` returns the file names written, relative to `folder`.
    """

    def __init__(self, folder: str, prefix: str, specs: Mapping[str, tuple], max_shard_bytes: int | None = None,
                 metadata: Mapping[str, str] | None = None):
        self.folder, self.prefix, self.metadata = folder, prefix, dict(metadata or {})
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for name, (dt, shape) in specs.items():
            if not isinstance(name, str) or not name or name == "__metadata__":
                raise ValueError(f"invalid tensor name {name!r}")
            if dt not in DTYPE_NAMES:
                raise TypeError(f"'{name}' has dtype {dt}, which safetensors cannot store")
            self.specs[name] = (dt, tuple(int(s) for s in shape))
        self.order = stream_order(self.specs)
        sizes = {n: math.prod(s) * dt.itemsize for n, (dt, s) in self.specs.items()}
        self.total = sum(sizes.values())
        groups: list[list[str]] = [[]]
        if max_shard_bytes is not None and max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        used = 0
        for n in self.order:
            if max_shard_bytes is not None and groups[-1] and used + sizes[n] > max_shard_bytes:
                groups.append([])
                used = 0
            groups[-1].append(n)
            used += sizes[n]
        self.sharded = len(groups) > 1
        self.groups = groups
        self.file_names = ([shard_name(prefix, i, len(groups)) for i in range(1, len(groups) + 1)]
                           if self.sharded else [f"{prefix}.safetensors"])
        self._next = 0  # index into self.order
        self._group = -1
        self._fh = None
        self._tmp = None
        self.written: list[str] = []

    def _open_group(self, g: int) -> None:
        names = self.groups[g]
        header: dict = {"__metadata__": self.metadata} if self.metadata else {}
        pos = 0
        for n in names:
            dt, shape = self.specs[n]
            nbytes = math.prod(shape) * dt.itemsize
            header[n] = {"dtype": DTYPE_NAMES[dt], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
        hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
        hjson += b" " * (-(8 + len(hjson)) % 8)
        self._tmp = os.path.join(self.folder, self.file_names[g] + ".tmp")
        self._fh = open(self._tmp, "wb")
        self._fh.write(struct.pack("<Q", len(hjson)))
        self._fh.write(hjson)
        self._group, self._left = g, len(names)

    def _close_group(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        os.replace(self._tmp, os.path.join(self.folder, self.file_names[self._group]))
        self._tmp = None
        self.written.append(self.file_names[self._group])

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.order) or name != self.order[self._next]:
            want = f"'{self.order[self._next]}'" if self._next < len(self.order) else "nothing (all written)"
            raise ValueError(f"StreamingWriter: got '{name}', expected {want}")
        dt, shape = self.specs[name]
        if tensor.dtype != dt or tuple(tensor.shape) != shape:
            raise ValueError(f"StreamingWriter: '{name}' is {tensor.dtype} {list(tensor.shape)}, "
                             f"declared {dt} {list(shape)}")
        if self._fh is None:
            self._open_group(self._group + 1)
        t = tensor.detach().to("cpu").contiguous()
        if t.numel():
            self._fh.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self._next += 1
        self._left -= 1
        if self._left == 0:
            self._close_group()

    def close(self) -> list[str]:
        """Finish: every declared tensor must have been written. Returns the file names."""
        while self._fh is None and self._next == len(self.order) and self._group + 1 < len(self.groups):
            self._open_group(self._group + 1)  # only an empty set gets here: one empty file
            self._close_group()
        if self._next != len(self.order):
            raise ValueError(f"StreamingWriter: closed after {self._next} of {len(self.order)} tensors "
                             f"(next: '{self.order[self._next]}')")
        fsync_dir(self.folder)
        if self.sharded:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {n: self.file_names[g] for g, names in enumerate(self.groups) for n in names}}
            write_bytes_atomic(os.path.join(self.folder, f"{self.prefix}.safetensors.index.json"),
                               json.dumps(index, indent=1).encode("utf-8"))
            self.written.append(f"{self.prefix}.safetensors.index.json")
        return list(self.written)

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tmp and os.path.exists(self._tmp):
            os.remove(self._tmp)

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()
