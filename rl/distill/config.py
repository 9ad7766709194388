"""The teacher and the distillation term: the `teacher` and `distill` config sections.

`algo.name=distill`: pure on-policy distillation (rollout, teacher pass, the distillation loss, no
reward needed; the reward, when the task has one, is still computed as a metric). With
`algo.name=grpo|ppo`, `distill.coef > 0` adds the distillation term beside the RL loss; the reference
KL stays as configured (`kl_ctl.beta`), so "distillation with the reference KL as well" is one more key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from core.config import ModelConfig

LOSSES = ("reverse_kl", "forward_kl", "jsd", "sampled_reverse_kl", "topk_forward_kl")
FULL_VOCAB = ("reverse_kl", "forward_kl", "jsd")  # exact, from the fused heads (parallel/distill_head.py)


@dataclass
class TeacherConfig:
    checkpoint: str | None = None  # a kltron model checkpoint; same tokenizer (fingerprint) and vocabulary
    cpu_offload: bool = False  # FSDP2 CPU offload of the frozen teacher, as reference.cpu_offload
    dtype: str = "fp32"  # "bf16": weights stored and computed in bf16; the divergence stays fp32 (fused heads)
    temperature: float = 1.0  # the teacher's logits / this; the student's are at rollout.temperature
    # a teacher built by the supervised warm start (rl/warmstart.py) on the task's examples when `checkpoint`
    # is absent: checkpoint defaults to {sft_dir}/model, trained with this architecture (`model`, else the
    # run's `model` section), steps, learning rate and share of wrong answers (0: clean demonstrations)
    sft_dir: str | None = None
    model: ModelConfig | None = None
    sft_steps: int = 300
    sft_lr: float = 2.0e-3
    sft_answer_noise: float = 0.0

    def __post_init__(self):
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"teacher.dtype must be 'fp32' or 'bf16', got {self.dtype!r}")
        if not self.temperature > 0:
            raise ValueError(f"teacher.temperature must be > 0, got {self.temperature}")


@dataclass
class DistillConfig:
    # weight of the distillation term per token (beside the RL loss; with algo.name=distill the only term):
    # null -> 1.0 for algo.name=distill, 0 (off) otherwise
    coef: float | None = None
    coef_end: float | None = None  # linear schedule: coef at step 0 -> coef_end at step coef_steps, then held
    coef_steps: int = 0
    # "reverse_kl": KL(student || teacher) per token, exact over the full vocabulary (on-policy distillation);
    # "forward_kl": KL(teacher || student); "jsd": GKD's generalised JSD with `beta` (teacher = P);
    # baselines: "sampled_reverse_kl": -(log s - log t) of the sampled token as a per-token advantage (the
    # Thinking Machines form); "topk_forward_kl": the teacher's top_k logits only, renormalised
    loss: str = "reverse_kl"
    beta: float = 0.5  # jsd's mixture weight on the teacher
    top_k: int = 20  # topk_forward_kl's teacher tokens per position

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"distill.loss must be one of {LOSSES}, got {self.loss!r}")
        if self.loss == "jsd" and not 0.0 < self.beta < 1.0:
            raise ValueError(f"distill.beta must be in (0, 1) for distill.loss='jsd', got {self.beta}")
        if self.coef is not None and self.coef < 0:
            raise ValueError(f"distill.coef must be >= 0, got {self.coef}")
        if self.coef_end is not None and (self.coef_end < 0 or self.coef_steps < 1):
            raise ValueError(f"distill.coef_end={self.coef_end} needs coef_end >= 0 and distill.coef_steps >= 1, "
                             f"got coef_steps={self.coef_steps}")
        if self.top_k < 1:
            raise ValueError(f"distill.top_k must be >= 1, got {self.top_k}")

    def coef_at(self, step: int) -> float:
        """The term's weight at `step` (resolved coef; linear to coef_end over coef_steps)."""
        c = float(self.coef or 0.0)
        if self.coef_end is None:
            return c
        f = min(max(step, 0), self.coef_steps) / self.coef_steps
        return c + (self.coef_end - c) * f


def resolve(distill: DistillConfig, teacher: TeacherConfig, algo_name: str) -> None:
    """Fill distill.coef's default and refuse a distillation without a teacher (one error naming the keys)."""
    if teacher.checkpoint is None and teacher.sft_dir is not None:
        teacher.checkpoint = os.path.join(teacher.sft_dir, "model")
    if distill.coef is None:
        distill.coef = 1.0 if algo_name == "distill" else 0.0
    on = algo_name == "distill" or distill.coef > 0 or (distill.coef_end or 0) > 0
    if on and teacher.checkpoint is None:
        raise ValueError(f"algo.name={algo_name!r} with distill.coef={distill.coef} needs teacher.checkpoint "
                         f"(the frozen teacher's model checkpoint) or teacher.sft_dir (one built by the warm start)")
    if algo_name == "distill" and distill.loss != "sampled_reverse_kl" and distill.coef == 0 and not distill.coef_end:
        raise ValueError("algo.name='distill' with distill.coef=0 trains on nothing: set distill.coef > 0")


def enabled(distill: DistillConfig, algo_name: str) -> bool:
    return algo_name == "distill" or bool(distill.coef) or bool(distill.coef_end)


def teacher_is_reference(cfg) -> bool:
    """Pure distillation without a reference KL (algo.name=distill, kl_ctl.mode=fixed with beta 0, no reference
    sync): no reference model is loaded; the teacher stands in for it, so the step's `kl_*` metrics measure
    the student's KL to the teacher and the memory is the policy's and one frozen model's, as in GRPO."""
    r = cfg.reference
    return (cfg.algo.name == "distill" and cfg.kl_ctl.mode == "fixed" and cfg.kl_ctl.beta == 0.0
            and r.checkpoint is None and r.sync_every == 0 and r.sync_below is None)


def guards_off(cfg) -> None:
    """With the teacher as the reference (teacher_is_reference) the KL guards would read the KL to the teacher,
    which is the objective (large at the start, falling), not a drift: guard.kl_warn_per_token and
    guard.kl_stop_per_token are switched off."""
    if teacher_is_reference(cfg):
        cfg.guard.kl_warn_per_token = cfg.guard.kl_stop_per_token = None
