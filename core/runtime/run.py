"""One run's set-up, shared by the two entry points (`core.sft`, `rl.train`).

`start_run(cfg, dims, model_cfg)` does, in this order and identically on every rank: pick this
rank's device (`train.device`), build the ("dp", "tp") mesh and its groups, seed Python / NumPy /
torch with `train.seed`, build the KV-replica group (tp > n_kv_heads) and find the checkpoint to
resume from (`train.resume`: under `{train.out_dir}/checkpoints`). The entry point then builds its
models, calls `Run.resume` (loads the newest checkpoint whose hashes verify, saying why every newer one
was rejected: core/ckpt/train.py), and, once nothing can refuse the run
any more, `Run.open_outputs`: `{out_dir}/config.yaml` and `{out_dir}/metrics.jsonl` (appended to
when resuming) on rank 0. `Run.save` writes the training checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
from dataclasses import dataclass, field

import torch
import yaml

from core.ckpt import (
    CheckpointError,
    describe_error,
    raise_on_all_ranks,
    resume_train_checkpoint,
    save_train_checkpoint,
    verify_checkpoint,
    world_group,
)
from core.config import ModelConfig, to_dict
from core.runtime.lifecycle import check_same_everywhere
from core.runtime.metrics import MetricsWriter
from parallel.dims import ParallelDims, ParallelState, init_parallel, kv_replica_group, resolve_device, seed_everything


@dataclass
class Run:
    """Where a run executes and where it writes.

    state: dims, device, mesh, TP / DP groups and this rank's coordinates; kv_group: the TP ranks
    sharing a KV head (None unless tp > n_kv_heads); resume: look for a checkpoint to resume from;
    verify: check every file's sha256 on load; resumed_step: the step `resume` loaded (None: a fresh
    start); writer: metrics.jsonl (a no-op off rank 0), once `open_outputs`."""

    state: ParallelState
    kv_group: object | None
    out_dir: str
    resume_enabled: bool = True
    verify: bool = True
    keep_last: int | None = None
    resumed_step: int | None = None
    writer: MetricsWriter | None = None
    lock: object | None = field(default=None, repr=False)  # rank 0's open, flock'd `{out_dir}/.lock`

    @property
    def dims(self) -> ParallelDims:
        return self.state.dims

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def ckpt_root(self) -> str:
        return os.path.join(self.out_dir, "checkpoints")

    def resume(self, modules: dict) -> dict | None:
        """Load the newest verified checkpoint under `ckpt_root` into `modules` ({name: (module,
        optimizer or None)}) and return its extra state (with "step", the last finished step); None on
        a fresh start (resume off, or no checkpoint yet)."""
        if not self.resume_enabled:
            return None
        extra = resume_train_checkpoint(self.ckpt_root, self.state, modules, verify=self.verify)
        self.resumed_step = None if extra is None else extra["step"]
        return extra

    def save(self, step: int, modules: dict, extra: dict, tokenizer_fingerprint: str | None,
             extra_files: list[str] | None = None) -> str:
        """Write the training checkpoint of `step` under `ckpt_root`, keeping `keep_last`; `extra_files`
        (the tokenizer's) are copied in and hashed, so that the checkpoint exports on its own."""
        with saving(f"the checkpoint of step {step} under {self.ckpt_root}"):
            return save_train_checkpoint(self.ckpt_root, step, self.state, modules, extra=extra,
                                         keep_last=self.keep_last, tokenizer_fingerprint=tokenizer_fingerprint,
                                         extra_files=extra_files)

    @property
    def final_model_dir(self) -> str:
        return os.path.join(self.out_dir, "model")

    def final_model_problem(self, final_step: int) -> str | None:
        """Why `{out_dir}/model` is not the verified final model of step `final_step` (missing, cut short,
        of another step, a file whose sha256 differs), or None when it is. Collective: every rank hashes
        its share of the files and gets the same answer."""
        path = self.final_model_dir
        if not os.path.isfile(os.path.join(path, "manifest.json")):
            return f"{path} is missing"
        try:
            m = verify_checkpoint(path, world_group(self.state))
        except CheckpointError as e:
            return str(e)
        if m.get("step") != final_step:
            return f"{path} holds step {m.get('step')}, not the final step {final_step}"
        return None

    def finished(self, last_step: int, what: str, final_step: int | None = None) -> bool:
        """True (and says so on rank 0) when the resumed checkpoint is already at `last_step`, the run's
        final step, and `{out_dir}/model` verifies as the model of `final_step` (default last_step): nothing
        is run and neither config.yaml nor metrics.jsonl is touched. When the checkpoint is final but the
        model is not (a stop in the last step, a disk that filled while it was written), False after saying
        so: the caller writes the model from the resumed checkpoint."""
        if self.resumed_step is None or self.resumed_step < last_step:
            return False
        final_step = last_step if final_step is None else final_step
        problem = self.final_model_problem(final_step)
        if problem is not None:
            if self.state.is_main:
                print(f"kltron.{what}: the run in {self.out_dir} trained to its last step {self.resumed_step} but "
                      f"its final model is not there ({problem}); writing it from the checkpoint of step "
                      f"{self.resumed_step}", file=sys.stderr)
            return False
        if self.state.is_main:
            print(f"kltron.{what}: the run in {self.out_dir} is complete at step {self.resumed_step} (final model "
                  f"verified in {self.final_model_dir}); nothing to do. To start a new run pass a new "
                  f"train.out_dir=...; to continue this one pass a larger train.steps=...", file=sys.stderr)
        return True

    def open_outputs(self, cfg) -> MetricsWriter:
        """Write `config.yaml` (the resolved `cfg`) and open `metrics.jsonl` on rank 0: fresh, or,
        when resuming, cut back to the records of steps <= the resumed step (no step is logged twice)
        and appended to. Called after loading, so a refused run leaves no metrics file."""
        metrics = os.path.join(self.out_dir, "metrics.jsonl")
        if self.resumed_step is not None:  # before any file is touched, on every rank
            raise_on_all_ranks(lambda: check_config_unchanged(self.out_dir, cfg) if self.state.is_main else None,
                               world_group(self.state), src=0)
        if self.state.is_main:
            os.makedirs(self.out_dir, exist_ok=True)
            if self.resumed_step is not None:
                truncate_metrics(metrics, self.resumed_step)
            with open(os.path.join(self.out_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
        self.writer = MetricsWriter(metrics, enabled=self.state.is_main,
                                    mode="a" if self.resumed_step is not None else "w")
        return self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.lock is not None:
            self.lock.close()  # closing the file releases the flock
            self.lock = None


# keys a resumed run may change: its length, logging, retention, checks and layout (checkpoints load into any
# tp x dp); any other difference from the run's config.yaml is refused unless train.allow_config_change
RESUMABLE_KEYS = ("train.steps", "train.stop_after", "train.progress", "train.log_every", "train.save_every",
                  "train.keep_last", "train.resume", "train.verify_checkpoints", "train.device", "train.memory_check",
                  "train.allow_config_change", "train.compile", "parallel.")


def config_changes(old: dict, new: dict, defaults: dict | None = None) -> list[str]:
    """"key: old -> new" for every flattened key (outside RESUMABLE_KEYS) whose value differs. A key the old
    config lacks (written by an older kltron, before the key existed) counts as its value in `defaults`."""
    a, b = _flatten(old), _flatten(new)
    for k, v in _flatten(defaults or {}).items():
        if k in b and not any(x.startswith(k + ".") for x in a):
            a.setdefault(k, v)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not k.startswith(RESUMABLE_KEYS)]


def check_config_unchanged(out_dir: str, cfg) -> None:
    """ValueError naming each key whose value differs from `{out_dir}/config.yaml` (the run being resumed),
    unless `cfg.train.allow_config_change`. A run without a config.yaml passes."""
    path = os.path.join(out_dir, "config.yaml")
    if getattr(cfg.train, "allow_config_change", False) or not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        old = yaml.safe_load(f) or {}
    as_saved = lambda c: yaml.safe_load(yaml.safe_dump(to_dict(c), sort_keys=False))
    changes = config_changes(old, as_saved(cfg), as_saved(type(cfg)()))
    if changes:
        raise ValueError(f"resume: the config differs from the run in {out_dir} ({path}): " + "; ".join(changes)
                         + ". Start a new run with a new train.out_dir=..., or pass train.allow_config_change=true "
                         "to continue this one with the new values")


STOPPED_FILE = "stopped.json"


def record_stop(out_dir: str, step: int, kind: str, reason: str) -> None:
    """Write `{out_dir}/stopped.json` (rank 0): the run was stopped by a guard after step `step`."""
    tmp = os.path.join(out_dir, STOPPED_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"step": step, "kind": kind, "reason": reason}, f)
    os.replace(tmp, os.path.join(out_dir, STOPPED_FILE))


def check_not_stopped(out_dir: str, resumed_step: int | None) -> None:
    """ValueError when the checkpoint being resumed is the one a guard stopped the run at (resuming would
    go on training, e.g., a collapsed policy); names the reason and how to resume anyway."""
    path = os.path.join(out_dir, STOPPED_FILE)
    if resumed_step is None or not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        rec = json.load(f)
    if rec.get("step") == resumed_step:
        raise ValueError(f"resume: the run in {out_dir} was stopped at step {resumed_step} by the {rec.get('kind')} "
                         f"guard ({rec.get('reason')}); resuming would train that checkpoint on. Start a new run with "
                         f"a new train.out_dir=... (e.g. a lower optim.lr), or delete {path} to resume it anyway")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@contextlib.contextmanager
def saving(what: str):
    """Name `what` was being written in a failed save (a full disk says only `No space left on device`,
    often without a file): CheckpointError "writing WHAT: ..." with the file when the error has one."""
    try:
        yield
    except (OSError, CheckpointError) as e:
        where = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
        raise CheckpointError(f"writing {what}{where}: {describe_error(e)}; free space there and run the same "
                              "command to resume") from e


LOCK_FILE = ".lock"


def lock_out_dir(out_dir: str):
    """Take `{out_dir}/.lock` with an exclusive, non-blocking flock and write "pid host" into it; returns
    the open file (the lock lives as long as it stays open, and dies with the process: a crashed run's
    lock never blocks its resume). Another live run holding it: ValueError naming its pid and host."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, LOCK_FILE)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise ValueError(f"train.out_dir={out_dir} is in use by another run (pid and host: {holder}, {path}); wait "
                         "for it to end or pass another train.out_dir=...") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()} {socket.gethostname()}\n")
    f.flush()
    return f


def truncate_metrics(path: str, last_step: int) -> int:
    """Keep the records of `path` (JSON lines with "step") whose step is <= `last_step`, written
    atomically; a torn last line is dropped. Returns the number of records removed."""
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > last_step:
                dropped += 1
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return dropped


def start_run(cfg, dims: ParallelDims, model_cfg: ModelConfig, role=None) -> Run:
    """Set up the run `cfg` (an SFTConfig or RLConfig: uses its `train` section) describes, on the
    already validated layout `dims`, for a model shaped like `model_cfg`. Collective: every rank calls it.
    `role`: the trainer role of a launch split into roles (parallel/roles.py), whose state and KV group
    are built already and whose ranks were checked to run the same config and code before the split."""
    t = cfg.train
    if role is None:
        state = init_parallel(dims, resolve_device(t.device), model_cfg.n_heads, model_cfg.n_kv_heads,
                              timeout_s=cfg.parallel.timeout_s)
        check_same_everywhere(to_dict(cfg))  # before any work: every rank runs the same config and code
    else:
        state = role.state
    group = world_group(state)
    lock = raise_on_all_ranks(lambda: lock_out_dir(t.out_dir) if state.is_main else None, group)  # one run per dir
    seed_everything(t.seed)
    kv_group = kv_replica_group(state, model_cfg.n_kv_heads) if role is None else role.kv_group
    return Run(state, kv_group, t.out_dir, resume_enabled=t.resume, verify=t.verify_checkpoints,
               keep_last=t.keep_last, lock=lock)
