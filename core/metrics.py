"""Training metrics: a JSONL writer and a progress bar (rank 0 only), peak memory, throughput, and
a timer for named phases.

`MetricsWriter` writes one JSON object per line and flushes each line, so a crashed run keeps every
step it logged. `ProgressBar` writes plain text to stderr: on a terminal it redraws one line; in a
non-terminal log (CI) it prints a full line every `every` steps and at the end.

Peak memory: on CUDA `torch.cuda.max_memory_allocated` (bytes held by tensors, kind
"cuda_max_allocated"); on CPU the process's peak resident set size from `getrusage` (kind
"cpu_max_rss": everything the process ever held, not only tensors, and never reset).
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
        if self._f is None:
            return
        self._f.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._f.flush()

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


def reset_peak_memory(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict:
    """{"peak_mem_bytes": int, "peak_mem_kind": "cuda_max_allocated" | "cpu_max_rss"}."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"peak_mem_bytes": int(torch.cuda.max_memory_allocated(device)),
                "peak_mem_kind": "cuda_max_allocated"}
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return {"peak_mem_bytes": int(rss_kb) * 1024, "peak_mem_kind": "cpu_max_rss"}


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
    {"time_forward_s": ...} and resets. `sync` waits for the device first (CUDA is async)."""

    def __init__(self, device: torch.device | None = None):
        self.device = torch.device(device) if device is not None else None
        self.totals: dict[str, float] = defaultdict(float)

    def _sync(self):
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - t0

    def pop(self) -> dict:
        out = {f"time_{k}_s": v for k, v in self.totals.items()}
        self.totals.clear()
        return out
