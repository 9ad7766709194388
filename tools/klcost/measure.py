"""Measured rows: run one KL path on this rank's inputs (tools/klcost/methods.py), `warmup` untimed
runs, one run for the peak and the communication, then `repeats` timed runs (median and min).

peak_bytes is the peak of tensor memory allocated inside one run above what existed before it (the
inputs are not counted; the gradients produced are); the row's memory_source says how it was read:
- "memtracker": on CPU by default, MemTracker's peak (torch.distributed._tools.mem_tracker, a
  dispatch mode; also what projections run under, tools/klcost/project.py);
- "profiler": the CPU allocator's own events via torch.profiler (tools/klcost/cpu_peak.py, no
  dispatch mode), with `cpu_peak="profiler"` (--cpu-peak profiler), and always for the compiled
  peer cce_k3 (no dispatch mode around torch.compile); cpu_peak.py says where the two differ;
- "cuda_allocator": on CUDA, torch.cuda.max_memory_allocated() minus torch.cuda.memory_allocated()
  before the run.
The timed runs are not tracked (MemTracker's hooks would inflate them); on CUDA they are bracketed
by torch.cuda.synchronize(). A compiled method (COMPILED) gets at least one warm-up run, so the
compile is neither in the peak nor in the timed repeats; first_run_s is the first warm-up run's
time (for cce_k3: torch.compile's one-time cost plus one run), None without a warm-up.
comm_bytes / comm_calls are this rank's payload to kltron's collectives in one run
(parallel.comm.count_comm), copy_to_tp's backward all-reduce included.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from parallel import comm
from parallel.vocab_stats import resolve_chunk_size
from tools.klcost.cpu_peak import profiled_peak
from tools.klcost.methods import CHUNKED, DTYPES, METHODS, Inputs, outputs
from tools.klcost.peers import COMPILED, PEERS, peer_outputs

CPU_PEAKS = ("memtracker", "profiler")


def describe(name: str) -> tuple[str, str]:
    """(method, mode) of a built-in method or a peer."""
    return METHODS[name] if name in METHODS else PEERS[name]


def _run(name, x: Inputs, group, chunk, backward):
    """One forward (or forward+backward) of `name`; returns its per-token outputs, detached."""
    x.h.grad = x.w.grad = None
    with torch.set_grad_enabled(backward):
        outs, loss = (outputs(name, x, group, chunk, backward) if name in METHODS
                      else peer_outputs(name, x, chunk, backward))
        if backward and loss is not None:
            loss.backward()
    return tuple(None if o is None else o.detach() for o in outs)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def memory_source(name, device, cpu_peak="memtracker", fake=False) -> str:
    """How `name`'s peak is read (the module docstring): memtracker, profiler or cuda_allocator."""
    if device == "cuda" and not fake:
        return "cuda_allocator"
    if fake or device == "meta":
        return "memtracker"
    return "profiler" if cpu_peak == "profiler" or name in COMPILED else "memtracker"


def _tracked_peak(name, x, group, chunk, backward, device, fake=False, cpu_peak="memtracker"):
    """(peak bytes above the start, outputs, CommCounter) of one run, read as memory_source() says:
    MemTracker on CPU and under a fake mode or on meta tensors (tools/klcost/project.py), the CPU
    allocator's profiler events, or the allocator's peak on a real GPU."""
    if not fake:
        gc.collect()
    source = memory_source(name, device, cpu_peak, fake)
    if source == "profiler":
        x.h.grad = x.w.grad = None  # free the last run's gradients first: frees of older memory are not seen
        with comm.count_comm() as counter:
            peak, outs = profiled_peak(lambda: _run(name, x, group, chunk, backward))
        return peak, outs, counter
    if source == "cuda_allocator":
        _sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with comm.count_comm() as counter:
            outs = _run(name, x, group, chunk, backward)
        _sync(device)
        return torch.cuda.max_memory_allocated() - base, outs, counter
    from torch.distributed._tools.mem_tracker import MemTracker

    total = lambda snap: int(sum(d["Total"] for d in snap.values()))
    tracker = MemTracker()
    tracker.track_external(*x.tensors())  # known from the start, so views of them are not new
    with comm.count_comm() as counter, tracker:
        base = total(tracker.get_tracker_snapshot("current"))
        outs = _run(name, x, group, chunk, backward)
    return total(tracker.get_tracker_snapshot("peak")) - base, outs, counter


def _mean(t):
    return None if t is None else float(t.double().mean())


def measure(name, pass_, T, H, V, dtype, chunk, group=None, seed=0, device="cpu", warmup=1, repeats=3,
            fake=False, cpu_peak="memtracker", ref_hidden=None) -> dict:
    """One measured row for `name` at this shape on this rank (see the module docstring). `chunk`:
    tokens per chunk, or None / "auto" (parallel/vocab_stats.py's auto_chunk_size for T and this
    rank's head [Vp/tp, H] in `dtype`, what the fused heads pick by default); the row reports the chunk used.
    `cpu_peak`: "memtracker" or "profiler", how a CPU peak is read (cce_k3 always by the profiler)."""
    if cpu_peak not in CPU_PEAKS:
        raise ValueError(f"cpu_peak must be one of {CPU_PEAKS}, got {cpu_peak!r}")
    tp, rank = comm.group_size(group), comm.group_rank(group)
    backward = pass_ == "forward+backward"
    x = Inputs(T, H, V, tp, rank, DTYPES[dtype], seed, backward, device, fake, ref_hidden)
    chunk = resolve_chunk_size(chunk, T, x.Vp // tp, H, x.w.element_size())
    if name in COMPILED and not fake:
        warmup = max(warmup, 1)  # the compile belongs to neither the peak nor the timed repeats
    first_run = None
    for i in range(warmup):
        start = time.perf_counter()
        _run(name, x, group, chunk, backward)
        _sync(device)
        first_run = time.perf_counter() - start if i == 0 else first_run
    peak, outs, counter = _tracked_peak(name, x, group, chunk, backward, device, fake, cpu_peak)
    times = []
    for _ in range(repeats):
        gc.collect()
        _sync(device)
        start = time.perf_counter()
        _run(name, x, group, chunk, backward)
        _sync(device)
        times.append(time.perf_counter() - start)
    method, mode = describe(name)
    row = dict(name=name, method=method, mode=mode, source="measured", tokens=T, hidden=H, vocab=V, tp=tp,
               dtype=dtype, device=device, chunk_size=chunk if name in CHUNKED else None, peak_bytes=int(peak),
               memory_source=memory_source(name, device, cpu_peak, fake),
               first_run_s=None if first_run is None else round(first_run, 5),
               time_s=round(statistics.median(times), 5) if times else None,
               time_min_s=round(min(times), 5) if times else None, repeats=repeats, warmup=warmup,
               comm_bytes=counter.bytes, comm_calls=counter.calls,
               logprob_mean=_mean(outs[0]), entropy_mean=_mean(outs[1]), kl_mean=_mean(outs[2]),
               ref_hidden=H if ref_hidden is None else ref_hidden,
               **{"pass": pass_})
    del x, outs
    if not fake:
        gc.collect()
    return row


def add_floor_ratios(rows: list[dict]) -> list[dict]:
    """time_vs_floor = time_s / the matmul floor's time_s at the same shape, pass, tp and dtype (same run)."""
    key = lambda r: (r["pass"], r["tokens"], r["hidden"], r["vocab"], r["tp"], r["dtype"])
    floors = {key(r): r["time_s"] for r in rows if r["name"] == "matmul_floor" and r.get("time_s")}
    for r in rows:
        f = floors.get(key(r))
        r["time_vs_floor"] = round(r["time_s"] / f, 4) if f and r.get("time_s") else None
    return rows


def run_all(names, passes, shapes, dtype, chunk, group=None, seed=0, device="cpu", warmup=1, repeats=3,
            log=None, cpu_peak="memtracker", ref_hidden=None) -> list[dict]:
    """Measured rows for every (shape (T, H, V), pass, name) on this rank. Before each row, what is
    still alive after a collection (torch's modules, those the row before imported: none of it garbage)
    is frozen out of the garbage collector's scans until the end (`gc.freeze`), so that the row's own
    `gc.collect()` calls walk only what the row made: 0.1-0.15 s a call on CPU otherwise, most of a
    small grid's time, and no byte of any peak."""
    rows = []
    try:
        for T, H, V in shapes:
            for pass_ in passes:
                for name in names:
                    gc.collect()
                    gc.freeze()
                    row = measure(name, pass_, T, H, V, dtype, chunk, group, seed, device, warmup, repeats,
                                  cpu_peak=cpu_peak, ref_hidden=ref_hidden)
                    rows.append(row)
                    if log:
                        log(row)
    finally:
        gc.unfreeze()
    return add_floor_ratios(rows)
