"""Peak memory per phase (core/runtime/metrics.PhaseTimer(memory=...)): a phase that holds a known
allocation reports at least that much more than a phase that holds none, and the step's peak
covers every phase even though each phase resets the high-water mark."""

from __future__ import annotations

import mmap

import pytest
import torch

from core.runtime.metrics import PhaseTimer, peak_memory, reset_peak_memory

MB = 2**20


def test_phase_peaks_see_a_known_allocation():
    if peak_memory("cpu")["peak_mem_kind"] != "cpu_rss_hwm":
        pytest.skip("no resettable RSS high-water mark (/proc/self/clear_refs) here")
    dev = torch.device("cpu")
    timer = PhaseTimer(dev, memory={"big": "big", "small": "small"})
    reset_peak_memory(dev)
    # fresh anonymous pages, touched: a long-lived process's allocator may hold free resident memory that
    # would serve an ordinary allocation without the resident set growing
    with timer("big"):
        a = mmap.mmap(-1, 200 * MB)
        a.write(b"\1" * (200 * MB))
        a.close()
    with timer("small"):
        b = mmap.mmap(-1, MB)
        b.write(b"\1" * MB)
        b.close()
    step = peak_memory(dev)
    out = timer.pop()
    assert out["peak_mem_big_bytes"] - out["peak_mem_small_bytes"] > 150 * MB
    assert step["peak_mem_bytes"] >= out["peak_mem_big_bytes"]
    assert out["peak_mem_phase_kind"] == "cpu_rss_hwm" and "time_big_s" in out
    assert timer.pop() == {}, "pop() resets"
