"""Peak memory per phase (core/runtime/metrics.PhaseTimer(memory=...)): a phase that holds a known
allocation reports at least that much more than a phase that holds none, and the step's peak
covers every phase even though each phase resets the high-water mark."""

from __future__ import annotations

import numpy as np
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
    with timer("big"):
        a = np.ones(200 * MB // 8)  # 200 MiB, touched
        del a
    with timer("small"):
        b = np.ones(MB // 8)
        del b
    step = peak_memory(dev)
    out = timer.pop()
    assert out["peak_mem_big_bytes"] - out["peak_mem_small_bytes"] > 150 * MB
    assert step["peak_mem_bytes"] >= out["peak_mem_big_bytes"]
    assert out["peak_mem_phase_kind"] == "cpu_rss_hwm" and "time_big_s" in out
    assert timer.pop() == {}, "pop() resets"
