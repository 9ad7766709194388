"""AdamW with a warmup + cosine schedule, global-norm clipping across TP and FSDP shards, and a
collective skip of non-finite steps.

Global gradient norm. Every rank holds, per parameter, a local gradient: its FSDP shard (over dp)
of its TP-local tensor. Then

    norm^2 = all_reduce_sum over dp and tp of  sum_p  ||g_p,local||^2 / tp_replicas(p)

where `tp_replicas(p)` (core/shards) is how many TP ranks hold an identical copy of p (norm
weights: tp; KV projections when tp > n_kv_heads: tp / n_kv_heads; everything else: 1), so each
distinct value counts exactly once. FSDP shards over dp are disjoint, so the dp sum needs no
correction. Without FSDP and dp > 1, gradients are replicated over dp too: divide by dp as well.

The norm is one all-reduced scalar, identical on every rank, so when it is not finite every rank
skips the step together (grads zeroed, parameters and optimizer state untouched) without a further
collective. Weight decay applies to matrices (dim >= 2) only, not to norms or biases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from core.config import ModelConfig, OptimConfig
from core.shards import tp_replicas
from parallel.comm import all_reduce, group_size
from parallel.fsdp import is_fsdp, local_tensor

SCHEDULES = ("cosine", "constant")
IMPLEMENTATIONS = ("fused", "foreach")


class OptimConfigError(ValueError):
    """An optimizer setting that cannot work; the message names the key."""


def check_optim_config(cfg: OptimConfig) -> OptimConfig:
    """Raise OptimConfigError naming the `optim.*` key that cannot work; return cfg."""
    if cfg.schedule not in SCHEDULES:
        raise OptimConfigError(f"optim.schedule must be one of {SCHEDULES}, got {cfg.schedule!r}")
    if not cfg.lr > 0:
        raise OptimConfigError(f"optim.lr must be positive, got {cfg.lr}")
    if cfg.min_lr < 0 or cfg.min_lr > cfg.lr:
        raise OptimConfigError(f"optim.min_lr must lie in [0, optim.lr={cfg.lr}], got {cfg.min_lr}")
    if cfg.warmup_steps < 0:
        raise OptimConfigError(f"optim.warmup_steps must be >= 0, got {cfg.warmup_steps}")
    if len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas):
        raise OptimConfigError(f"optim.betas must be two numbers in [0, 1), got {list(cfg.betas)}")
    if cfg.implementation not in IMPLEMENTATIONS:
        raise OptimConfigError(f"optim.implementation must be one of {IMPLEMENTATIONS}, got {cfg.implementation!r}")
    if cfg.decay_steps is not None and cfg.decay_steps < 0:
        raise OptimConfigError(f"optim.decay_steps must be >= 0, got {cfg.decay_steps}")
    return cfg


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for 0-based `step`: linear warmup to `lr` over `warmup_steps` (step 0 gets
    lr/warmup), then cosine from `lr` to `min_lr` over `decay_steps` (default: the rest of the
    run), then `min_lr`. "constant": warmup, then `lr`."""
    w = cfg.warmup_steps
    if step < w:
        return cfg.lr * (step + 1) / w
    if cfg.schedule == "constant":
        return cfg.lr
    decay = cfg.decay_steps if cfg.decay_steps is not None else max(total_steps - w, 0)
    if decay <= 0 or step - w >= decay:
        return cfg.min_lr
    frac = (step - w) / decay
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * frac))


def _strip_fsdp_prefix(name: str) -> str:
    # composable FSDP2 / checkpoint keep names; wrapper-based ones would add these
    for tag in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(tag, "")
    return name


def replica_groups(named_params, model_cfg: ModelConfig, tp: int) -> dict[int, list[torch.Tensor]]:
    """{tp_replicas: [parameter, ...]}: the parameters grouped by how many TP ranks hold a copy (computed
    once; the names do not change during a run)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for name, p in named_params:
        groups.setdefault(tp_replicas(_strip_fsdp_prefix(name), model_cfg, tp), []).append(p)
    return groups


@torch.no_grad()
def global_grad_norm(named_params, model_cfg: ModelConfig, tp: int, tp_group=None, dp_group=None,
                     dp_replicated: bool = False, groups: dict | None = None) -> torch.Tensor:
    """The L2 norm of the full model's gradient (fp32 scalar, identical on every rank).

    named_params: (name, parameter) with core/shards names; grads are TP-local tensors or FSDP
    DTensors (their `.to_local()` shard is used). `dp_replicated`: every dp rank holds the same
    full gradient (data parallel without FSDP), so the dp sum is divided by dp. `groups`: the
    `replica_groups` of named_params, when the caller keeps them. One `_foreach_norm` per replica
    count: a handful of kernels instead of two per parameter."""
    groups = replica_groups(named_params, model_cfg, tp) if groups is None else groups
    total, device = None, None
    for reps, params in groups.items():
        device = device or local_tensor(params[0]).device
        by_dtype: dict = {}
        for p in params:
            if p.grad is not None:
                g = local_tensor(p.grad).detach()
                g = g if g.dtype in (torch.float32, torch.float64) else g.float()
                by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():  # squares summed in float64: the DP / TP split does not show
            sq = torch.stack(torch._foreach_norm(grads)).double().square().sum() / reps
            total = sq if total is None else total + sq
    if total is None:
        total = torch.zeros((), dtype=torch.float64, device=device)
    total = total.reshape(1)
    # squares of disjoint FSDP shards over dp and of disjoint (replica-weighted) TP shards add up
    all_reduce(total, "sum", dp_group)
    all_reduce(total, "sum", tp_group)
    if dp_replicated:
        total = total / group_size(dp_group)
    return total.sqrt().float().reshape(())


@dataclass
class StepStats:
    grad_norm: float  # before clipping; nan/inf when the step was skipped
    lr: float
    skipped: bool
    skipped_total: int  # skipped steps so far


class TrainOptimizer:
    """AdamW + schedule + clipping + collective skip. One `step()` per training step.

    Build it after `parallelize` (so it sees FSDP's DTensor parameters). `state_dict()` holds the
    torch optimizer state (sharded like the parameters), the step count and the skip count."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, model_cfg: ModelConfig, total_steps: int,
                 tp_group=None, dp_group=None):
        self.cfg, self.model_cfg = check_optim_config(cfg), model_cfg
        self.total_steps, self.tp_group, self.dp_group = total_steps, tp_group, dp_group
        self.tp = group_size(tp_group)
        # without FSDP, every dp rank holds the whole (summed) gradient: count it once
        self.dp_replicated = not is_fsdp(model) and group_size(dp_group) > 1
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.named:
            raise ValueError("TrainOptimizer: the model has no trainable parameters")
        decay = [p for _, p in self.named if p.dim() >= 2]
        no_decay = [p for _, p in self.named if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr_at(0, cfg, total_steps),
                                     betas=tuple(cfg.betas), eps=cfg.eps, **{cfg.implementation: True})
        self.groups = replica_groups(self.named, model_cfg, self.tp)
        self.step_count = 0
        self.skipped_total = 0

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for _, p in self.named]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm(self.named, self.model_cfg, self.tp, self.tp_group, self.dp_group,
                                self.dp_replicated, self.groups)

    @torch.no_grad()
    def step(self) -> StepStats:
        """Clip to `grad_clip` by the global norm and take one AdamW step at this step's learning
        rate -- or, when the norm is not finite and `skip_nonfinite`, skip on every rank. Grads are
        zeroed either way."""
        lr = lr_at(self.step_count, self.cfg, self.total_steps)
        norm = self.grad_norm()
        norm_f = float(norm)
        finite = math.isfinite(norm_f)
        skipped = not finite and self.cfg.skip_nonfinite
        if skipped:
            self.skipped_total += 1
        else:
            if self.cfg.grad_clip > 0 and finite:
                coef = self.cfg.grad_clip / (norm_f + 1e-6)
                grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
                if coef < 1.0 and grads:
                    torch._foreach_mul_(grads, coef)
            for group in self.opt.param_groups:
                group["lr"] = lr
            self.opt.step()
        self.zero_grad()
        self.step_count += 1
        return StepStats(norm_f, lr, skipped, self.skipped_total)

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "step_count": self.step_count,
                "skipped_total": self.skipped_total}

    def load_state_dict(self, sd: dict) -> None:
        self.opt.load_state_dict(sd["optimizer"])
        self.step_count = int(sd["step_count"])
        self.skipped_total = int(sd["skipped_total"])


def build_optimizer(model: nn.Module, cfg: OptimConfig, model_cfg: ModelConfig, total_steps: int,
                    tp_group=None, dp_group=None) -> TrainOptimizer:
    """`TrainOptimizer` over the trainable parameters of `model` (after `parallelize`)."""
    return TrainOptimizer(model, cfg, model_cfg, total_steps, tp_group, dp_group)
