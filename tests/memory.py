"""Peak tensor memory of a call, for tests that assert memory bounds (MemTracker is deterministic)."""

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
