"""One run's set-up, shared by the two entry points (`core.sft`, `rl.train`).

`start_run(cfg, dims, model_cfg)` does, in this order and identically on every rank: pick this
rank's device (`train.device`), build the ("dp", "tp") mesh and its groups, seed Python / NumPy /
torch with `train.seed`, build the KV-replica group (tp > n_kv_heads) and find the checkpoint to
resume from (`train.resume`: the latest under `{train.out_dir}/checkpoints`). The entry point then
builds its models, calls `Run.resume` (loads that checkpoint), and, once nothing can refuse the run
any more, `Run.open_outputs`: `{out_dir}/config.yaml` and `{out_dir}/metrics.jsonl` (appended to
when resuming) on rank 0. `Run.save` writes the training checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import yaml

from core.checkpoint import find_latest
from core.config import ModelConfig, to_dict
from core.metrics import MetricsWriter
from core.train_checkpoint import load_train_checkpoint, save_train_checkpoint
from parallel.dims import ParallelDims, ParallelState, init_parallel, kv_replica_group, resolve_device, seed_everything


@dataclass
class Run:
    """Where a run executes and where it writes.

    state: dims, device, mesh, TP / DP groups and this rank's coordinates; kv_group: the TP ranks
    sharing a KV head (None unless tp > n_kv_heads); resume_from: the checkpoint directory to resume
    from, or None for a fresh start; writer: metrics.jsonl (a no-op off rank 0), once `open_outputs`."""

    state: ParallelState
    kv_group: object | None
    out_dir: str
    resume_from: str | None
    keep_last: int | None = None
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
        """Load `resume_from` into `modules` ({name: (module, optimizer or None)}) and return its
        extra state (with "step", the last finished step); None on a fresh start."""
        if self.resume_from is None:
            return None
        return load_train_checkpoint(self.resume_from, self.state, modules)

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
                                    mode="a" if self.resume_from is not None else "w")
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
    latest = find_latest(os.path.join(t.out_dir, "checkpoints")) if t.resume else None
    return Run(state, kv_group, t.out_dir, latest, keep_last=t.keep_last)
