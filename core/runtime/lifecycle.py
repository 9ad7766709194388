"""A run's life cycle across ranks: clean shutdown, preemption, a stalled-rank watchdog and the
start-up check that every rank runs the same config and code.

- `exit_process(code)`: the end of every entry point (`rl.train`, `core.sft`, `tools.kl_eval`).
  Tears down in a fixed order -- a bounded barrier (no rank closes its sockets while another is
  still inside a collective), `destroy_process_group`, flush stdio -- then leaves with
  `os._exit(code)`, so that interpreter finalisation never runs the C++ destructors of gloo's and
  FSDP's worker threads in an arbitrary order (the source of `terminate called without an active
  exception` / SIGABRT after a good run).
- `StopRequest`: SIGTERM / SIGUSR1 set a flag; `agree(group)` all-reduces it at a step boundary so
  every rank stops after the same step (`PREEMPTED_EXIT` is 0: the checkpoint is written).
- `Watchdog`: each rank publishes (phase, step, time) to the torchrun store; a thread on every rank
  names the ranks and phases that have not advanced in `parallel.watchdog_s` seconds, and ends the
  run at once (one error line, exit 1) when a peer stays frozen: its alive-beat unchanged for
  `abort_after(watchdog_s)` seconds on two checks in a row.
- `check_same_everywhere(cfg_dict)`: an all-gather of the hashes of the resolved config and of the
  library's source; on a mismatch the differing keys are named.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

PREEMPTED_EXIT = 0  # a preempted run saved its checkpoint: the scheduler may requeue it, nothing failed
SHUTDOWN_BARRIER_S = 60.0
ABORT_FLOOR_S = 10.0  # a peer's alive-beat must stay unchanged at least this long before the watchdog ends the run
ABORT_WRITE_WAIT_S = 30.0  # how long the watchdog's abort waits for a write in progress to land whole

_WRITES = threading.Lock()


@contextmanager
def whole_write():
    """Around a write that must land whole (a metrics line): the watchdog's abort (`end_now`) waits
    for it to finish before it ends the process."""
    with _WRITES:
        yield


def end_now(line: str) -> None:
    """End this process from any thread, at once: wait for a `whole_write` in progress (at most
    ABORT_WRITE_WAIT_S), print `line` to stderr, flush stdio, `os._exit(1)`. For the watchdog, whose
    main thread may be blocked in C++ inside a collective that can never complete. Checkpoints need no
    wait: they are written to a temporary folder and renamed only when complete (a killed save's
    folder is removed by the next save)."""
    _WRITES.acquire(timeout=ABORT_WRITE_WAIT_S)  # never released: the process ends here
    try:
        print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(1)


def abort_after(stall_s: float) -> float:
    """Seconds a peer's alive-beat must stay unchanged (on two checks in a row) before the watchdog
    ends the run: twice `parallel.watchdog_s`, at least ABORT_FLOOR_S. A rank that is slow but
    running keeps beating from its watchdog thread every `stall_s / 4` (at most 10 s), so only a
    process none of whose threads runs (SIGSTOP, a hung host) reaches it."""
    return max(2.0 * stall_s, ABORT_FLOOR_S)


class Preempted(Exception):
    """The run stopped on SIGTERM / SIGUSR1 after writing its checkpoint; exit with PREEMPTED_EXIT."""


class RankMismatchError(ValueError):
    """Ranks of one launch disagree on the config or the code version."""


def shutdown(barrier: bool = True) -> None:
    """Tear down torch.distributed on this rank: a bounded barrier over the world (so that no rank
    closes its connections while a peer is still inside a collective), then `destroy_process_group`.
    `barrier=False` on an error path, where a peer may never arrive."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if barrier:
        try:
            if dist.get_backend() == "gloo":
                # every rank reaches the end before any rank tears down; names a rank that does not
                dist.monitored_barrier(timeout=timedelta(seconds=SHUTDOWN_BARRIER_S), wait_all_ranks=True)
            else:
                dist.barrier()  # every rank reaches the end before any rank tears down
        except RuntimeError as e:
            print(f"kltron: shutdown barrier: {e}", file=sys.stderr)
    dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a launched process with `code` after `shutdown` (every file already closed by the caller):
    flush stdio and `os._exit`, skipping interpreter finalisation and its unordered C++ destructors."""
    shutdown(barrier=code == 0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StopRequest:
    """Set by SIGTERM / SIGUSR1 (what SLURM and Kubernetes send before a kill): the run saves a
    checkpoint at the next step boundary every rank agrees on, then exits with PREEMPTED_EXIT."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum: int | None = None
        self._old = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def agree(self, device: torch.device, group=None) -> bool:
        """True on every rank when any rank was signalled. Collective over `group` (default world)."""
        flag = torch.tensor([0.0 if self.signum is None else 1.0], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, dist.ReduceOp.MAX, group=group)  # stop together: any rank's signal counts
        return bool(flag.item() > 0)


class Watchdog:
    """Heartbeats in the process group's store: the training loop publishes its (phase, step) with
    `beat`, and a thread on every rank publishes that the process is alive every `interval_s` and
    checks the others. A rank whose alive-beat is older than `stall_s` is frozen (SIGSTOP, a hung
    host: no thread of it runs); a rank whose step is behind the others is named with its phase.
    Thread off when stall_s <= 0; heartbeats off when not distributed.

    With `on_frozen` set (a function of the watchdog's error returning the run's error message), a
    peer whose alive-beat value has not changed for more than `abort_s` seconds of this rank's own
    monotonic clock, on two checks in a row, ends the run: `end(f"{program}: error (rank R): {message}")`
    (default `end_now`: print, flush, exit 1), since this rank's collectives with it can never
    complete. A check that comes late (this thread itself was starved or paused, and the peer's may
    have been too) counts its gap as at most `max_gap_s`: a loaded machine slows the verdict on a
    frozen peer but neither prevents it nor turns a slow peer into a frozen one.

    The keys are those of this rank's n-th watchdog on the store, read from every rank's n-th (the
    ranks of a launch make theirs at the same points): a value an earlier watchdog left in the store
    (a reused process group) is never read, so a peer's first alive-beat is already a verdict's start
    and a peer that freezes before its beat was ever seen to change is named too."""

    def __init__(self, stall_s: float, rank: int, world: int, store=None, log=None, roles: dict | None = None,
                 program: str = "kltron", clock: Callable[[], float] = time.monotonic,
                 end: Callable[[str], None] = end_now):
        self.stall_s, self.rank, self.world, self.store = stall_s, rank, world, store
        self.roles = roles or {}  # global rank -> its role in a split launch ("rollout rank 0"), named beside it
        self.interval_s = max(min(stall_s / 4, 10.0), 0.05)
        self.abort_s = abort_after(stall_s)
        self.max_gap_s = 2 * self.interval_s + 1.0  # the most one gap between checks counts toward a verdict
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.program, self.clock, self.end = program, clock, end
        self.on_frozen: Callable[[Exception], str] | None = None  # set by the loop that knows what it is doing
        self._stop = threading.Event()
        self._thread = None
        self._said: set = set()
        self._seen: dict = {}  # peer rank -> its alive-beat as `frozen_peers` last saw it
        self._last_tick: float | None = None
        # which of this rank's watchdogs on the store this is: its keys are under that number
        self._nth = int(store.add(f"kltron/watchdogs/{rank}", 1)) if store is not None and stall_s > 0 else 0

    @classmethod
    def for_run(cls, stall_s: float, roles: dict | None = None, program: str = "kltron") -> Watchdog:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(0.0, 0, 1, program=program)
        store = dist.distributed_c10d._get_default_store()
        try:  # a connection of its own: a store call of the main thread that waits (a key, a timeout) holds the
            store = store.clone()  # shared client, and the heartbeats would stop behind it
        except (AttributeError, RuntimeError):  # a torch without Store.clone: the shared client
            pass
        return cls(stall_s, dist.get_rank(), dist.get_world_size(), store, roles=roles, program=program)

    def name(self, rank: int) -> str:
        """'rank 2', or 'rank 2 (rollout rank 0)' in a launch split into roles."""
        return f"rank {rank}" + (f" ({self.roles[rank]})" if rank in self.roles else "")

    def key(self, kind: str, rank: int) -> str:
        """The store key of `rank`'s `kind` ("alive", "phase") for this watchdog's number."""
        return f"kltron/{self._nth}/{kind}/{rank}"

    def beat(self, phase: str, step: int) -> None:
        if self.store is not None:
            self.store.set(self.key("phase", self.rank), json.dumps([phase, step, time.time()]))

    def alive(self) -> None:
        """Publish this rank's alive-beat (its wall time)."""
        self.store.set(self.key("alive", self.rank), json.dumps(time.time()))

    def _read(self, key: str):
        """The key's value, or None when it is not in the store yet: `store.get` of a missing key waits for
        it (up to the store's timeout, the thread stuck and the run with it), so `check` asks first."""
        try:
            return json.loads(self.store.get(key)) if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store unreachable: nothing to read
            return None

    @staticmethod
    def _where(ph) -> str:
        return f"phase {ph[0]!r}, step {ph[1]}" if ph else "before its first step"

    def check(self) -> list[str]:
        """One message per frozen rank (alive-beat older than stall_s) and per rank behind the most
        advanced step, each with its phase and step."""
        now, out = time.time(), []
        phases = {r: self._read(self.key("phase", r)) for r in range(self.world)}
        top = max((p[1] for p in phases.values() if p), default=None)
        for r in range(self.world):
            alive, ph = self._read(self.key("alive", r)), phases[r]
            where = self._where(ph)
            if alive is not None and now - alive > self.stall_s:
                out.append(f"{self.name(r)} has not advanced in {now - alive:.0f} s: frozen ({where})")
            elif ph and top is not None and ph[1] < top:
                out.append(f"{self.name(r)} is behind: {where}, {now - ph[2]:.0f} s in it, others at step {top}")
        return out

    def frozen_peers(self) -> list[tuple[int, float]]:
        """(rank, seconds) of each peer whose alive-beat value has stayed unchanged for more than abort_s,
        on this check and the one before; the seconds counted are the gaps between this rank's checks,
        each at most max_gap_s (a late check: this thread did not run for a while, the peer's may not
        have either). Called once per interval by the thread."""
        now = self.clock()
        gap = 0.0 if self._last_tick is None else min(now - self._last_tick, self.max_gap_s)
        self._last_tick = now
        out = []
        for r in range(self.world):
            if r == self.rank:
                continue
            key = self.key("alive", r)
            try:
                value = self.store.get(key) if self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - the store is unreachable: no verdict
                continue
            if value is None or json.loads(value) is None:  # not started, or finished: not frozen
                self._seen.pop(r, None)
                continue
            seen = self._seen.get(r)
            if seen is None or seen[0] != value:  # [value, when it changed, seconds counted, checks past abort_s]
                self._seen[r] = [value, now, 0.0, 0]
                continue
            seen[2] += gap
            seen[3] = seen[3] + 1 if seen[2] > self.abort_s else 0
            if seen[3] >= 2:
                out.append((r, now - seen[1]))
        return out

    def start(self) -> Watchdog:
        if self.store is None or self.stall_s <= 0:
            return self
        self.alive()
        self._thread = threading.Thread(target=self._loop, name="kltron-watchdog", daemon=True)
        self._thread.start()
        return self

    def tick(self) -> None:
        """One round of the thread: publish this rank's alive-beat, name what `check` finds (each
        (rank, kind, phase) once), and end the run on a frozen peer when `on_frozen` is set."""
        self.alive()
        for msg in self.check():
            key = re.sub(r"\d+ s\b", "", msg)
            if key not in self._said:  # each (rank, kind, phase) once
                self._said.add(key)
                self.log(f"kltron watchdog (rank {self.rank}): {msg}")
        frozen = self.frozen_peers()
        if frozen and self.on_frozen is not None:
            names = ", ".join(self.name(r) for r, _ in frozen)
            msgs = [f"{self.name(r)} has not advanced in {secs:.0f} s: frozen "
                    f"({self._where(self._read(self.key('phase', r)))})" for r, secs in frozen]
            err = RankStalled(f"the watchdog ended the run: {names} frozen, alive-beat unchanged for more than "
                              f"{self.abort_s:g} s (parallel.watchdog_s={self.stall_s:g}); no collective with "
                              f"it can complete")
            err.frozen = msgs
            self.end(f"{self.program}: error (rank {self.rank}): {self.on_frozen(err)}")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - a store hiccup must not end the heartbeat (peers would see a freeze)
                key = f"error {type(e).__name__}"
                if key not in self._said:
                    self._said.add(key)
                    self.log(f"kltron watchdog (rank {self.rank}): {type(e).__name__}: {e}")

    def explain(self, err: Exception, timeout_s: float) -> str:
        """The message for a collective that failed (timed out, or a peer vanished), naming the
        stalled ranks and phases the heartbeats show (for the watchdog's own error: the frozen peers)."""
        msgs = getattr(err, "frozen", None) or (self.check() if self.store is not None and self.stall_s > 0 else [])
        who = "; ".join(msgs) if msgs else ("no stalled rank seen (set parallel.watchdog_s > 0 to name it)"
                                            if self.stall_s <= 0 else "every rank's heartbeat is recent")
        return (f"a collective failed on {self.name(self.rank)} (parallel.timeout_s={timeout_s:g}): "
                f"{str(err).splitlines()[0][-200:]}; {who}")

    def stop(self, finished: bool = True) -> None:
        """Stop and join the thread (before shutdown: no thread of ours outlives the process group).
        `finished`: also publish that this rank is done (alive-beat null), so that a peer still at
        work (writing the final model) neither names it frozen nor ends the run over it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
            if finished:
                try:
                    self.store.set(self.key("alive", self.rank), json.dumps(None))
                except Exception:  # noqa: BLE001 - the store is gone: the launch is ending anyway
                    pass


def is_comm_failure(e: BaseException) -> bool:
    """A collective that timed out or lost its peer (gloo raises plain RuntimeErrors for these)."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(k in text for k in ("Timed out", "timed out", "Connection closed",
                                                                    "Connection reset", "connection closed"))


class RankStalled(RuntimeError):
    """A collective timed out or lost a peer; the message names the stalled rank and phase."""


def source_hash() -> str:
    """sha256 over the library's Python files (parallel, core, rl, tools), in path order."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    h = hashlib.sha256()
    for pkg in ("parallel", "core", "rl", "tools"):
        for dirpath, dirs, files in sorted(os.walk(os.path.join(root, pkg))):
            dirs.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    p = os.path.join(dirpath, f)
                    h.update(os.path.relpath(p, root).encode())
                    with open(p, "rb") as fh:
                        h.update(fh.read())
    return h.hexdigest()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_same_everywhere(cfg_dict: dict) -> None:
    """RankMismatchError on every rank unless all ranks hold the same resolved config and library
    source; names the differing config keys (with each rank's value) or the code hash. Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = (hashlib.sha256(json.dumps(cfg_dict, sort_keys=True, default=str).encode()).hexdigest(), source_hash())
    hashes = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, mine)  # every rank's (config hash, code hash), to compare with rank 0's
    if all(h == hashes[0] for h in hashes):
        return
    cfgs = [None] * dist.get_world_size()
    dist.all_gather_object(cfgs, cfg_dict)  # only on a mismatch: the configs themselves, to name the keys
    flat = [_flatten(c) for c in cfgs]
    diffs = []
    for key in sorted(set().union(*flat)):
        vals = [f.get(key, "<missing>") for f in flat]
        if any(v != vals[0] for v in vals):
            diffs.append(f"{key}: " + ", ".join(f"rank {r}={v!r}" for r, v in enumerate(vals)))
    bad_code = [r for r, h in enumerate(hashes) if h[1] != hashes[0][1]]
    msg = []
    if diffs:
        msg.append("ranks run different configs: " + "; ".join(diffs))
    if bad_code:
        msg.append(f"rank(s) {bad_code} run a different kltron source than rank 0 (code hash "
                   f"{hashes[bad_code[0]][1][:12]} vs {hashes[0][1][:12]})")
    raise RankMismatchError("; ".join(msg))
