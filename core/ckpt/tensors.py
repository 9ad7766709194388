"""Checkpoint tensors: written FULL (layout independent), read back as each rank's TP slice.

A rank's piece of a full tensor is `full.narrow(dim, start, stop - start)` followed by
`local_size - (stop - start)` zero rows along dim (vocabulary padding), as core/shards says;
`assemble_full` is the inverse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from core.ckpt.atomic import CheckpointError, raise_on_all_ranks
from core.ckpt.safetensors_read import open_safetensors_set
from core.ckpt.safetensors_write import save_safetensors_set


def write_tensors(folder: str, tensors: Mapping[str, torch.Tensor], *, prefix: str = "model",
                  max_shard_bytes: int | None = None) -> list[str]:
    """Write FULL (layout-independent) CPU tensors as `PREFIX.safetensors`, or as shards of at most
    `max_shard_bytes` plus an index. Returns the file names written."""
    return save_safetensors_set(tensors, folder, prefix, max_shard_bytes, metadata={"format": "pt"})


SliceFn = Callable[[str, tuple], tuple]  # (name, full_shape) -> (dim | None, start, stop, local_size)


def iter_tensors(folder: str, expected: Mapping[str, tuple], slice_fn: SliceFn | None = None, *,
                 prefix: str = "model", dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
                 cast: bool = False, strict: bool = True, ignore_extra=()):
    """Like `read_tensors`, but yields (name, this rank's piece) one tensor at a time, in the order
    of `expected`, so a caller can copy each into place before the next is read. Every name, shape
    and dtype is validated before the first tensor is yielded."""
    with open_safetensors_set(folder, prefix) as s:
        missing = [k for k in expected if k not in s]
        if missing:
            raise CheckpointError(f"{s.origin}: missing key '{missing[0]}'"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        extra = [k for k in s.keys() if k not in expected and k not in ignore_extra]
        if strict and extra:
            raise CheckpointError(f"{s.file_of(extra[0]).path}: unexpected key '{extra[0]}'"
                                  + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
        for name, shape in expected.items():
            where = f"{s.file_of(name).path}: key '{name}'"
            found = s.shape(name)
            if tuple(found) != tuple(shape):
                raise CheckpointError(f"{where}: expected shape {list(shape)}, found {list(found)}")
            want = dtype.get(name) if isinstance(dtype, Mapping) else dtype
            if want is not None and s.dtype(name) != want and not cast:
                raise CheckpointError(f"{where}: expected dtype {want}, found {s.dtype(name)}")
        for name, shape in expected.items():
            sl = slice_fn(name, tuple(shape)) if slice_fn is not None else None
            if sl is None or sl[0] is None:
                t = s.get(name)
            else:
                dim, start, stop, local = sl
                if not (0 <= dim < len(shape) and 0 <= start <= stop <= shape[dim] and local >= stop - start):
                    raise CheckpointError(f"key '{name}': slice {tuple(sl)} does not fit full shape {list(shape)}")
                t = s.get_slice(name, dim, start, stop)
                if local > stop - start:  # zero rows reach the padded local size
                    pad_shape = list(t.shape)
                    pad_shape[dim] = local - (stop - start)
                    t = torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
            want = dtype.get(name) if isinstance(dtype, Mapping) else dtype
            yield name, (t.to(want) if want is not None else t)


def read_tensors(folder: str, expected: Mapping[str, tuple], slice_fn: SliceFn | None = None, *,
                 prefix: str = "model", dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
                 cast: bool = False, strict: bool = True, ignore_extra=()) -> dict[str, torch.Tensor]:
    """This rank's pieces of the tensors in `folder/PREFIX*.safetensors`.

    expected: name -> FULL shape; every name must be present with that shape, and (strict) no
    other name may be, except those in `ignore_extra`. slice_fn(name, full_shape) -> (dim, start,
    stop, local_size), e.g. `core.shards.tp_slice`: the result is `full.narrow(dim, start, stop -
    start)` followed by `local_size - (stop - start)` zero rows along dim (vocabulary padding); dim
    None (or no slice_fn) reads the whole tensor. dtype: expected dtype (one, or per name); a
    different stored dtype is an error unless `cast`, which converts. Errors name the file, the
    key, expected vs found.
    """
    return dict(iter_tensors(folder, expected, slice_fn, prefix=prefix, dtype=dtype, cast=cast, strict=strict,
                             ignore_extra=ignore_extra))


def load_tensors(folder: str, expected: Mapping[str, tuple], slice_fn: SliceFn | None = None, *,
                 group=None, **kwargs) -> dict[str, torch.Tensor]:
    """`read_tensors` on every rank of `group`; a failure on any rank raises on all of them.
    No hashing: a checkpoint folder's files are verified by core/ckpt/manifest (verify_files)."""
    return raise_on_all_ranks(lambda: read_tensors(folder, expected, slice_fn, **kwargs), group)


def assemble_full(parts: list[torch.Tensor], slices: list[tuple], full_shape: tuple) -> torch.Tensor:
    """The FULL tensor from every TP rank's local tensor, the inverse of the sliced read.

    parts[r]: TP rank r's local tensor (e.g. `comm.all_gather_along(local, dim, tp_group)` split
    into `local_size` pieces along dim); slices[r]: its (dim, start, stop, local_size). Padding rows
    are dropped; ranks that hold the same rows (replicated KV heads) contribute them once. A
    replicated tensor (dim None) is parts[0].
    """
    dim = slices[0][0]
    if dim is None:
        return parts[0]
    out = torch.empty(full_shape, dtype=parts[0].dtype, device=parts[0].device)
    covered = torch.zeros(full_shape[dim], dtype=torch.bool, device="cpu")
    for part, (d, start, stop, _) in zip(parts, slices, strict=True):
        if d != dim:
            raise ValueError(f"slices disagree on the sharded dim: {d} vs {dim}")
        out.narrow(dim, start, stop - start).copy_(part.narrow(dim, 0, stop - start))
        covered[start:stop] = True
    if not bool(covered.all()):
        raise ValueError(f"the slices do not cover dim {dim} of full shape {list(full_shape)}")
    return out
