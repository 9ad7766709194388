"""Spawn helpers for distributed tests on CPU/gloo.

`DistPool(world_size)` starts `world_size` worker processes once, each with an initialised gloo
process group, and runs module-level functions on all of them: `pool.run(fn, *args)` calls
`fn(*args)` on every rank and returns the list of per-rank results. A failure on any rank fails
the call with that rank's traceback; a call that does not finish within `timeout` seconds (a
hang in a collective, say) fails too, and the pool is torn down and restarted on next use. A rank
whose call raised exits at once, so a peer waiting for it in a collective fails within moments
instead of at the process-group timeout. A call that leaves a rank without its process group
(e.g. it destroyed it) also restarts the pool, so the next call starts from a fresh group.

`DistPools` keeps one pool per world size for the whole test session (the `dist_pools` fixture
of tests/conftest.py); at most one pool of more than 2 ranks is alive at a time.

`run_torchrun(...)` launches a real `torchrun` command line in a subprocess with a timeout.

`OutputReader(proc)` drains a launch's merged output from the start; `.wait_for(needle, limit)`.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback

import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results, pg_timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
    except Exception:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc(), False, 0))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            out = fn(*args, **kwargs)
            results.put((rank, True, out, dist.is_initialized(), _open_descriptors()))
        except BaseException:  # noqa: BLE001 - reported to the parent
            results.put((rank, False, traceback.format_exc(), False, 0))
            # the pool is torn down after any failure: leave now, so that a peer blocked in a
            # collective with this rank sees the connection close instead of waiting for the timeout
            results.close()
            results.join_thread()
            os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


def _open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no procfs
        return 0


# Every call's process groups stay registered (torch's device meshes look groups up by name, so they cannot be
# destroyed under it): each new gloo group holds sockets to its peers. A pool whose ranks hold more descriptors
# than this restarts on its next call, before a long session of calls reaches select()'s 1024.
RESTART_AT_DESCRIPTORS = 512

# what each rank needs imported before its first call; imported once, in the fork server
PRELOAD = ["torch", "torch.distributed", "tests.dist", "rl.train"]


def _context():
    """Ranks are forked from one server process per test process that imported PRELOAD once (multiprocessing's
    forkserver), not spawned: a spawned rank paid a Python start-up and the torch and library imports (~3 s of
    CPU) at every pool start. The server is started clean (not forked from the test process and its threads)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class DistError(AssertionError):
    pass


class DistPool:
    """A set of `world_size` gloo ranks kept alive across calls."""

    def __init__(self, world_size: int, timeout: float = 180.0):
        self.world_size = world_size
        self.timeout = timeout
        self.procs: list = []

    def _start(self) -> None:
        ctx = _context()
        port = free_port()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self.tasks[r], self.results,
                                              self.timeout), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        if not self.procs:
            self._start()
        for q in self.tasks:
            q.put((fn, args, kwargs))
        deadline = time.monotonic() + (timeout or self.timeout)
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        grace_until, group_lost, crowded = None, False, False
        while len(out) + len(errors) < self.world_size:
            now = time.monotonic()
            limit = deadline if grace_until is None else min(deadline, grace_until)
            if now >= limit:
                break
            try:
                rank, ok, val, alive, fds = self.results.get(timeout=min(0.5, limit - now))
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs) and grace_until is None:
                    grace_until = time.monotonic() + 5.0
                continue
            group_lost |= not alive
            crowded |= fds > RESTART_AT_DESCRIPTORS
            if ok:
                out[rank] = val
            else:
                errors[rank] = val
                if grace_until is None:  # the others' tracebacks, if they fail too (the failed rank exits)
                    grace_until = time.monotonic() + 10.0
        if (group_lost or crowded) and not errors and len(out) == self.world_size:
            self.close()  # a rank lost its process group, or holds many sockets: the next call starts a fresh pool
        if errors or len(out) < self.world_size:
            self.close(force=True)
            missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
            msg = [f"{getattr(fn, '__name__', fn)} on {self.world_size} ranks failed"]
            for r in sorted(errors):
                msg.append(f"--- rank {r} ---\n{errors[r]}")
            if missing:
                msg.append(f"ranks {missing} did not finish (hang or crash; timeout "
                           f"{timeout or self.timeout:.0f}s)")
            raise DistError("\n".join(msg))
        return [out[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not self.procs:
            return
        if not force:
            for q in self.tasks:
                q.put(None)
            deadline = time.monotonic() + 3.0  # a clean exit is quick; don't wait on a slow teardown
            for p in self.procs:
                p.join(timeout=max(deadline - time.monotonic(), 0.05))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []


class DistPools:
    """One pool per world size, created lazily and kept for the session (a failed or hung pool
    restarts on its next call). Starting a pool of more than 2 ranks closes any other such pool,
    so that idle ranks do not pile up in memory."""

    def __init__(self, timeout: float = 180.0):
        self.timeout = timeout
        self.pools: dict[int, DistPool] = {}

    def run(self, world_size: int, fn, *args, **kwargs) -> list:
        if world_size not in self.pools:
            if world_size > 2:
                for n in [n for n in self.pools if n > 2]:
                    self.pools.pop(n).close()
            self.pools[world_size] = DistPool(world_size, self.timeout)
        return self.pools[world_size].run(fn, *args, **kwargs)

    def restart(self, world_size: int | None = None) -> None:
        """Close the pool of `world_size` (None: all); the next call starts fresh process groups."""
        for n in [n for n in self.pools if world_size is None or n == world_size]:
            self.pools.pop(n).close()

    def close(self) -> None:
        for p in self.pools.values():
            p.close()
        self.pools.clear()


def run_torchrun(module_and_args: list[str], nproc: int, timeout: float = 300.0, nnodes: int = 1,
                 extra_env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc_per_node nproc -m ...`; a timeout fails the test."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", *module_and_args]
    return subprocess.run(cmd, env=env, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)


class OutputReader:
    """Reads a launch's merged text stdout in a thread from the start, so that no rank ever blocks writing
    to a full pipe; `wait_for(needle, limit)` waits for a line holding `needle` (or the end of the output),
    `rest(timeout)` for the process and the end of its output, then returns the whole text."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self._new = proc, [], threading.Condition()
        self._done = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()
        with self._new:
            self._done = True
            self._new.notify_all()

    def wait_for(self, needle: str, limit: float) -> bool:
        with self._new:
            self._new.wait_for(lambda: self._done or any(needle in ln for ln in self.lines), timeout=limit)
            return any(needle in ln for ln in self.lines)

    def rest(self, timeout: float) -> str:
        self.proc.wait(timeout=timeout)
        self._thread.join(timeout=10)
        return "".join(self.lines)


def process_ended(pid: int, limit: float = 0.0) -> bool:
    """True once `pid` has exited (gone, or a zombie its parent has not reaped yet), waiting at most `limit` s."""
    deadline = time.monotonic() + limit
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
