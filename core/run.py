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

import os
from dataclasses import dataclass

import torch
import yaml

from core.ckpt import resume_train_checkpoint, save_train_checkpoint
from core.config import ModelConfig, to_dict
from core.metrics import MetricsWriter
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

    def save(self, step: int, modules: dict, extra: dict, tokenizer_fingerprint: str | None) -> str:
        """Write the training checkpoint of `step` under `ckpt_root`, keeping `keep_last`."""
        return save_train_checkpoint(self.ckpt_root, step, self.state, modules, extra=extra,
                                     keep_last=self.keep_last, tokenizer_fingerprint=tokenizer_fingerprint)

    def open_outputs(self, cfg) -> MetricsWriter:
        """Write `config.yaml` (the resolved `cfg`) and open `metrics.jsonl` on rank 0: fresh, or
        appended to when resuming. Called after loading, so a refused run leaves no metrics file."""
        if self.state.is_main:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
        self.writer = MetricsWriter(os.path.join(self.out_dir, "metrics.jsonl"), enabled=self.state.is_main,
                                    mode="a" if self.resumed_step is not None else "w")
        return self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def start_run(cfg, dims: ParallelDims, model_cfg: ModelConfig) -> Run:
    """Set up the run `cfg` (an SFTConfig or RLConfig: uses its `train` section) describes, on the
    already validated layout `dims`, for a model shaped like `model_cfg`. Collective: every rank calls it."""
    t = cfg.train
    state = init_parallel(dims, resolve_device(t.device), model_cfg.n_heads, model_cfg.n_kv_heads)
    seed_everything(t.seed)
    kv_group = kv_replica_group(state, model_cfg.n_kv_heads)
    return Run(state, kv_group, t.out_dir, resume_enabled=t.resume, verify=t.verify_checkpoints,
               keep_last=t.keep_last)
