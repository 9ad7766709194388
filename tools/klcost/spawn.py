"""tp > 1 under real ranks: `tp` gloo processes on this machine (spawned, not forked), each running
tools/klcost/measure.py's run_all on its vocabulary shard; the parent merges the rows.

Every wait is bounded: the parent polls the result queue and the children's exit codes, so a rank
that dies (an exception, an OOM kill, kill -9) is named with its exit code or signal within a
second or two, the others are terminated, and the whole run has a deadline (`timeout` seconds)
after which the ranks still running are named and killed. Nothing waits forever.
"""

from __future__ import annotations

import os
import queue as queue_mod
import signal
import socket
import time

from tools.klcost.measure import add_floor_ratios, run_all


class RankFailure(RuntimeError):
    """A rank died, raised, or missed the deadline; the message names it."""


def _rank_main(rank, tp, port, kwargs, out):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    out.put((rank, "pid", os.getpid()))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=tp)
        rows = run_all(group=dist.group.WORLD, **kwargs)
        out.put((rank, "rows", rows))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which names the rank
        out.put((rank, "error", f"{type(e).__name__}: {e}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _stop(procs, grace: float = 0.0):
    """Let finished ranks exit for up to `grace` seconds, then kill whatever still runs."""
    end = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _dead(procs, rows, errors=()):
    """(rank, process) of the first rank that exited non-zero (or by a signal) without its rows and
    without reporting an error of its own."""
    for r, p in enumerate(procs):
        if r not in rows and r not in errors and p.exitcode is not None and p.exitcode != 0:
            return r, p
    return None


def _collect(procs, out, tp, timeout, log):
    """Rows from every rank, or RankFailure naming the first rank that died, raised or timed out."""
    rows, pids, errors = {}, {}, {}
    deadline = time.monotonic() + timeout
    while len(rows) < tp:
        try:
            rank, kind, payload = out.get(timeout=0.5)
            if kind == "pid":
                pids[rank] = payload
                if log:
                    log(f"rank {rank} pid {payload} started")
            elif kind == "rows":
                rows[rank] = payload
            else:
                errors[rank] = payload
        except queue_mod.Empty:
            pass
        if errors:  # a rank that raised may only be seeing a peer that died: name the dead one first
            settle = time.monotonic() + 2.0
            while time.monotonic() < settle and not _dead(procs, rows, errors):
                time.sleep(0.1)
        dead = _dead(procs, rows, errors)
        if dead is not None:
            r, p = dead
            raise RankFailure(f"kl_memory: rank {r} (pid {p.pid}) {_exit_reason(p.exitcode)} before "
                              f"reporting its rows; the other ranks were stopped")
        if errors:
            r = min(errors)
            raise RankFailure(f"kl_memory: rank {r} (pid {pids.get(r)}) raised {errors[r]}")
        if time.monotonic() > deadline:
            late = [r for r in range(tp) if r not in rows]
            raise RankFailure(f"kl_memory: ranks {late} (pids {[procs[r].pid for r in late]}) did not finish "
                              f"within --timeout {timeout:g} s; they were killed")
    return rows


def run_spawned(tp: int, timeout: float = 1800.0, log=None, **kwargs) -> list[dict]:
    """run_all(**kwargs) on `tp` gloo ranks; merged rows: the largest peak and time over the ranks,
    rank 0's communication (every rank sends the same amount). Raises RankFailure naming the rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, kwargs, out), daemon=True) for r in range(tp)]
    for p in procs:
        p.start()
    per_rank = None
    try:
        per_rank = _collect(procs, out, tp, timeout, log)
    finally:
        _stop(procs, grace=30.0 if per_rank is not None else 0.0)
    rows = per_rank[0]
    for i, row in enumerate(rows):
        for k in ("peak_bytes", "time_s", "time_min_s", "first_run_s"):
            vals = [per_rank[r][i][k] for r in range(tp)]
            row[k] = None if None in vals else max(vals)
    return add_floor_ratios(rows)
