"""The batch-invariant mode's fused CPU attention kernel (parallel/csrc/invariant_attention.cpp), built on
first use by torch's C++ extension loader (a C++ compiler and ninja; the build is cached under
TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions, one directory per source, flags and CPU).

Why a kernel: on the CPU BLAS a product's bits depend on its row count below four rows, so in plain
PyTorch a decode step's one query per head must be computed as a four-row tile to match the full
forward's bits (docs/design.md "Batch-invariant mode"); this kernel fixes each query's rounding in its own
code and reads a decode step's cache once. It is used for fp32 CPU attention when it builds; otherwise
(no compiler, another device, float64, KLTRON_INVARIANT_KERNEL=0) `inv_attention` keeps its plain-PyTorch
blocks. Within one process the choice is made once, so a rollout and the trainer's forward always take
the same path."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import warnings

import torch

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "invariant_attention.cpp")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno"]
_lock = threading.Lock()
_state: dict = {}
_local = threading.local()


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (a build is not moved between CPUs)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _build():
    from torch.utils.cpp_extension import load

    with open(_SRC, "rb") as f:
        src = f.read()
    what = repr((_FLAGS, platform.machine(), _cpu_id(), torch.__version__)).encode()
    tag = hashlib.sha256(src + what).hexdigest()[:16]
    load(name=f"kltron_invariant_{tag}", sources=[_SRC], extra_cflags=_FLAGS, is_python_module=False,
         verbose=False)  # built in TORCH_EXTENSIONS_DIR/<name>
    return torch.ops.kltron_invariant.attention


@contextlib.contextmanager
def use_kernel(on: bool):
    """Inside the block, take (on: where it builds) or skip (off) the kernel on this thread; nests. For
    comparing the kernel with the plain-PyTorch path (the one other devices run) in one process."""
    prev = getattr(_local, "on", None)
    _local.on = bool(on)
    try:
        yield
    finally:
        _local.on = prev


def kernel():
    """The kernel's op, or None where it is off or could not be built (warned once)."""
    if getattr(_local, "on", None) is False:
        return None
    if "op" not in _state:
        with _lock:
            if "op" not in _state:
                op = None
                if os.environ.get("KLTRON_INVARIANT_KERNEL", "1") != "0":
                    try:
                        op = _build()
                    except Exception as e:  # no compiler, no ninja, a failed build: the plain-PyTorch path
                        warnings.warn(f"batch-invariant attention kernel not built ({type(e).__name__}: {e}); "
                                      "using the plain-PyTorch attention (slower decode)", stacklevel=2)
                _state["op"] = op
    return _state["op"]


def applies(q: torch.Tensor) -> bool:
    """Whether `inv_attention` takes the kernel for queries q: fp32 compute on CPU, the kernel built."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and kernel() is not None
