"""Projected rows: the same code as a measured row (tools/klcost/measure.py's run of a method) run on
tensors that have shapes, dtypes and storages but no memory: meta tensors for the GPU's code path
(the default, `device="cuda"`), fake CPU tensors (torch._subclasses.FakeTensorMode) for this
machine's; MemTracker counts their storages exactly as it counts real ones. At tp > 1 the rank
runs in this one process against a "fake" process group (torch.testing's FakeStore backend: collectives return
at once), so its shard widths, buffers and collective payloads are those of a real rank; comm
bytes come from the same parallel.comm counter. No time is projected (time_s is None).

Two liberties, both outside the memory path: data-dependent scalars (validation such as
`bool((targets >= V).any())`) read as 0 under the fake mode, and rank 0 stands for every rank
(the shards differ by at most the vocabulary padding).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from core.config import ModelConfig
from parallel.vocab_stats import resolve_chunk_size
from tools.klcost.measure import describe, measure
from tools.klcost.methods import CHUNKED, DTYPES, METHODS

PROJECTABLE = set(METHODS) | {"verl_k3", "trl_k3"}  # plain torch code: runs under FakeTensorMode
_FAKE_WORLD = 64  # ranks of the fake group; tp groups are its first tp ranks
_groups: dict[int, object] = {}


class _ZeroScalars(TorchDispatchMode):
    """Under the fake mode, a tensor's data-dependent scalar (item(), bool()) reads as 0."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 0
        return func(*args, **(kwargs or {}))


def fake_group(tp: int):
    """A process group of `tp` fake ranks in this process (None at tp = 1)."""
    if tp == 1:
        return None
    if tp > _FAKE_WORLD:
        raise ValueError(f"--project supports tp <= {_FAKE_WORLD}, got {tp}")
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=_FAKE_WORLD)
    elif dist.get_backend() != "fake":
        raise RuntimeError("--project needs its own fake process group, but this process already runs a real "
                           f"{dist.get_backend()} group")
    if tp not in _groups:
        _groups[tp] = dist.new_group(list(range(tp)))
    return _groups[tp]


EXTRAPOLATE_FROM = (4, 8)  # chunks: a chunked method's row at many chunks is extrapolated from these two
# vp_chunked is not: it holds [T, Vp/tp] logits in forward and their gradients in backward, so its
# peak is the larger of two phases whose slopes in T differ, and the steeper one takes over at some
# T (13 chunks of 64 at H=16, V=1000 bf16; 14 before the fused heads' temporaries shrank): not affine
EXTRAPOLATED = CHUNKED - {"vp_chunked"}


def project(name, pass_, T, H, V, tp, dtype, chunk, seed=0, device="cuda", extrapolate=True, ref_hidden=None) -> dict:
    """One projected row: `name`'s peak (and comm) at this shape, one rank of tp, without allocating.

    A fused chunked method (every chunk the same work, the O(T) buffers made up front, the same
    phase at the peak: EXTRAPOLATED) has a peak, comm bytes and calls affine in the number of
    chunks at a fixed chunk c and remainder r = T mod c; with `extrapolate` and T = n c + r, n > 8,
    the row is projected at 4 c + r and 8 c + r and extrapolated linearly to n (exact integers;
    tests/test_kl_memory.py checks it equals the direct projection), so 128k tokens cost as much
    as 8 chunks. `extrapolated_from` marks such a row.
    """
    c = resolve_chunk_size(chunk, T, ModelConfig(vocab_size=V).padded_vocab_size(tp) // tp, H, DTYPES[dtype].itemsize)
    a, b = EXTRAPOLATE_FROM
    r = T % c  # the last, short chunk: the same in the two runs extrapolated from
    if extrapolate and name in EXTRAPOLATED and T // c > b:
        ra = project(name, pass_, a * c + r, H, V, tp, dtype, c, seed, device, False, ref_hidden)
        rb = project(name, pass_, b * c + r, H, V, tp, dtype, c, seed, device, False, ref_hidden)
        for k in ("peak_bytes", "comm_bytes", "comm_calls"):
            rb[k] += (rb[k] - ra[k]) * (T // c - b) // (b - a)
        rb.update(tokens=T, extrapolated_from=[a * c + r, b * c + r])
        return rb
    return _project_one(name, pass_, T, H, V, tp, dtype, c, seed, device, ref_hidden)


def _project_one(name, pass_, T, H, V, tp, dtype, chunk, seed, device, ref_hidden=None) -> dict:
    """project() of one shape, run in full; `device` as for project():
    `device`: whose code path to project. "cuda": the GPU's path (the head's fp32 logits straight out
    of torch.mm(out_dtype=float32)), run on meta tensors, which take that path and allocate
    nothing (and dispatch ~2x faster than fake tensors); "cpu": this machine's path (bf16 weights
    upcast block by block), run on fake CPU tensors, as measured rows here run it."""
    if name not in PROJECTABLE:
        raise ValueError(f"{name} cannot be projected (compiled or Triton kernels); projectable: {sorted(PROJECTABLE)}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"project: device must be 'cuda' or 'cpu', got {device!r}")
    created = tp > 1 and not dist.is_initialized()
    group = fake_group(tp)
    try:
        with FakeTensorMode() if device == "cpu" else contextlib.nullcontext(), _ZeroScalars():
            row = measure(name, pass_, T, H, V, dtype, chunk, group, seed, warmup=0, repeats=0, fake=True,
                          device="meta" if device == "cuda" else device, ref_hidden=ref_hidden)
    finally:
        if created:  # leave no fake default group behind (the process may run real work afterwards)
            _groups.clear()
            dist.destroy_process_group()
    method, mode = describe(name)
    row.update(source="projected", tp=tp, method=method, mode=mode, device=device, time_s=None, time_min_s=None,
               time_vs_floor=None, repeats=0, warmup=0, logprob_mean=None, entropy_mean=None, kl_mean=None)
    return row


def project_all(names, passes, shapes, tps, dtype, chunk, log=None, device="cuda", ref_hidden=None) -> list[dict]:
    """Projected rows for every (shape (T, H, V), tp, pass, name)."""
    rows = []
    for T, H, V in shapes:
        for tp in tps:
            for pass_ in passes:
                for name in names:
                    rows.append(project(name, pass_, T, H, V, tp, dtype, chunk, device=device, ref_hidden=ref_hidden))
                    if log:
                        log(rows[-1])
    return rows


def input_bytes(T, H, V, tp, dtype) -> int:
    """Bytes of one rank's inputs (not in peak_bytes): hidden x2, head shards x2, targets, coefficients."""
    es = torch.empty((), dtype=DTYPES[dtype], device="cpu").element_size()
    width = ModelConfig(vocab_size=V).padded_vocab_size(tp) // tp
    return 2 * T * H * es + 2 * width * H * es + 8 * T + 4 * 3 * T


def available_bytes(device: str) -> int:
    """Memory free for the run: CUDA's free device memory, or the OS's MemAvailable."""
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def refuse_if_too_big(ap, names, passes, shapes, tps, a):
    """Before measuring: project each shape's largest peak (plus inputs, times the ranks that share this
    machine) and stop with the numbers when it exceeds 90% of the free memory (unless --force)."""
    free = available_bytes(a.device)
    if a.force or not free:
        return
    for T, H, V in shapes:
        for tp in tps:
            crude = (10 * T * ModelConfig(vocab_size=V).padded_vocab_size(1) * 4 + 4 * T * H * 4) * tp
            if crude < 0.5 * free:
                continue  # far below the free memory whatever the method: no need to project
            peaks = [project(n, p, T, H, V, tp, a.dtype, a.chunk_size, device=a.device,
                             ref_hidden=getattr(a, "ref_hidden", None))["peak_bytes"]
                     for n in names if n in PROJECTABLE for p in passes]
            need = (max(peaks, default=0) + input_bytes(T, H, V, tp, a.dtype)) * (tp if a.device == "cpu" else 1)
            if need > 0.9 * free:
                ap.error(f"measuring T={T} H={H} V={V} tp={tp} {a.dtype} needs about {need / 2**30:.2f} GiB "
                         f"(projected peak + inputs{', x tp ranks' if tp > 1 else ''}) but {free / 2**30:.2f} GiB "
                         f"is free on {a.device}; use --project, a smaller shape, or --force")
