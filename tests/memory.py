"""Tensor memory of a call, for tests that assert memory bounds. MemTracker is deterministic for what this
thread holds; a process group's worker threads can hold a collective's tensors a moment longer
(`settled_current_bytes`)."""

from torch.distributed._tools.mem_tracker import MemTracker


def peak_bytes(fn, *inputs) -> int:
    """Peak tensor bytes while fn runs, above what `inputs` already hold."""
    total = lambda snap: sum(d["Total"] for d in snap.values())  # noqa: E731
    mt = MemTracker()
    mt.track_external(*inputs)  # counted from the start, so that views of them are not new memory
    with mt:
        base = total(mt.get_tracker_snapshot("current"))
        fn()
    return total(mt.get_tracker_snapshot("peak")) - base


def settled_current_bytes(mt: MemTracker, group=None, reads: int = 3, gap_s: float = 0.05, limit_s: float = 5.0) -> int:
    """MemTracker's current tensor bytes once the process group's threads have let go of the last
    collectives' tensors. A gloo collective returns when its result is ready; the worker thread that ran it
    drops its references to the input and output a moment later, so a snapshot taken at once can still count
    them (seen: +192 KiB in one read out of eight, at tp=2). A barrier over `group` (every rank past its
    collectives), then reads `gap_s` apart until `reads` in a row agree (at most `limit_s`)."""
    import time

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier(group=group)
    total = lambda: sum(d["Total"] for d in mt.get_tracker_snapshot("current").values())  # noqa: E731
    seen, t_end = [total()], time.monotonic() + limit_s
    while (len(seen) < reads or len(set(seen[-reads:])) > 1) and time.monotonic() < t_end:
        time.sleep(gap_s)
        seen.append(total())
    return seen[-1]
