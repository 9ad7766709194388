"""Training metrics: a JSONL writer and a progress bar (rank 0 only), peak memory, throughput, and
a timer for named phases.

`MetricsWriter` writes one JSON object per line and flushes each line, so a crashed run keeps every
step it logged. `ProgressBar` writes plain text to stderr: on a terminal it redraws one line; in a
non-terminal log (CI) it prints a full line every `every` steps and at the end.

Peak memory: on CUDA `torch.cuda.max_memory_allocated` (bytes held by tensors, kind
"cuda_max_allocated"); on Linux CPUs the process's resident-set high-water mark VmHWM, reset per
interval through /proc/self/clear_refs (kind "cpu_rss_hwm": everything the process holds, not
only tensors); without /proc, `getrusage`'s lifetime peak (kind "cpu_max_rss", never reset).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from core.runtime.lifecycle import whole_write


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan" / "inf": strict JSON has no non-finite numbers
    return v


class MetricsWriter:
    """Writes `{"step": ..., ...}` lines to `path` on the main rank; a no-op elsewhere.
    mode "a" appends (a resumed run), "w" starts the file afresh."""

    def __init__(self, path: str, enabled: bool = True, mode: str = "a"):
        self.path, self.enabled = path, enabled
        self._f = None
        if enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f = open(path, mode, encoding="utf-8")

    def write(self, record: dict) -> None:
        """Append one line. A failed write (a full disk) is cut back to the last whole line before the
        error is raised, so the file never holds a torn record that readers and resumes would refuse."""
        if self._f is None:
            return
        line = json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n"
        end = self._f.tell()
        try:
            with whole_write():  # the watchdog's abort does not end the process halfway through the line
                self._f.write(line)
                self._f.flush()
        except OSError as e:
            old, self._f = self._f, None
            try:
                old.close()  # first: closing flushes what the handle still buffers
            except OSError:
                pass
            try:
                with open(self.path, "r+", encoding="utf-8") as f:
                    f.truncate(end)
                self._f = open(self.path, "a", encoding="utf-8")
            except OSError:
                pass
            if e.filename is None:
                e.filename = self.path
            raise

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class ProgressBar:
    """`bar.update(step, loss=..., ...)` after each step (1-based steps up to `total`)."""

    def __init__(self, total: int, enabled: bool = True, every: int = 10, stream=None, width: int = 24):
        self.total, self.enabled, self.every, self.width = total, enabled, max(1, every), width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()

    def _line(self, step: int, fields: dict) -> str:
        frac = min(step / self.total, 1.0) if self.total else 1.0
        filled = int(round(frac * self.width))
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / step * (self.total - step) if step else 0.0
        parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()]
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} "
                f"{elapsed:.0f}s<{eta:.0f}s " + " ".join(parts))

    def update(self, step: int, **fields) -> None:
        if not self.enabled:
            return
        last = step >= self.total
        if self.tty:
            self.stream.write("\r" + self._line(step, fields) + ("\n" if last else ""))
        elif step % self.every == 0 or step == 1 or last:
            self.stream.write(self._line(step, fields) + "\n")
        self.stream.flush()


_carried: dict[str, int] = {}  # per device: the step's peak from phases already measured and reset


def _cpu_hwm_reset() -> bool:
    """Reset the process's resident-set high-water mark (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def _current_peak(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    hwm = _cpu_hwm_bytes()
    if hwm is not None:
        return hwm, "cpu_rss_hwm"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_max_rss"  # kB on Linux


def _reset_current(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _cpu_hwm_reset()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory interval (a step): the allocator's peak on CUDA, the RSS high-water
    mark on Linux CPUs."""
    device = torch.device(device)
    _carried.pop(str(device), None)
    _reset_current(device)


def peak_memory(device: torch.device) -> dict:
    """{"peak_mem_bytes": int, "peak_mem_kind": "cuda_max_allocated" | "cpu_rss_hwm" | "cpu_max_rss"}
    since `reset_peak_memory`, including phases that `PhaseTimer(memory=...)` measured and reset
    in between. "cpu_max_rss" (no /proc) is the process's lifetime peak, never reset."""
    device = torch.device(device)
    peak, kind = _current_peak(device)
    return {"peak_mem_bytes": max(peak, _carried.get(str(device), 0)), "peak_mem_kind": kind}


def phase_peak_begin(device: torch.device) -> None:
    """Reset the peak for a phase, carrying what was reached so far into the interval's peak."""
    device = torch.device(device)
    _carried[str(device)] = max(_carried.get(str(device), 0), _current_peak(device)[0])
    _reset_current(device)


def phase_peak_end(device: torch.device) -> tuple[int, str]:
    """(peak bytes since `phase_peak_begin`, kind)."""
    return _current_peak(torch.device(device))


class Throughput:
    """Tokens per second over the interval since the previous `update` (or construction)."""

    def __init__(self):
        self.t = time.perf_counter()
        self.tokens_total = 0

    def update(self, tokens: int) -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        self.tokens_total += tokens
        return tokens / dt if dt > 0 else float("inf")


class PhaseTimer:
    """`with timer("forward"): ...` accumulates wall time per phase; `pop()` returns
    {"time_forward_s": ...} and resets. `sync` waits for the device first (CUDA is async).

    `memory={"phase": "key"}`: those phases also record their peak memory (the allocator's on
    CUDA, the RSS high-water mark on CPU; see `peak_memory`) as `peak_mem_<key>_bytes`, the
    largest over the phase's entries since the last `pop()`, with `peak_mem_phase_kind`."""

    def __init__(self, device: torch.device | None = None, memory: dict[str, str] | None = None):
        self.device = torch.device(device) if device is not None else None
        self.totals: dict[str, float] = defaultdict(float)
        self.memory = dict(memory or {})
        self.peaks: dict[str, int] = {}
        self.mem_kind: str | None = None

    def _sync(self):
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, name: str):
        self._sync()
        mem = self.memory.get(name) if self.device is not None else None
        if mem is not None:
            phase_peak_begin(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - t0
            if mem is not None:
                peak, self.mem_kind = phase_peak_end(self.device)
                key = f"peak_mem_{mem}_bytes"
                self.peaks[key] = max(self.peaks.get(key, 0), peak)

    def pop(self) -> dict:
        out = {f"time_{k}_s": v for k, v in self.totals.items()}
        out.update(self.peaks)
        if self.peaks:
            out["peak_mem_phase_kind"] = self.mem_kind
        self.totals.clear()
        self.peaks.clear()
        return out
