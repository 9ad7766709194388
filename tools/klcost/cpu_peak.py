"""The CPU allocator's peak over one call, read from torch.profiler's memory events: no dispatch mode.

Why not always MemTracker (torch.distributed._tools.mem_tracker), which measure.py uses on CPU: it is a
TorchDispatchMode, and a dispatch mode is part of the program it measures. Whether torch.compile'd
code (Cut Cross-Entropy's torch_compile implementation) compiles under one depends on the torch
version (an earlier note here said it did not; with torch 2.13 it does, and both measures read
cce_k3 alike); a measure without a mode does not depend on it. Two more consequences, found while
adding this (tests/test_kl_cpu_peak.py checks both on small programs):
- it sees the tensors that aten ops return, not the temporaries a single kernel allocates and frees
  inside itself (torch.logsumexp's [T, V] exp(z - max): the verl-style peer's forward peak);
- its presence changes what the program allocates: under any dispatch mode (a no-op one too),
  TRL's selective_log_softmax backward builds gather's gradient as new_zeros plus an out-of-place
  scatter_add and autograd sums two incoming gradients out of place, one [T, V] more at the peak
  than the same backward allocates without a mode.
kltron's own methods (one op per buffer, no in-kernel [T, V] temporaries) read the same under both,
to a few bytes; tests/test_kl_cpu_peak.py checks it.

How: torch.profiler(profile_memory=True) records an event per allocation and free of the CPU
allocator (c10's DefaultCPUAllocator, which inductor-compiled code also allocates through: its
buffers are at::empty_strided), with the address and size. `profiled_peak` integrates them in time
order: + size per allocation, - size per free of an address allocated inside the call; the peak is
the largest running sum, above what was live when the call started. Frees of memory that existed
before the call are not counted (the profiler does not know their sizes), so the caller frees what
it can before (measure.py drops the previous run's gradients). Memory that oneDNN / OpenMP allocate
outside the c10 allocator (GEMM scratch) is in neither measure.
"""

from __future__ import annotations

import gc

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def _allocation_events(prof, device_type: str) -> list[tuple[int, int, int]]:
    """(time ns, signed bytes, address) of every allocator event on `device_type`, in time order."""
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == device_type:
            f = e.extra_fields
            events.append((e.start_time_ns, int(f.alloc_size), int(f.ptr)))
        stack.extend(e.children)
    events.sort(key=lambda ev: ev[0])  # stable: same-time events keep the tree's (record) order
    return events


def peak_of_events(events) -> int:
    """Largest running sum of the bytes live, from (time, signed bytes, address) events in time order;
    a free counts only when its address was allocated in `events` (and is still live)."""
    live: dict[int, int] = {}
    now = peak = 0
    for _, nbytes, ptr in events:
        if nbytes > 0:
            live[ptr] = nbytes
            now += nbytes
            peak = max(peak, now)
        elif nbytes < 0 and ptr in live:
            now -= live.pop(ptr)
    return peak


def profiled_peak(fn, device_type: str = "cpu"):
    """(peak bytes allocated above the start while fn() ran, fn()'s result). The result is returned
    while still profiled, so memory it keeps counts (as MemTracker counts it)."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return peak_of_events(_allocation_events(prof, device_type)), result
