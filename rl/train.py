"""`torchrun --nproc_per_node N -m rl.train --config configs/X.yaml [key=value ...]`

Builds the policy from `init.checkpoint` (training it first by supervised learning on the task if
it is absent), the frozen reference (default: the same checkpoint), the critic for PPO, then runs
`train.steps` RL steps, writing `metrics.jsonl` and checkpoints to `train.out_dir` and resuming from
its latest checkpoint when `train.resume`. The tokenizer is `tokenizer`, else the start checkpoint's
own (a converted HF checkpoint carries its files), else the shipped one. Prompts come from `data`
(rl.experience.prompts: read and tokenized once, in PromptSampler's order, whose state the checkpoints carry)
or from `reward.task`. A finished run writes `{out_dir}/model`: the policy's weights plus the
tokenizer files, ready for `python -m tools.convert_hf export`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace

import torch
import torch.distributed as dist

import core.ckpt as ckpt
from core.ckpt import raise_on_all_ranks, world_group
from core.ckpt.adapters import AdapterView, base_pointer, check_base_pointer, peft_factors, write_lora_config
from core.config import ConfigError, ModelConfig, from_dict, load_config
from core.lora import init_adapters, load_adapter_factors
from core.model import Transformer
from core.model_shapes import PRESETS
from core.optim import build_optimizer
from core.runtime.lifecycle import (
    PREEMPTED_EXIT,
    RankStalled,
    StopRequest,
    Watchdog,
    exit_process,
    is_comm_failure,
    shutdown,
)
from core.runtime.metrics import ProgressBar
from core.runtime.run import Run, check_not_stopped, record_stop, saving, start_run
from core.tokenizer import TOKENIZER_FILES, load_tokenizer
from parallel.context import ContextParallel, check_context
from parallel.dims import launch_world_size, resolve_device
from parallel.fsdp import FSDPOptions, freeze, parallelize
from parallel.lora import apply_lora, has_adapters
from rl.config import RLConfig
from rl.distill.config import enabled, teacher_is_reference
from rl.distill.teacher import teacher_model_config
from rl.experience.prompts import PromptSampler, data_hashes, load_prompt_data
from rl.experience.rewards import build_reward
from rl.experience.rollout import DataPrompts, TaskPrompts
from rl.health.guards import CollapseGuard, Preempted
from rl.models.critic import Critic
from rl.models.lora_ref import BaseReference
from rl.pipeline.loop import TrainHooks, run_split
from rl.preflight import check_memory, check_rl_config, dry_run
from rl.trainer import RLTrainer
from rl.warmstart import ensure_start_checkpoint, ensure_teacher_checkpoint


def _load(module_cls, model_cfg, path, state, kv_group, device, tokenizer_fp, what, verify=True, **kw):
    """Build on the meta device, then fill this rank's shards straight from the checkpoint (its files'
    hashes checked first unless `verify` is off)."""
    m = module_cls(model_cfg, state.tp_group, kv_group, device="meta", **kw)
    m = m.to_empty(device=device)
    target = m.body if isinstance(m, Critic) else m
    ckpt.load_model_weights(target, path, state, tokenizer_fingerprint=tokenizer_fp, what=what, verify=verify)
    if isinstance(m, Critic):
        with torch.no_grad():
            m.value_head.weight.zero_()
            m.value_head.bias.zero_()
    return m


def tokenizer_path(cfg: RLConfig) -> str | None:
    """`tokenizer`, else the start checkpoint's folder when it holds tokenizer files, else None (shipped)."""
    if cfg.tokenizer is not None:
        return cfg.tokenizer
    start = cfg.init.start_checkpoint
    return start if any(os.path.isfile(os.path.join(start, n)) for n in ("tokenizer.json", "tokenizer.model")) else None


def prompt_sources(cfg: RLConfig, tokenizer, task, data=None, max_seq_len: int | None = None):
    """(training prompt source, held-out [(ids, meta)] or None). `data`: load_prompt_data's (train, eval)
    when `cfg.data` is set (read here if not given); else the task's prompts and `rollout.eval_prompts`
    fixed task prompts."""
    ro = cfg.rollout
    if cfg.data is None:
        source = TaskPrompts(task, tokenizer)
        return source, (source.eval_prompts(ro.eval_prompts, cfg.train.seed) if ro.eval_prompts else None)
    train_set, eval_set = data if data is not None else load_prompt_data(cfg.data, tokenizer)
    d = cfg.data
    sampler = PromptSampler(len(train_set.prompts), ro.prompts_per_step, seed=d.seed, shuffle=d.shuffle,
                            epochs=d.epochs, files=data_hashes(d))
    if cfg.train.steps > sampler.num_steps:
        raise ConfigError(f"train.steps={cfg.train.steps} is past the data: {train_set.summary()} give "
                          f"{sampler.num_steps} steps of rollout.prompts_per_step={ro.prompts_per_step} in "
                          f"data.epochs={d.epochs}")
    longest = max(len(p.ids) for ps in (train_set, eval_set) if ps is not None for p in ps.prompts)
    if max_seq_len is not None and longest + ro.max_new_tokens > max_seq_len:
        raise ConfigError(f"data: the longest prompt has {longest} tokens; with rollout.max_new_tokens="
                          f"{ro.max_new_tokens} that passes the model's max_seq_len={max_seq_len} (set "
                          f"data.max_prompt_tokens <= {max_seq_len - ro.max_new_tokens})")
    evals = None
    if eval_set is not None:
        evals = [(p.ids, p.meta) for p in eval_set.prompts]
        evals = evals[:ro.eval_prompts] if ro.eval_prompts else evals
    return DataPrompts(train_set, sampler), evals


def assemble(cfg: RLConfig, state, model_cfg, tokenizer, policy, ref, critic=None, data=None,
             teacher=None) -> RLTrainer:
    """Shard the (plain, TP-local) policy, reference and critic over DP as configured, build their
    optimizers, the reward, the prompt sources and the trainer. Used by `build` and by tests with
    seeded models."""
    p = cfg.parallel
    mp = p.precision(state.device.type)
    opts = FSDPOptions(fsdp=p.fsdp, mixed_precision=mp, activation_checkpointing=p.activation_checkpointing,
                       cpu_offload=False)
    total = cfg.train.steps * cfg.algo.epochs * cfg.algo.mini_batches
    if cfg.lora.enabled and not has_adapters(policy):  # frozen base, fp32 adapters (parallel/lora.py)
        init_adapters(apply_lora(policy, cfg.lora), cfg.lora.seed)
        if cfg.lora.init_from:  # continue from a PEFT adapter
            load_adapter_factors(policy, peft_factors(cfg.lora), f"lora.init_from={cfg.lora.init_from}")
    policy = parallelize(policy, state.dp_mesh, opts).set_mixed_precision(mp)
    if cfg.train.compile:
        policy.compile_blocks()
    if cfg.reference.from_policy_base:  # the policy with its adapters off: no reference weights
        ref = BaseReference(policy)
    elif ref is not None:
        if cfg.reference.dtype == "bf16":  # bf16 weights, half the memory; its KL path stays fp32 (fused heads)
            ref = ref.cast_weights(torch.bfloat16)
        ref = parallelize(freeze(ref), state.dp_mesh, FSDPOptions(fsdp=p.fsdp, mixed_precision=mp,
                                                                   cpu_offload=cfg.reference.cpu_offload))
        ref.set_mixed_precision(mp)
    if teacher is not None:  # frozen and sharded like the reference (rl/distill/teacher.py)
        if cfg.teacher.dtype == "bf16":
            teacher = teacher.cast_weights(torch.bfloat16)
        teacher = parallelize(freeze(teacher), state.dp_mesh, FSDPOptions(fsdp=p.fsdp, mixed_precision=mp,
                                                                           cpu_offload=cfg.teacher.cpu_offload))
        teacher.set_mixed_precision(mp)
    if ref is None:
        if teacher is None or not teacher_is_reference(cfg):
            raise ValueError("no reference model: only pure distillation without a reference KL runs without one")
        ref = teacher
    policy.batch_invariant = ref.batch_invariant = p.batch_invariant  # rollout, reference, old, update alike
    if p.cp > 1:  # the reference, old-log-prob and update passes split each sequence (rl/update/context_heads.py)
        check_context(p.cp, p.cp_impl, p.tp, model_cfg.n_heads, model_cfg.n_kv_heads)
        policy.context_parallel = ref.context_parallel = ContextParallel(state.cp_group, p.cp_impl,
                                                                         p.tp if p.sequence_parallel else 1)
    if teacher is not None:
        teacher.batch_invariant = p.batch_invariant  # the teacher's pass too
    for m in [m for m in (policy, ref, teacher, getattr(critic, "body", None)) if hasattr(m, "sequence_parallel")]:
        m.sequence_parallel = p.sequence_parallel  # core/seq_parallel.py: full-sequence forwards only
    opt = build_optimizer(policy, cfg.optim, model_cfg, total, state.tp_group, state.grad_group)
    critic_opt = None
    if critic is not None:
        critic = parallelize(critic, state.dp_mesh, opts)
        critic.body.set_mixed_precision(mp)
        copt = replace(cfg.optim, lr=cfg.critic.lr, min_lr=cfg.critic.lr * 0.1, warmup_steps=cfg.critic.warmup_steps)
        critic_opt = build_optimizer(critic, copt, model_cfg, total, state.tp_group, state.dp_group)
    task, reward_fn, reward_norm = build_reward(cfg.reward)
    source, evals = prompt_sources(cfg, tokenizer, task, data, model_cfg.max_seq_len)
    return RLTrainer(cfg, state, policy, ref, opt, tokenizer, source, reward_fn, reward_norm, critic, critic_opt,
                     eval_prompts=evals, teacher=teacher)


def build(cfg: RLConfig, stop_request: StopRequest | None = None, role=None) -> tuple[RLTrainer, Run, object]:
    """Check the config, make sure the starting checkpoint exists (SFT builds it when asked; a signal
    caught by `stop_request` stops it at its next step, with its checkpoint), set up the run and load
    policy, reference (and critic) into the trainer -> (trainer, run, tokenizer). `role`: the trainer
    ranks of a launch split into roles (rl/pipeline), which built the checkpoints before the split."""
    world = launch_world_size() if role is None else role.state.dims.world_size
    dims = check_rl_config(cfg, world)
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    data = None
    if cfg.data is not None:  # read, checked and tokenized on every rank before any collective
        data = load_prompt_data(cfg.data, tokenizer)
        if cfg.init.checkpoint is None:
            raise ConfigError("data: prompts from a data set need init.checkpoint (a converted checkpoint); the "
                              "supervised warm start only knows the built-in tasks")
    start = cfg.init.start_checkpoint if role is not None else \
        ensure_start_checkpoint(cfg, tokenizer, resolve_device(cfg.train.device), stop_request)
    if enabled(cfg.distill, cfg.algo.name) and role is None:
        ensure_teacher_checkpoint(cfg, tokenizer, resolve_device(cfg.train.device), stop_request)
    model_cfg = from_dict(ModelConfig, ckpt.read_manifest(start)["model_config"])
    check_memory(cfg, model_cfg, world, resolve_device(cfg.train.device))
    run = start_run(cfg, dims, model_cfg, role)
    state, kv_group, device, fp = run.state, run.kv_group, run.device, tokenizer.fingerprint
    load = dict(state=state, kv_group=kv_group, device=device, tokenizer_fp=fp, verify=cfg.train.verify_checkpoints)
    policy = _load(Transformer, model_cfg, start, what="policy", **load)
    ref = None  # the teacher stands in (pure distillation without a reference KL), or the policy's base (LoRA)
    if not teacher_is_reference(cfg) and not cfg.reference.from_policy_base:
        ref = _load(Transformer, model_cfg, cfg.reference.checkpoint or start, what="reference", **load)
    critic = None
    if cfg.algo.name == "ppo":
        critic = _load(Critic, model_cfg, start, what="critic", **load)
    teacher = None
    if enabled(cfg.distill, cfg.algo.name):  # may differ in size, not in tokenizer or vocabulary
        t_cfg = teacher_model_config(start, cfg.teacher.checkpoint, fp)
        teacher = _load(Transformer, t_cfg, cfg.teacher.checkpoint, what="teacher", **load)
    trainer = assemble(cfg, state, model_cfg, tokenizer, policy, ref, critic, data, teacher)
    # LoRA on a base that never changes: checkpoints hold the adapters and name this base (core/ckpt/adapters.py)
    trainer.lora_base = base_pointer(start) if cfg.lora.enabled and not _synced(cfg) else None
    return trainer, run, tokenizer


def _synced(cfg: RLConfig) -> bool:
    return bool(cfg.reference.sync_every) or cfg.reference.sync_below is not None


def _adapters_only(trainer: RLTrainer) -> bool:
    return getattr(trainer, "lora_base", None) is not None


def _modules(trainer: RLTrainer) -> dict:
    if _adapters_only(trainer):  # the frozen base is the start checkpoint's: only the adapters are state
        return {"adapters": (AdapterView(trainer.policy), trainer.opt)}
    mods = {"policy": (trainer.policy, trainer.opt)}
    if trainer.critic is not None:
        mods["critic"] = (trainer.critic, trainer.critic_opt)
    synced = trainer.cfg.reference.sync_every or trainer.cfg.reference.sync_below is not None
    if synced and not trainer.cfg.reference.from_policy_base:  # a base reference merges into the policy
        mods["reference"] = (trainer.ref, None)  # a synced reference is part of the state
    return mods


def _sampler(trainer: RLTrainer):
    return getattr(trainer.task, "sampler", None)


def _extra_state(trainer: RLTrainer) -> dict:
    extra = {"kl_controller": trainer.controller.state_dict(), "ref_sync": trainer.ref_sync.state_dict(),
             "reward_norm": trainer.reward_norm.state_dict(), "entropy_ctl": trainer.ent_ctl.state_dict(),
             "reward_kl_window": trainer.recorder.reward_kl.state_dict()}
    if _sampler(trainer) is not None:
        extra["prompt_sampler"] = _sampler(trainer).state_dict()
    if _adapters_only(trainer):
        extra["lora_base"] = trainer.lora_base
    return extra


def _resume(trainer: RLTrainer, run: Run) -> int:
    """Load the latest checkpoint when resuming -> the first step to run."""
    extra = trainer.resumed_extra = run.resume(_modules(trainer))
    if extra is None:
        return 0
    if _adapters_only(trainer) or "lora_base" in extra:
        check_base_pointer(extra.get("lora_base"), getattr(trainer, "lora_base", None), run.ckpt_root)
    trainer.controller.load_state_dict(extra["kl_controller"])
    trainer.ref_sync.load_state_dict(extra["ref_sync"])
    trainer.reward_norm.load_state_dict(extra["reward_norm"])
    if "entropy_ctl" in extra:  # checkpoints written before the entropy target existed have none
        trainer.ent_ctl.load_state_dict(extra["entropy_ctl"])
    if "reward_kl_window" in extra:  # reward_kl_corr's window (absent in older checkpoints)
        trainer.recorder.reward_kl.load_state_dict(extra["reward_kl_window"])
    if _sampler(trainer) is not None or "prompt_sampler" in extra:
        if _sampler(trainer) is None or "prompt_sampler" not in extra:
            raise ConfigError(f"resume: the checkpoint under {run.ckpt_root} was "
                              f"{'' if 'prompt_sampler' in extra else 'not '}trained on a data set and this run is "
                              f"{'' if _sampler(trainer) is not None else 'not'}; set data as that run did")
        _sampler(trainer).check_state(extra["prompt_sampler"])
    return int(extra["step"]) + 1


def tokenizer_files(tokenizer) -> list[str]:
    """The tokenizer files found beside the tokenizer (core.tokenizer.TOKENIZER_FILES)."""
    folder = os.path.dirname(os.path.abspath(tokenizer.path))
    return [os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]


def save_final_model(trainer: RLTrainer, run: Run, tokenizer, step: int) -> str:
    """Write `{out_dir}/model`: the policy's full weights (gathered over TP and DP) and the tokenizer
    files, all hashed in the manifest, so `tools.convert_hf export` gives a folder `transformers`
    loads. Collective."""
    with saving(f"the final model {run.final_model_dir} (step {step})"), tempfile.TemporaryDirectory() as tmp:
        extra = tokenizer_files(tokenizer)
        if trainer.cfg.lora.enabled:  # base + adapters + their config: tools.convert_hf export --merge-lora / --peft
            extra.append(write_lora_config(tmp, trainer.cfg.lora))
        return ckpt.save_model_weights(trainer.policy, run.final_model_dir, run.state,
                                       tokenizer_fingerprint=tokenizer.fingerprint, step=step, extra_files=extra)


def _report(rec: dict, step: int, cfg: RLConfig, is_main: bool) -> str | None:
    """Warn on stderr above guard.kl_warn_per_token; the stop message when guard.kl_stop_per_token was passed."""
    if rec["kl_warning"] and is_main:
        print(f"kltron: step {step}: mean KL {rec['kl_mean']:.3f} nats per token is above guard.kl_warn_per_token="
              f"{cfg.guard.kl_warn_per_token}: the policy moved far from the reference (learning rate too high? "
              f"optim.lr={cfg.optim.lr}; or kl_ctl.beta={rec['beta']:.3g} too small)", file=sys.stderr)
    if rec.get("kl_stop"):
        return (f"kltron: step {step}: mean KL {rec['kl_mean']:.3f} nats per token passed guard.kl_stop_per_token="
                f"{cfg.guard.kl_stop_per_token}; stopping after this checkpoint (see python -m tools.diagnose)")
    return None


def _should_save(t, step: int, stop) -> bool:
    pause = t.stop_after is not None and step + 1 >= t.stop_after
    return step == t.steps - 1 or bool(stop) or pause or bool(t.save_every and (step + 1) % t.save_every == 0)


def run(cfg: RLConfig, stop_request: StopRequest | None = None) -> list[dict]:
    """Train as `cfg` says. A SIGTERM / SIGUSR1 caught by `stop_request` ends the run after the next
    step every rank agrees on, with its checkpoint written (raises Preempted)."""
    if cfg.parallel.rollout_ranks:  # disjoint rollout and trainer ranks (rl/pipeline)
        return run_split(cfg, stop_request, TrainHooks(build, _resume, _modules, _extra_state, save_final_model,
                                                       _report, _should_save, tokenizer_files, tokenizer_path,
                                                       prompt_sources))
    trainer, run, tokenizer = build(cfg, stop_request)
    t = cfg.train
    try:
        first = _resume(trainer, run)
        raise_on_all_ranks(lambda: check_not_stopped(run.out_dir, run.resumed_step) if run.state.is_main else None,
                           world_group(run.state), src=0)
        if run.resumed_step is not None and run.resumed_step >= t.steps - 1:
            if not run.finished(t.steps - 1, "rl.train", final_step=t.steps):  # final model missing: write it
                save_final_model(trainer, run, tokenizer, t.steps)
            run.close()
            getattr(trainer.reward_fn, "close", lambda: None)()
            return []
    except BaseException:
        run.close()  # the out_dir lock
        raise
    writer = run.open_outputs(cfg)
    bar = ProgressBar(t.steps, enabled=run.state.is_main and t.progress, every=t.log_every)
    dog = Watchdog.for_run(cfg.parallel.watchdog_s, program="kltron.rl.train")
    dog.on_frozen = lambda err: dog.explain(err, cfg.parallel.timeout_s)  # the comm failure's message, below
    dog.start()
    guard = CollapseGuard(cfg.optim.lr, run.state.is_main)
    records, stop, preempted = [], None, False
    try:
        for step in range(first, t.steps):
            dog.beat("step", step)
            rec = trainer.step(step)
            records.append(rec)
            with saving(f"the metrics of step {step}"):  # a full disk: the file and the step named
                writer.write(rec)
            bar.update(step + 1, reward=rec["reward_mean"], kl=rec["kl_mean"], beta=rec["beta"],
                       ent=rec["entropy"], tok_s=rec["tokens_per_s"])
            collapse = guard.check(rec)  # named before the KL limits a collapse also trips
            stop = collapse or _report(rec, step, cfg, run.state.is_main)
            preempted = stop_request is not None and stop_request.agree(run.device)
            if _should_save(t, step, stop or preempted):
                dog.beat("save", step)
                run.save(step, _modules(trainer), _extra_state(trainer), tokenizer.fingerprint,
                         tokenizer_files(tokenizer))
                if collapse and run.state.is_main:  # a rerun must not train the collapsed checkpoint on
                    record_stop(run.out_dir, step, "collapse", collapse.removeprefix("kltron: "))
            if stop or preempted or (t.stop_after is not None and step + 1 >= t.stop_after):
                break
        if not stop and not preempted and records and records[-1]["step"] == t.steps - 1:
            save_final_model(trainer, run, tokenizer, t.steps)  # {out_dir}/model, with the tokenizer files
    except RuntimeError as e:
        if isinstance(e, RankStalled) or not dist.is_initialized() or not is_comm_failure(e):
            raise
        raise RankStalled(dog.explain(e, cfg.parallel.timeout_s)) from e
    finally:
        dog.stop()
        run.close()
        getattr(trainer.reward_fn, "close", lambda: None)()  # the reward plug-ins' worker process
        if trainer.monitor is not None:
            trainer.monitor.close()
    if stop:
        raise SystemExit(stop)
    if preempted:
        raise Preempted(f"kltron.rl.train: stop requested by signal {stop_request.signum or 'on another rank'}; "
                        f"saved the checkpoint of step {step} in {run.ckpt_root}; run the same command to resume")
    return records


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m rl.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="YAML config (see configs/)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the resolved config and the projected peak memory per rank, then exit")
    ap.add_argument("--world-size", type=int, default=None,
                    help="with --dry-run: plan for this many ranks (default: the launch's)")
    ap.add_argument("--hf-config", default=None,
                    help="with --dry-run: take the model's shape from this Hugging Face config.json (or its folder)")
    ap.add_argument("--model", default=None, choices=sorted(PRESETS),
                    help="with --dry-run: take the model's shape from a preset")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    owns_group = not dist.is_initialized()
    stop_request = StopRequest().install()
    code = 1
    try:
        cfg = load_config(RLConfig, args.config, args.overrides)
        if args.dry_run:
            dry_run(cfg, args.world_size, args.hf_config, args.model)
            return 0
        run(cfg, stop_request)
        code = 0
    except RankStalled as e:
        print(f"kltron.rl.train: error (rank {os.environ.get('RANK', '0')}): {e}", file=sys.stderr)
        code = 1
    except Preempted as e:
        print(e, file=sys.stderr)
        code = PREEMPTED_EXIT
    except (ConfigError, ckpt.CheckpointError, ValueError) as e:
        print(f"kltron.rl.train: error (rank {os.environ.get('RANK', '0')}): {e}", file=sys.stderr)
        code = 2
    finally:
        stop_request.uninstall()
        if owns_group:
            shutdown(barrier=code == 0)
    return code


if __name__ == "__main__":
    exit_process(main())
