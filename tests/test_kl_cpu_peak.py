"""tools/klcost/cpu_peak.py: the CPU allocator's peak from torch.profiler's memory events, against
hand-counted programs and against MemTracker on kltron's own KL paths; the two places where a
dispatch mode (MemTracker's) reads a different peak; and the Cut Cross-Entropy peer it measures."""

import contextlib
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tools import kl_memory
from tools.klcost import methods, peers
from tools.klcost.cpu_peak import peak_of_events, profiled_peak
from tools.klcost.measure import measure

F32 = 4


def test_peak_of_a_hand_written_program():
    """a (4000 B) and b (12000 B) live, a freed, c (8000 B) made: the peak is b + c = 20000 B above the
    start; `old` existed before and its free is not subtracted; c is returned (still live)."""
    old = torch.empty(5000, device="cpu")

    def program():
        nonlocal old
        a = torch.empty(1000, device="cpu")
        b = torch.empty(3000, device="cpu")
        del a
        old = None
        c = torch.empty(2000, device="cpu")
        return b, c

    peak, (b, c) = profiled_peak(program)
    assert peak == (3000 + 2000) * F32
    assert c.numel() == 2000 and b.numel() == 3000


def test_peak_of_events_counts_only_frees_it_saw_allocated():
    # (time, signed bytes, address): 10 @1, 20 @2, free @1, free of an older @9, 5 @3, free @2
    events = [(0, 10, 1), (1, 20, 2), (2, -10, 1), (3, -100, 9), (4, 5, 3), (5, -20, 2)]
    assert peak_of_events(events) == 30  # 10 + 20; the unknown free of 100 B is not subtracted


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in (
    "gather", "vp_materialized", "fused_k3")] + ["fused_exact_loss"])  # one of each kind: suite time
def test_profiler_agrees_with_memtracker_on_kltrons_methods(name):
    """The same allocations read by two instruments (a dispatch mode's view of op outputs, the
    allocator's own events): kltron's paths make no in-kernel [T, V] temporaries, so within 1%."""
    for p in ("forward", "forward+backward"):
        mt = measure(name, p, 200, 24, 1000, "fp32", 64, warmup=0, repeats=1)
        pr = measure(name, p, 200, 24, 1000, "fp32", 64, warmup=0, repeats=1, cpu_peak="profiler")
        assert (mt["memory_source"], pr["memory_source"]) == ("memtracker", "profiler")
        assert abs(pr["peak_bytes"] - mt["peak_bytes"]) <= 0.01 * mt["peak_bytes"], (name, p, mt, pr)
        assert pr["kl_mean"] == mt["kl_mean"]  # the same run, whatever watches it


class _NoOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _memtracker_peak(fn, *known):
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*known)
    total = lambda snap: sum(d["Total"] for d in snap.values())
    with tracker:
        base = total(tracker.get_tracker_snapshot("current"))
        fn()
    return total(tracker.get_tracker_snapshot("peak")) - base


def test_in_kernel_temporary_is_seen_by_the_profiler_only():
    """torch.logsumexp over [T, V] makes exp(z - max) [T, V] inside its kernel (the verl-style peer's
    forward): the allocator sees it, a dispatch mode sees only the [T] result."""
    T, V = 64, 5000
    z = torch.randn(T, V, device="cpu")
    prof, _ = profiled_peak(lambda: torch.logsumexp(z, -1))
    assert prof >= T * V * F32
    assert _memtracker_peak(lambda: torch.logsumexp(z, -1), z) < T * V * F32 // 10


def test_a_dispatch_mode_changes_what_trls_backward_allocates():
    """TRL's selective_log_softmax for fp32 (written out: gather, then logsumexp row by row): its
    backward peaks at three [T, V] (z, the stacked row gradients, gather's gradient) without a mode
    and at four under a no-op dispatch mode (gather_backward's new_zeros + out-of-place scatter_add,
    an out-of-place gradient sum)."""
    T, V = 4, 50000
    x = torch.randn(T, V, device="cpu", requires_grad=True)
    t = torch.randint(0, V, (T,), device="cpu")

    def step(mode):
        with mode:
            z = x * 1.0
            lp = z.gather(-1, t[:, None])[:, 0] - torch.stack([torch.logsumexp(row, -1) for row in z])
            lp.sum().backward()
        x.grad = None

    step(contextlib.nullcontext())
    plain, _ = profiled_peak(lambda: step(contextlib.nullcontext()))
    moded, _ = profiled_peak(lambda: step(_NoOp()))
    tv = T * V * F32
    assert 3 * tv <= plain < 3 * tv + 4096
    assert moded >= plain + tv


def _reference(T, H, V, seed):
    """float64 log p(t) and k3 of the tool's inputs (tp = 1), by hand."""
    x = methods.Inputs(T, H, V, 1, 0, torch.float64, seed, False)
    lp = (x.h @ x.w.T)[:, :V].log_softmax(-1).gather(1, x.t[:, None])[:, 0]
    lq = (x.hr @ x.wr.T)[:, :V].log_softmax(-1).gather(1, x.t[:, None])[:, 0]
    return lp.mean(), (torch.expm1(lq - lp) - (lq - lp)).mean()


@pytest.mark.slow
def test_cce_k3_agrees_with_float64_and_is_read_by_the_profiler(tmp_path):
    """Cut Cross-Entropy's linear_cross_entropy(impl="torch_compile") + k3 on CPU: the float64 values,
    its peak from the profiler, compiled in an (enforced) warm-up outside the timed runs."""
    try:  # skipped only where the package itself (or a compiler for torch.compile) is missing
        import cut_cross_entropy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - it imports triton at import time; any failure means absent
        pytest.skip(f"cut_cross_entropy does not import here ({type(e).__name__}: {e})")
    if peers._cxx_compiler() is None:
        pytest.skip("no C++ compiler for torch.compile's CPU backend")
    T, H, V = 32, 8, 131
    rows = kl_memory.main(["--tokens", str(T), "--hidden", str(H), "--vocab", str(V), "--peers", "verl_k3,cce_k3",
                           "--methods", "fused_k3_loss", "--chunk-size", "8", "--warmup", "0", "--repeats", "1",
                           "--json", str(tmp_path / "kl.json")])
    assert json.loads((tmp_path / "kl.json").read_text()) == rows
    by = {r["name"]: r for r in rows}
    lp, k3 = _reference(T, H, V, 0)
    for name in ("fused_k3_loss", "verl_k3", "cce_k3"):
        assert by[name]["logprob_mean"] == pytest.approx(float(lp), rel=1e-5), name
        assert by[name]["kl_mean"] == pytest.approx(float(k3), rel=1e-5), name
    cce = by["cce_k3"]
    assert cce["memory_source"] == "profiler" and by["verl_k3"]["memory_source"] == "memtracker"
    assert cce["warmup"] == 1 and cce["first_run_s"] > 0 and by["verl_k3"]["first_run_s"] is None
    assert cce["peak_bytes"] >= T * V * F32  # the torch_compile implementation makes e @ c.T: [T, V] logits

