"""Pre-flight: what a run is checked against and projected to cost before anything is built.

`check_rl_config` is the arithmetic every rank runs identically before any collective or file;
`planned_model` finds the model's shape before any weights exist (an HF config.json, a preset of
core.model_shapes, the start checkpoint's manifest); `dry_run` prints the resolved config, the model it
projected and core.runtime.budget's peak memory per rank for that exact layout; `check_memory` refuses,
on CUDA, a run projected past the GPU's memory.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import yaml

import core.ckpt as ckpt
from core.config import ConfigError, ModelConfig, check_train, from_dict, to_dict
from core.model_shapes import PRESETS, preset, shape_from_hf_config
from core.runtime.budget import param_counts, projected_peak_bytes
from parallel.context import check_context
from parallel.dims import ParallelDims, launch_world_size, resolve_device
from rl.config import RLConfig
from rl.distill.config import enabled as distill_enabled
from rl.distill.config import teacher_is_reference
from rl.update.step_data import defers_old_rows


def check_rl_config(cfg: RLConfig, world: int) -> ParallelDims:
    """Arithmetic checks, identical on every rank, before any collective or file."""
    check_train(cfg.train)
    dp = cfg.parallel.resolve_dp(world)
    dims = ParallelDims(dp=dp, tp=cfg.parallel.tp, cp=cfg.parallel.cp).validate(world)
    check_context_config(cfg)
    if cfg.rollout.prompts_per_step % dims.dp:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be a multiple of "
                          f"dp={dims.dp}")
    rows = cfg.rollout.prompts_per_step // dims.dp * cfg.rollout.group_size
    if rows % cfg.algo.mini_batches:
        raise ConfigError(f"algo.mini_batches={cfg.algo.mini_batches} must divide the {rows} rows per DP rank "
                          f"(prompts_per_step / dp * group_size)")
    return dims


def check_context_config(cfg: RLConfig) -> None:
    """What context parallelism (parallel.cp > 1) composes with; the rest refused here, naming what to use."""
    p, a = cfg.parallel, cfg.algo
    if p.cp == 1:
        return
    check_context(p.cp, p.cp_impl)  # the head counts: against the model itself, in rl/train.py's build
    refuse = [
        (a.name != "grpo", f"algo.name={a.name!r}: context parallelism runs the critic-free GRPO update (the PPO "
                           "critic and distillation passes have no CP path); use algo.name=grpo or parallel.cp=1"),
        (not a.fused_loss, "algo.fused_loss=false: under parallel.cp > 1 the loss is formed inside the fused head "
                           "on each rank's tokens; use algo.fused_loss=true"),
        (p.batch_invariant, "parallel.batch_invariant=true: the batch-invariant layouts are single-rank "
                            "sequences; use parallel.cp=1 with it"),
        (distill_enabled(cfg.distill, a.name), "distillation (a teacher pass) has no CP path; use parallel.cp=1"),
        (cfg.lora.enabled, "lora.rank > 0 is not validated under context parallelism; use parallel.cp=1 with LoRA"),
        (cfg.kl_ctl.mode == "grad_ratio", "kl_ctl.mode=grad_ratio measures whole-sequence gradient norms on "
                                          "one rank; use another kl_ctl.mode"),
        (cfg.loss.policy in ("gspo", "gspo_token"), f"loss.policy={cfg.loss.policy!r}: a sequence-level ratio "
                                                     "reads every token of a response on one rank; use ppo or cispo"),
    ]
    for bad, why in refuse:
        if bad:
            raise ConfigError(f"parallel.cp={p.cp}: {why}")


def role_dims(cfg, world: int) -> tuple[ParallelDims, ParallelDims]:
    """(trainer dims, rollout dims) of `world` ranks split by parallel.rollout_ranks; ConfigError by name."""
    p, R = cfg.parallel, cfg.parallel.rollout_ranks
    if R >= world:
        raise ConfigError(f"parallel.rollout_ranks={R} leaves no trainer rank in a world of {world}")
    rollout = ParallelDims(dp=R // p.rollout_tp, tp=p.rollout_tp)
    if cfg.rollout.prompts_per_step % rollout.dp:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be a multiple of the rollout "
                          f"ranks' dp={rollout.dp} (parallel.rollout_ranks / parallel.rollout_tp)")
    if getattr(p, "cp", 1) > 1:
        raise ConfigError(f"parallel.rollout_ranks > 0 with parallel.cp={p.cp}: the split launch lays the trainer "
                          "ranks out by tp x dp only; set parallel.cp=1 or parallel.rollout_ranks=0")
    if cfg.lora.enabled:
        raise ConfigError("parallel.rollout_ranks > 0 with lora.rank > 0: the weight sync sends full weights, not "
                          "adapters; train LoRA colocated (parallel.rollout_ranks=0)")
    return check_rl_config(cfg, world - R), rollout


def memory_plan(cfg: RLConfig, model_cfg: ModelConfig, world_size: int, device: torch.device) -> dict:
    """core.runtime.budget's projected peak bytes per rank of one step of this exact config, model and layout,
    with the distillation teacher when there is one (`planned_teacher`)."""
    teacher = planned_teacher(cfg, model_cfg)
    if cfg.parallel.rollout_ranks:  # the rollout ranks record no final hidden states: none reach the trainer
        cfg = replace(cfg, rollout=replace(cfg.rollout, record_hidden=False))
    plan = projected_peak_bytes(replace(cfg, model=model_cfg), world_size, device.type, teacher=teacher,
                                teacher_is_reference=teacher is not None and teacher_is_reference(cfg),
                                old_deferred=defers_old_rows(cfg, teacher is not None))
    return split_roles_plan(plan, cfg, model_cfg, device) if cfg.parallel.rollout_ranks else plan


def split_roles_plan(plan: dict, cfg: RLConfig, model_cfg: ModelConfig, device: torch.device) -> dict:
    """A launch split into trainer and rollout ranks (parallel.rollout_ranks, rl/pipeline): `plan`, made for the
    trainer ranks, without the rollout's KV cache and decode work (the rollout ranks generate), and the rollout
    ranks' own peak under 'rollout_ranks': the policy's weights at parallel.rollout_tp, unsharded, no gradient,
    optimizer state or reference, with the KV cache and decode work of their dp group's share of the step's
    rows (no final hidden states recorded: rl/pipeline/rollout_worker.py)."""
    p = cfg.parallel
    parts = dict(plan["parts"], **{"rollout KV cache": 0, "rollout work": 0})
    trainer = max(plan["experience_peak"], plan["update_peak"])
    ro_par = replace(p, rollout_ranks=0, tp=p.rollout_tp, dp=p.rollout_ranks // p.rollout_tp, cp=1, fsdp=False,
                     sequence_parallel=False)
    ro_cfg = replace(cfg, model=model_cfg, parallel=ro_par, rollout=replace(cfg.rollout, record_hidden=False))
    ro = projected_peak_bytes(ro_cfg, p.rollout_ranks, device.type)
    ro_parts = {k: ro["parts"][k] for k in ("policy weights", "rollout KV cache", "rollout work")}
    rollout_ranks = {"peak": sum(ro_parts.values()), "parts": ro_parts, "layout": ro["layout"], "batch": ro["batch"]}
    return dict(plan, parts=parts, rollout_peak=0, peak=trainer, rollout_ranks=rollout_ranks)


def planned_teacher(cfg: RLConfig, model_cfg: ModelConfig) -> ModelConfig | None:
    """The distillation teacher's shape for a plan (None without distillation): its checkpoint's manifest,
    else the architecture the warm start builds it with (teacher.model, else the run's model section)."""
    if not distill_enabled(cfg.distill, cfg.algo.name):
        return None
    t = cfg.teacher
    if t.checkpoint and os.path.isfile(os.path.join(t.checkpoint, "manifest.json")):
        return from_dict(ModelConfig, ckpt.read_manifest(t.checkpoint)["model_config"])
    if t.sft_dir is None and t.checkpoint:
        raise ConfigError(f"teacher.checkpoint={t.checkpoint}: no kltron checkpoint there (manifest.json missing), "
                          "so the teacher's shape is unknown to the memory plan; convert it first")
    return t.model or model_cfg


def check_memory(cfg: RLConfig, model_cfg: ModelConfig, world_size: int, device: torch.device) -> None:
    """On CUDA, refuse (ConfigError, before any model is built) a run whose projected peak per rank
    exceeds the GPU's memory, with the numbers; `train.memory_check=false` overrides."""
    if device.type != "cuda" or not cfg.train.memory_check:
        return
    plan = memory_plan(cfg, model_cfg, world_size, device)
    cap = torch.cuda.get_device_properties(device).total_memory
    if plan["peak"] > cap:
        parts = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in plan["parts"].items() if v)
        raise ConfigError(f"projected peak {plan['peak'] / 2**30:.1f} GiB per rank exceeds the "
                          f"{cap / 2**30:.1f} GiB of {torch.cuda.get_device_name(device)} (GiB: {parts}); raise "
                          "parallel.tp or the number of ranks, shard or offload the reference, lower the batch, or "
                          "set train.memory_check=false to try anyway")


def planned_model(cfg: RLConfig, hf_config: str | None = None, preset_name: str | None = None) -> tuple:
    """(ModelConfig, where its shape came from) for a plan made before any weights are loaded: `hf_config`
    (a Hugging Face config.json or its folder), else the preset `preset_name` (core.model_shapes), else
    the start checkpoint's manifest, else init.checkpoint's config.json (an HF folder not converted yet),
    else the model section when the warm start builds the checkpoint. A named init.checkpoint holding
    neither file is refused (ConfigError): a guessed shape would give a meaningless plan."""
    if hf_config is not None and preset_name is not None:
        raise ConfigError("--dry-run: give --hf-config or --model, not both")
    if hf_config is not None:
        return shape_from_hf_config(hf_config), f"the Hugging Face config {hf_config}"
    if preset_name is not None:
        return preset(preset_name), f"the preset {preset_name}"
    start = cfg.init.start_checkpoint
    if os.path.isfile(os.path.join(start, "manifest.json")):
        return from_dict(ModelConfig, ckpt.read_manifest(start)["model_config"]), f"the manifest of {start}"
    if os.path.isfile(os.path.join(start, "config.json")):
        return shape_from_hf_config(start), f"the Hugging Face config.json in {start} (not converted yet)"
    if cfg.init.checkpoint is not None:
        raise ConfigError(f"--dry-run: init.checkpoint={start} holds no converted checkpoint (manifest.json) nor a "
                          f"Hugging Face config.json, so the model's shape is unknown; give --hf-config "
                          f"PATH/config.json or --model one of {', '.join(sorted(PRESETS))}")
    return cfg.model, f"the model section (the warm start builds {start} from it)"


def describe_model(m: ModelConfig) -> str:
    """One line: the shape and the parameter count (core.runtime.budget's count at tp=1)."""
    n = param_counts(m, 1)["total"]
    return (f"{m.n_layers} layers, hidden {m.hidden_size}, heads {m.n_heads}/{m.n_kv_heads} kv, MLP "
            f"{m.intermediate_size}, vocab {m.vocab_size}{', tied' if m.tie_embeddings else ''}"
            f"{', qkv bias' if m.qkv_bias else ''}: {n / 1e9:.2f}e9 parameters")


def dry_run(cfg: RLConfig, world_size: int | None = None, hf_config: str | None = None,
            preset_name: str | None = None) -> dict:
    """`--dry-run`: the resolved config and the projected peak memory per rank for this exact config,
    layout (`world_size` ranks: default the launch's), device and model (`planned_model`), printed;
    nothing is built, loaded or launched, so it runs on a login node without the GPUs it plans for."""
    world = world_size or launch_world_size()
    label = "cuda" if cfg.train.device == "cuda" else None
    if label and not torch.cuda.is_available():  # plan for the GPUs from a machine without them
        cfg = replace(cfg, train=replace(cfg.train, device="cpu"))
    R = cfg.parallel.rollout_ranks  # a split launch: the plan is the trainer ranks', the rollout ranks' beside it
    dims = role_dims(cfg, world)[0] if R else check_rl_config(cfg, world)
    model_cfg, src = planned_model(cfg, hf_config, preset_name)
    device = torch.device(label) if label else resolve_device(cfg.train.device)
    plan = memory_plan(cfg, model_cfg, world - R, device)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    print(f"# model: {src}: {describe_model(model_cfg)}")
    teacher = planned_teacher(cfg, model_cfg)
    if teacher is not None:
        note = " (standing in for the reference)" if teacher_is_reference(cfg) else ""
        print(f"# teacher: {describe_model(teacher)}{note}")
    lay = plan["layout"]
    print(f"# sequence: {plan['batch'].seq_len} tokens, precision {lay.compute_dtype}, sequence parallelism "
          f"{'on' if lay.sp and lay.tp > 1 else 'off'}, context parallelism cp={lay.cp}")
    who = f"{world - R} trainer ranks of {world}" if R else f"{world} ranks"
    print(f"# projected peak per rank ({who}: tp={dims.tp} x dp={dims.dp}, {device.type}, reference "
          f"{plan['placement']}): {plan['peak'] / 2**30:.3f} GiB")
    for phase in ("experience_peak", "update_peak") if R else ("rollout_peak", "experience_peak", "update_peak"):
        print(f"#   {phase}: {plan[phase] / 2**30:.3f} GiB")
    for k, v in plan["parts"].items():
        print(f"#   {k}: {v / 2**30:.3f} GiB")
    if R:
        ro = plan["rollout_ranks"]
        print(f"# projected peak per rollout rank ({R} ranks: tp={ro['layout'].tp} x dp={ro['layout'].dp}, "
              f"{ro['batch'].rollout_rows} rows each): {ro['peak'] / 2**30:.3f} GiB")
        for k, v in ro["parts"].items():
            print(f"#   {k}: {v / 2**30:.3f} GiB")
    if lay.tp > 1 and not lay.sp:  # what parallel.sequence_parallel=true would change
        sp_cfg = replace(cfg, parallel=replace(cfg.parallel, sequence_parallel=True))
        alt = memory_plan(sp_cfg, model_cfg, world, device)
        print(f"# with parallel.sequence_parallel=true: peak {alt['peak'] / 2**30:.3f} GiB, sequence activations "
              f"{alt['parts']['sequence activations'] / 2**30:.3f} GiB")
    return plan
