"""Rewards: plug-in reward functions, their combination, checking, and running normalisation.

A reward function has the signature of `Task.reward`: `fn(meta: dict, response: str) -> float`.
Plug-ins are named "package.module:function" and imported with importlib, or by a short name of
`SHORT_NAMES` ("math", "format", ...: rl.experience.math_reward's functions); several are combined by their
mean, their min, or a weighted sum (`reward.weights`, one per function, task reward first).
`score_responses` evaluates one function over a rollout of N prompts x G samples and refuses a
NaN or infinite reward with a ValueError naming the prompt and the sample -- never zeroed silently.
Plug-ins given by name run in a worker process per rank (rl.experience.reward_worker), each call bounded by
`reward.timeout_s`: a response that sends a checker into an endless computation is named (plug-in,
prompt, sample), or scored `reward.on_timeout`, instead of hanging the run. The task's own
exact-match reward runs in the rank (it cannot hang; no round trip).
`RunningRewardNorm` z-scores rewards with running statistics (global over DP given dp_group) and clips them.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed

from parallel import comm
from rl.experience.reward_worker import RemoteError, RewardTimeout, RewardWorker
from rl.experience.tasks import make_task

RewardFn = Callable[[dict, str], float]

# short names for the verifiable math rewards (rl/experience/math_reward.py), usable in reward.fns
SHORT_NAMES = {"math": "rl.experience.math_reward:math_reward",
               "math_strict": "rl.experience.math_reward:math_reward_strict",
               "format": "rl.experience.math_reward:format_reward",
               "gsm8k_format": "rl.experience.math_reward:gsm8k_format_reward",
               "boxed_format": "rl.experience.math_reward:boxed_format_reward"}


@dataclass
class RewardConfig:
    """The `reward` section."""

    task: str | None = "arithmetic"  # a built-in task (rl.experience.tasks.make_task); null with a data section
    task_args: dict = field(default_factory=dict)  # e.g. {"max_operand": 9, "partial_credit": 0.1}
    fns: list = field(default_factory=list)  # extra "module:function" plug-ins or SHORT_NAMES ("math", "format")
    use_task_reward: bool = True  # include the task's own exact-match reward (when reward.task is set)
    combine: str = "mean"  # "mean" | "min" | "weighted" over the task reward and the plug-ins
    weights: list = field(default_factory=list)  # combine="weighted": one weight per function, task reward first
    # true / "running": running z-score (RunningRewardNorm); "fixed": mean and std from the first step's
    # batch, then frozen; false: off
    normalize: bool | str = False
    clip: float | None = None  # clip (normalised) rewards to [-clip, clip]
    max_abs: float = 1e6  # a reward with |r| above this is refused by name (overflow guard)
    # seconds one plug-in call (reward.fns) may take; it runs in a worker process that is killed past
    # this (0: run plug-ins in the rank, unbounded)
    timeout_s: float = 30.0
    on_timeout: str | float = "error"  # "error": stop the run naming the culprit; a number: that score, warned

    def __post_init__(self):
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not (
                math.isfinite(self.timeout_s) and self.timeout_s >= 0):
            raise ValueError(f"reward.timeout_s must be a finite number of seconds >= 0 (0: unbounded), got "
                             f"{self.timeout_s!r}")
        if self.on_timeout != "error" and (isinstance(self.on_timeout, bool) or not isinstance(
                self.on_timeout, (int, float)) or not math.isfinite(self.on_timeout)):
            raise ValueError(f"reward.on_timeout must be 'error' or a finite score, got {self.on_timeout!r}")
        if not (isinstance(self.max_abs, (int, float)) and math.isfinite(self.max_abs) and self.max_abs > 0):
            raise ValueError(f"reward.max_abs must be a positive finite number, got {self.max_abs!r}")
        if self.combine not in ("mean", "min", "weighted"):
            raise ValueError(f"reward.combine must be 'mean', 'min' or 'weighted', got {self.combine!r}")
        if self.normalize not in (True, False, "running", "fixed"):
            raise ValueError(f"reward.normalize must be true, false, 'running' or 'fixed', got {self.normalize!r}")
        if not self.uses_task_reward and not self.fns:
            raise ValueError("reward: without the task's reward (use_task_reward=false or task=null) reward.fns "
                             "needs at least one plug-in (e.g. [math])")
        n = int(self.uses_task_reward) + len(self.fns)
        if (self.combine == "weighted") != bool(self.weights) or (self.weights and len(self.weights) != n):
            raise ValueError(f"reward.weights: combine='weighted' needs one weight per reward function ({n}: task "
                             f"reward first, then reward.fns); got combine={self.combine!r}, weights={self.weights}")
        if any(isinstance(w, bool) or not isinstance(w, (int, float)) for w in self.weights):
            raise ValueError(f"reward.weights must be numbers, got {self.weights}")

    @property
    def uses_task_reward(self) -> bool:
        return self.use_task_reward and self.task is not None


def build_reward(cfg: RewardConfig):
    """(task, reward_fn, RunningRewardNorm) from a `RewardConfig`; plug-ins are imported here."""
    task = None if cfg.task is None else make_task(cfg.task, **cfg.task_args)
    fns = ([task.reward] if cfg.uses_task_reward else []) + list(cfg.fns)
    fn = fns[0] if len(fns) == 1 and not isinstance(fns[0], str) else CombinedReward(
        fns, cfg.combine, cfg.weights, timeout_s=cfg.timeout_s, on_timeout=cfg.on_timeout)
    norm = RunningRewardNorm(clip=cfg.clip, normalize=cfg.normalize not in (False, None),
                             fixed=cfg.normalize == "fixed")
    return task, BoundedReward(fn, cfg.max_abs), norm


def load_reward_fn(spec: str) -> RewardFn:
    """Import "module.path:function" (or a key of SHORT_NAMES); ValueError naming `spec` on any failure."""
    spec = SHORT_NAMES.get(spec, spec) if isinstance(spec, str) else spec
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"reward function spec {spec!r} must look like 'package.module:function' or be one of "
                         f"{sorted(SHORT_NAMES)}")
    mod_name, fn_name = spec.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is reported with the spec
        raise ValueError(f"reward function spec {spec!r}: cannot import module {mod_name!r}: "
                         f"{type(e).__name__}: {e}") from e
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise ValueError(f"reward function spec {spec!r}: module {mod_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise ValueError(f"reward function spec {spec!r}: {fn_name!r} is not callable")
    return fn


class CombinedReward:
    """Mean, min or weighted sum (`weights`, one per function) of several reward functions (each a
    callable, a "module:function" spec or a SHORT_NAMES key). With `timeout_s > 0` the functions given
    by name run in a `RewardWorker` (killed past timeout_s: RewardTimeout, or the score `on_timeout`
    with a warning on stderr); callables run here."""

    def __init__(self, fns: Sequence[RewardFn | str], combine: str = "mean", weights: Sequence[float] = (),
                 timeout_s: float = 0.0, on_timeout: str | float = "error"):
        if not fns:
            raise ValueError("CombinedReward needs at least one reward function")
        if combine not in ("mean", "min", "weighted"):
            raise ValueError(f"CombinedReward: combine must be 'mean', 'min' or 'weighted', got {combine!r}")
        if combine == "weighted" and len(weights) != len(fns):
            raise ValueError(f"CombinedReward: {len(fns)} functions but {len(weights)} weights")
        self.fns = [load_reward_fn(f) if isinstance(f, str) else f for f in fns]  # imported here: errors by name
        self.names = [SHORT_NAMES.get(f, f) if isinstance(f, str) else getattr(f, "__qualname__", repr(f))
                      for f in fns]
        self.combine, self.weights = combine, [float(w) for w in weights]
        specs = [SHORT_NAMES.get(f, f) for f in fns if isinstance(f, str)]
        self.remote = {i: k for k, i in enumerate(i for i, f in enumerate(fns) if isinstance(f, str))}
        self.worker = RewardWorker(specs, timeout_s) if timeout_s > 0 and specs else None
        self.on_timeout = on_timeout

    def _value(self, i: int, meta: dict, response: str):
        if self.worker is None or i not in self.remote:
            return self.fns[i](meta, response)
        try:
            return self.worker.call(self.remote[i], meta, response)
        except RewardTimeout as e:
            if self.on_timeout == "error":
                raise
            print(f"kltron: reward plug-in {self.names[i]}: {e}; scored reward.on_timeout={self.on_timeout} for "
                  f"response {response[:80]!r}", file=sys.stderr, flush=True)
            return float(self.on_timeout)

    def close(self) -> None:
        """Stop the worker process, if any."""
        if self.worker is not None:
            self.worker.close()

    def __call__(self, meta: dict, response: str) -> float:
        vals = []
        for i, name in enumerate(self.names):
            try:
                v = self._value(i, meta, response)
            except Exception as e:  # noqa: BLE001 - re-raised naming the plug-in
                kind = e.type_name if isinstance(e, RemoteError) else type(e).__name__
                raise RuntimeError(f"plug-in {name} raised {kind}: {e}") from e
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"plug-in {name} returned {v!r} ({type(v).__name__}), not a number")
            vals.append(float(v))
        if self.combine == "weighted":
            return sum(w * v for w, v in zip(self.weights, vals))
        return sum(vals) / len(vals) if self.combine == "mean" else min(vals)


def score_responses(reward_fn: RewardFn, metas: Sequence[dict], responses: Sequence[str],
                    group_size: int) -> torch.Tensor:
    """Rewards [N * G] fp32 for N prompts x G samples, ordered prompt-major (as `grpo_advantages`).

    metas: N metas, one per prompt; responses: N * G strings, sample j of prompt i at i*G + j.
    A reward that is not a finite number raises ValueError naming the prompt and sample index.
    """
    if group_size < 1 or len(responses) != len(metas) * group_size:
        raise ValueError(f"score_responses: {len(responses)} responses for {len(metas)} prompts x "
                         f"group_size {group_size}")
    bound = getattr(reward_fn, "max_abs", None)
    out = [checked_reward(reward_fn, metas[k // group_size], resp, k // group_size, k % group_size, bound)
           for k, resp in enumerate(responses)]
    return torch.tensor(out, dtype=torch.float32, device="cpu")


class BoundedReward:
    """`fn` with the bound `max_abs` that `score_responses` checks each reward against."""

    def __init__(self, fn: RewardFn, max_abs: float):
        self.fn, self.max_abs = fn, max_abs

    def __call__(self, meta: dict, response: str) -> float:
        return self.fn(meta, response)

    def close(self) -> None:
        """Stop the plug-ins' worker process, if any."""
        getattr(self.fn, "close", lambda: None)()


def checked_reward(reward_fn: RewardFn, meta: dict, response: str, i: int, j: int,
                   max_abs: float | None = None) -> float:
    """reward_fn(meta, response) as a float, or ValueError naming prompt i, sample j and the
    culprit: a plug-in that raises, returns a non-number (None, a list, a string), NaN / inf, or
    |r| > max_abs (a finite 1e38 would overflow the batch statistics)."""
    where = f"reward for prompt {i}, sample {j}"
    try:
        r = reward_fn(meta, response)
    except Exception as e:  # noqa: BLE001 - any plug-in failure is reported with the prompt and sample
        raise ValueError(f"{where}: the reward function raised {type(e).__name__}: {e}; response "
                         f"{response[:80]!r}") from e
    if isinstance(r, bool) or not isinstance(r, (int, float)) and not (torch.is_tensor(r) and r.numel() == 1):
        raise ValueError(f"{where} is not a number: {r!r} ({type(r).__name__}); response {response[:80]!r}")
    r = float(r)
    if not math.isfinite(r):
        raise ValueError(f"{where} is {r} (not finite); response {response[:80]!r}")
    if max_abs is not None and abs(r) > max_abs:
        raise ValueError(f"{where} is {r:g}, above reward.max_abs={max_abs:g}; response {response[:80]!r}")
    return r


def _comm_device(group, t: torch.Tensor) -> torch.device:
    """Where a tensor must live to be reduced over `group`: CUDA for nccl, else where it is."""
    if comm.group_size(group) > 1 and torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


@dataclass
class RunningRewardNorm:
    """(r - running_mean) / (running_std + eps), then clipped to [-clip, clip] (clip=None: no clip).

    `normalize_(rewards, dp_group)` first folds the batch -- all DP ranks' rewards, given dp_group --
    into the running count/mean/M2 (Chan et al.'s parallel update, population variance), then
    normalises with the updated statistics; every rank keeps identical state. `normalize=False`
    only clips. `fixed=True` (reward.normalize=fixed): the statistics come from the first batch only
    and are frozen after it (a fixed estimate, as in Ziegler et al.'s reward-model normalisation).
    State round-trips through `state_dict`/`load_state_dict` as plain floats.
    """

    clip: float | None = None
    eps: float = 1e-8
    normalize: bool = True
    count: float = field(default=0.0)
    mean: float = field(default=0.0)
    m2: float = field(default=0.0)
    fixed: bool = False  # freeze the statistics after the first batch

    def update(self, rewards: torch.Tensor, dp_group=None) -> None:
        x = rewards.detach().double().flatten().to(_comm_device(dp_group, rewards))
        s = torch.stack([x.sum(), torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)])
        comm.all_reduce(s, "sum", dp_group)  # [sum of rewards, number of rewards] over DP
        n_b = float(s[1])
        if n_b == 0:
            return
        mean_b = float(s[0]) / n_b
        ss = ((x - mean_b) ** 2).sum().reshape(1)
        comm.all_reduce(ss, "sum", dp_group)  # squared deviations from the batch mean over DP
        n = self.count + n_b
        delta = mean_b - self.mean
        self.m2 += float(ss[0]) + delta * delta * self.count * n_b / n
        self.mean += delta * n_b / n
        self.count = n

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 0.0

    def normalize_(self, rewards: torch.Tensor, dp_group=None) -> torch.Tensor:
        """Update the statistics with `rewards` (any shape, any device), return them normalised and
        clipped, fp32, on the device of `rewards`."""
        out = rewards.detach().float()
        if self.normalize:
            if not (self.fixed and self.count > 0 and self.m2 > 0):  # frozen once it has a spread
                self.update(rewards, dp_group)
            out = (out - self.mean) / (self.std + self.eps)
        if self.clip is not None:
            out = out.clamp(-self.clip, self.clip)
        return out

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"count", "mean", "m2"}:
            raise ValueError(f"RunningRewardNorm.load_state_dict: expected keys count, mean, m2; got "
                             f"{sorted(state)}")
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])
