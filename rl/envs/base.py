"""The environment interface of multi-turn rollouts, its plug-in loading and its time bound.

An environment plug-in is a factory named like a reward plug-in ("package.module:function", or a
short name of `SHORT_NAMES`), called once per episode with the prompt record (`meta`) and the
`rollout.env_args`; it returns an episode object with one method

    episode.step(text: str, ids: list[int]) -> Turn(observation, reward, done)

`text` is the model's turn decoded (its EOS dropped), `ids` the exact token ids the model sampled.
`observation` is plain text; the rollout renders it with the turn markers (a chat template's tool
turn, or `PLAIN_MARKERS` for the built-in sentencepiece tasks) and appends its tokens to the
episode without re-tokenising what came before. `reward` is this turn's reward; an episode's score
is the sum of its turns' rewards (a final-only reward is a 0 on every turn but the last).

Each step runs under a wall-clock bound (`reward.timeout_s`, as a reward plug-in's call): past it
the step is interrupted (SIGALRM in the main thread: an endless Python loop stops; a C call that
never returns to the interpreter is not interrupted) and the run stops with an error naming the
plug-in, the prompt and the turn, as every other exception of a step is named.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import signal
import threading
from dataclasses import dataclass

SHORT_NAMES = {"calculator": "rl.envs.calculator:calculator_env", "guess": "rl.envs.guess:guess_env"}


@dataclass
class Turn:
    """What an environment answers to one model turn."""

    observation: str = ""
    reward: float = 0.0
    done: bool = True
    tool_call: bool = False  # the turn was a tool call (counted by the tool-call metrics)
    tool_ok: bool = False  # ... and the tool ran (the call parsed and returned a result)


class EnvTimeout(TimeoutError):
    """An environment step ran past its bound."""


def load_env(spec: str):
    """The factory named by `spec` ("module:function" or a short name)."""
    full = SHORT_NAMES.get(spec, spec)
    if not isinstance(full, str) or ":" not in full:
        raise ValueError(f"rollout.env: {spec!r} is neither a short name {sorted(SHORT_NAMES)} nor 'module:function'")
    mod, fn = full.split(":", 1)
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.env: cannot load {spec!r} ({type(e).__name__}: {e})") from None


@contextlib.contextmanager
def _bounded(seconds: float):
    """Raise EnvTimeout in this block after `seconds` (0 or off the main thread: unbounded)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return
    def on_alarm(signum, frame):
        raise EnvTimeout(f"no answer within reward.timeout_s={seconds:g} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Episodes:
    """One environment episode per rollout row, each step bounded and its failure named."""

    def __init__(self, spec: str, metas: list[dict], env_args: dict | None = None, timeout_s: float = 30.0):
        self.spec, self.metas, self.timeout_s = spec, metas, float(timeout_s)
        factory = load_env(spec)
        self.eps = [self._call(i, -1, lambda m=m: factory(m, **(env_args or {}))) for i, m in enumerate(metas)]

    def _call(self, row: int, turn: int, fn):
        try:
            with _bounded(self.timeout_s):
                return fn()
        except Exception as e:  # noqa: BLE001 - named with the plug-in, the prompt and the turn
            what = "start" if turn < 0 else f"turn {turn}"
            raise RuntimeError(f"environment {self.spec!r} failed on prompt {self.metas[row].get('prompt')!r} "
                               f"(row {row}), {what}: {type(e).__name__}: {e}") from e

    def step(self, row: int, turn: int, text: str, ids: list[int]) -> Turn:
        out = self._call(row, turn, lambda: self.eps[row].step(text, list(ids)))
        if not isinstance(out, Turn):
            raise RuntimeError(f"environment {self.spec!r}: step must return rl.envs.base.Turn, got "
                               f"{type(out).__name__} (prompt {self.metas[row].get('prompt')!r}, turn {turn})")
        if not math.isfinite(float(out.reward)):
            raise RuntimeError(f"environment {self.spec!r}: reward {out.reward!r} is not finite (prompt "
                               f"{self.metas[row].get('prompt')!r}, turn {turn})")
        return out
