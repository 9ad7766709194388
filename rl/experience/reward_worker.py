"""Reward plug-ins run in a worker process, so that no model output can hang or crash the run.

A plug-in is foreign code on foreign input: a response holding `\\boxed{10^{10^{10}}}` sends a
symbolic checker into a computation that can run for hours inside C (where neither a thread nor a
Python signal handler can stop it, and SIGTERM is only handled once it returns). Each rank therefore
evaluates its plug-ins in one child process (`python -m rl.experience.reward_worker`, started on the first call,
light: no torch) and waits for each answer at most `reward.timeout_s` seconds. On a timeout the
child is killed (SIGKILL) and restarted on the next call, and `RewardTimeout` names the plug-in; the
caller (`rl.experience.rewards.checked_reward`) adds the prompt and the sample.

| step | parent (the rank) | child |
|---|---|---|
| start | spawn, send (sys.path, specs) | import the plug-ins, answer "ready" |
| call | send (k, meta, response); poll() in slices | run plug-in k; send ("ok", value) or ("err", type, text) |
| timeout | SIGKILL, reap, forget the child; raise RewardTimeout | - |
| end | close stdin (the child exits on EOF); kill if still there | - |

The child ignores SIGINT / SIGTERM / SIGUSR1 (a signal to the whole process group is the rank's to
handle: it saves its checkpoint) and dies with its parent (Linux PR_SET_PDEATHSIG), so a killed rank
leaves no orphan spinning in a computation. Messages are length-prefixed pickles over the pipes.
The cost is one pipe round trip per plug-in call; the task's own exact-match reward never pays it
(it runs in the rank: it cannot hang).
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time

_LEN = struct.Struct("<Q")
START_TIMEOUT_S = 120.0  # importing a plug-in (math-verify pulls in sympy) is not the call's time


class RewardTimeout(TimeoutError):
    """A plug-in did not answer within reward.timeout_s; its worker was killed."""


class RemoteError(Exception):
    """A plug-in raised in the worker: `type_name` is the original exception's class name."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


def _write(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = memoryview(_LEN.pack(len(data)) + data)
    while buf:
        buf = buf[os.write(fd, buf):]


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether fd has data (or EOF) within timeout_s. poll(), not select(): select() takes no descriptor
    numbered 1024 or more (FD_SETSIZE), and a rank can hold that many (process groups' sockets, data
    loaders, open checkpoints) before its first plug-in call."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RewardTimeout("deadline passed")
            if not _readable(fd, min(left, 0.2)):  # short slices: signal handlers run
                continue
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the reward worker closed its pipe")
        out += chunk
    return bytes(out)


def _read(fd: int, deadline: float | None = None):
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size, deadline))
    return pickle.loads(_read_exact(fd, n, deadline))


class RewardWorker:
    """One child process evaluating the plug-ins `specs` ("module:function" strings), each call bounded
    by `timeout_s` seconds. Not thread-safe: one rank, one caller."""

    def __init__(self, specs: list[str], timeout_s: float):
        self.specs, self.timeout_s = list(specs), float(timeout_s)
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        root = os.path.abspath(__file__)  # the folder holding the top package (`rl`), wherever we run from
        for _ in __name__.split("."):
            root = os.path.dirname(root)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, close_fds=True)
        _write(self.proc.stdin.fileno(), (list(sys.path), self.specs))
        try:
            msg = _read(self.proc.stdout.fileno(), time.monotonic() + max(START_TIMEOUT_S, self.timeout_s))
        except (RewardTimeout, EOFError) as e:
            self.kill()
            raise RuntimeError(f"the reward worker for {self.specs} did not start: {e}") from None
        if msg[0] != "ready":
            self.kill()
            raise RemoteError(msg[1], f"importing the reward plug-ins in the worker: {msg[2]}")

    def call(self, k: int, meta: dict, response: str):
        """Plug-in k's value for (meta, response), as it returned it; RewardTimeout after timeout_s
        (the child is killed), RemoteError when the plug-in raised."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            _write(self.proc.stdin.fileno(), (k, meta, response))
            msg = _read(self.proc.stdout.fileno(), time.monotonic() + self.timeout_s)
        except RewardTimeout:
            self.kill()
            raise RewardTimeout(f"no answer within reward.timeout_s={self.timeout_s:g} s (its worker process was "
                                f"killed; raise reward.timeout_s, or set reward.on_timeout to a score)") from None
        except (EOFError, BrokenPipeError) as e:
            code = self.proc.poll()
            self.kill()
            raise RuntimeError(f"the reward worker died (exit {code}): {e}") from None
        if msg[0] == "ok":
            return msg[1]
        raise RemoteError(msg[1], msg[2])

    def kill(self) -> None:
        """SIGKILL the child (a no-op when there is none) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    close = kill

    def __del__(self):
        try:
            self.kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a plug-in stuck in C never reads the EOF)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the child still exits on its stdin's EOF
        pass


def _import(spec: str):
    mod_name, fn_name = spec.split(":")
    return getattr(importlib.import_module(mod_name), fn_name)


def serve(rfd: int, wfd: int) -> None:
    """The child's loop: read (sys.path, specs), import, then answer calls until EOF."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN)
    _die_with_parent()
    try:
        path, specs = _read(rfd)
    except EOFError:
        return
    sys.path[:] = path
    try:
        fns = [_import(s) for s in specs]
    except Exception as e:  # noqa: BLE001 - reported to the parent by type and message
        _write(wfd, ("err", type(e).__name__, str(e)))
        return
    _write(wfd, ("ready",))
    while True:
        try:
            k, meta, response = _read(rfd)
        except EOFError:
            return
        try:
            out = ("ok", fns[k](meta, response))
        except Exception as e:  # noqa: BLE001 - the plug-in's failure, by type and message
            out = ("err", type(e).__name__, str(e))
        try:
            _write(wfd, out)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            _write(wfd, ("err", "TypeError", f"returned a {type(out[1]).__name__} that cannot be sent: {e}"))


if __name__ == "__main__":
    _rfd, _wfd = os.dup(0), os.dup(1)  # the protocol's pipes; a plug-in's print goes to stderr, not into them
    os.dup2(2, 1)
    _null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(_null, 0)
    serve(_rfd, _wfd)
