"""What other RL trainers run for the KL term, side by side with kltron's paths (tp = 1 only: none
of them shards the vocabulary). Each returns (log p(t) [T], None, k3 or JSD [T]) and the loss, like
tools/klcost/methods.py. Optional packages that are not installed are skipped with a note.

| name      | needs                  | what it does                                                            |
|-----------|------------------------|-------------------------------------------------------------------------|
| verl_k3   | -                      | full logits of both models, log-prob of the sampled token as            |
|           |                        | z[t] - logsumexp(z) per row (as verl / OpenRLHF compute it), then k3     |
| trl_k3    | trl                    | full logits, trl's selective_log_softmax for both models, then k3        |
| cce_k3    | cut-cross-entropy      | Cut Cross-Entropy's linear_cross_entropy(impl="torch_compile") gives     |
|           |                        | log p(t) and log q(t), then k3. That implementation is the package's     |
|           |                        | compiled reference (e @ c.T, then cross_entropy, under torch.compile):  |
|           |                        | inductor fuses the softmax but the [T, V] logits are made and kept for   |
|           |                        | backward; the cut kernels (impl="cce", no logits) are Triton, CUDA only |
| liger_jsd | liger-kernel, CUDA     | Liger's fused linear JSD (a generalized JSD, not KL) on CUDA only        |

cce_k3 is compiled (COMPILED): tools/klcost/measure.py gives it a warm-up run for the compile and
reads its CPU peak from the allocator's profiler events (tools/klcost/cpu_peak.py), which need no
dispatch mode around compiled code (whether torch.compile traces under MemTracker's depends on
the torch version).
"""

from __future__ import annotations

import torch

from tools.klcost.methods import Inputs, k3, linear_loss

PEERS = {"verl_k3": ("verl", "k3"), "trl_k3": ("trl", "k3"), "cce_k3": ("cce", "k3"),
         "liger_jsd": ("liger", "jsd")}
COMPILED = {"cce_k3"}  # torch.compile'd: a warm-up run compiles it; no dispatch mode around it
_NEEDS = {"trl_k3": "trl", "cce_k3": "cut_cross_entropy", "liger_jsd": "liger_kernel"}


def _installed(name: str) -> bool:
    """Whether the optional package peer `name` needs imports (a missing one is skipped, not an error)."""
    try:
        if name == "trl_k3":
            import trl  # noqa: F401
        elif name == "cce_k3":
            import cut_cross_entropy  # noqa: F401
        elif name == "liger_jsd":
            import liger_kernel  # noqa: F401
    except ImportError:
        return False
    except Exception:  # noqa: BLE001 - installed but broken here: unavailable() says why for cce
        return name == "cce_k3"
    return True


def unavailable(name: str, device: str) -> str | None:
    """Why peer `name` cannot run here (a note for the report), or None when it can."""
    mod = _NEEDS.get(name)
    if mod is not None and not _installed(name):
        return f"{name}: skipped, package {mod!r} is not installed"
    if name == "liger_jsd" and device != "cuda":
        return "liger_jsd: skipped, Liger's Triton kernels run on CUDA only"
    if name == "cce_k3":
        try:
            import cut_cross_entropy  # noqa: F401 - it imports triton at import time
        except Exception as e:  # noqa: BLE001 - any import failure means: skip with the reason
            return f"cce_k3: skipped, cut_cross_entropy does not import here ({type(e).__name__}: {e})"
        if device == "cpu" and not _cxx_compiler():
            return "cce_k3: skipped on CPU, torch.compile's CPU backend needs a C++ compiler (g++, clang++ or $CXX)"
    return None


def _cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would use ($CXX, else g++ / clang++ / c++), or None."""
    import os
    import shutil

    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
    return next((p for p in map(shutil.which, names) if p), None)


def _full_logits(x: Inputs):
    return x.h @ x.w.T, x.hr @ x.wr.T  # [T, V] each (tp = 1: the whole head)


def _verl_logprobs(z, t):
    """log p(t) = z[t] - logsumexp(z), per row, in fp32: the gather-then-normalise form."""
    z = z.float()
    return z.gather(-1, t[:, None])[:, 0] - torch.logsumexp(z, -1)


def peer_outputs(name, x: Inputs, chunk, backward):
    """((log p(t), None, KL-ish [T]), loss) for one peer at tp = 1."""
    if name == "verl_k3":
        zp, zq = _full_logits(x)
        lp = _verl_logprobs(zp[:, :x.V], x.t)
        with torch.no_grad():
            lq = _verl_logprobs(zq[:, :x.V], x.t)
    elif name == "trl_k3":
        from trl.trainer.utils import selective_log_softmax

        zp, zq = _full_logits(x)
        lp = selective_log_softmax(zp[:, :x.V].float(), x.t)
        with torch.no_grad():
            lq = selective_log_softmax(zq[:, :x.V].float(), x.t)
    elif name == "cce_k3":
        from cut_cross_entropy import linear_cross_entropy

        ce = lambda h, w: linear_cross_entropy(h, w[:x.V], x.t, reduction="none", impl="torch_compile")
        lp = -ce(x.h, x.w).float()  # cross entropy of the target = -log p(t)
        with torch.no_grad():
            lq = -ce(x.hr, x.wr).float()
    elif name == "liger_jsd":
        return _liger_jsd(x)
    else:
        raise ValueError(f"unknown peer {name!r}; choose from {list(PEERS)}")
    outs = (lp, None, k3(lp, lq))
    return outs, linear_loss(outs, x.coef)


def _liger_jsd(x: Inputs):
    """Liger's LigerFusedLinearJSD(student_input, student_weight, teacher_input, teacher_weight): a
    mean generalized JSD (beta 0.5) over tokens; no per-token values, so the outputs are empty."""
    from liger_kernel.transformers import LigerFusedLinearJSD

    loss = LigerFusedLinearJSD()(x.h, x.w[:x.V], x.hr, x.wr[:x.V])
    return (None, None, None), loss
