"""`torchrun --nproc_per_node N -m rl.train --config configs/X.yaml [key=value ...]`

Builds the policy from `init.checkpoint` (training it first by supervised learning on the task if
it is absent and `init.build_if_missing`), the frozen reference (default: the same checkpoint),
the critic for PPO, then runs `train.steps` RL steps, writing `metrics.jsonl` and checkpoints to
`train.out_dir` and resuming from its latest checkpoint when `train.resume`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

import core.ckpt as ckpt
from core.config import ConfigError, ModelConfig, check_train, from_dict, load_config
from core.lifecycle import PREEMPTED_EXIT, RankStalled, StopRequest, Watchdog, exit_process, is_comm_failure, shutdown
from core.metrics import ProgressBar
from core.model import Transformer
from core.optim import build_optimizer
from core.run import Run, start_run
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, launch_world_size, resolve_device
from parallel.fsdp import FSDPOptions, freeze, parallelize
from rl.config import RLConfig
from rl.critic import Critic
from rl.guards import CollapseGuard, Preempted
from rl.rewards import build_reward
from rl.trainer import RLTrainer
from rl.warmstart import ensure_start_checkpoint


def check_rl_config(cfg: RLConfig, world: int) -> ParallelDims:
    """Arithmetic checks, identical on every rank, before any collective or file."""
    check_train(cfg.train)
    dp = cfg.parallel.resolve_dp(world)
    dims = ParallelDims(dp=dp, tp=cfg.parallel.tp).validate(world)
    if cfg.rollout.prompts_per_step % dims.dp:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be a multiple of "
                          f"dp={dims.dp}")
    rows = cfg.rollout.prompts_per_step // dims.dp * cfg.rollout.group_size
    if rows % cfg.algo.mini_batches:
        raise ConfigError(f"algo.mini_batches={cfg.algo.mini_batches} must divide the {rows} rows per DP rank "
                          f"(prompts_per_step / dp * group_size)")
    return dims


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


def assemble(cfg: RLConfig, state, model_cfg, tokenizer, policy, ref, critic=None) -> RLTrainer:
    """Shard the (plain, TP-local) policy, reference and critic over DP as configured, build their
    optimizers, the reward and the trainer. Used by `build` and by tests with seeded models."""
    p = cfg.parallel
    opts = FSDPOptions(fsdp=p.fsdp, mixed_precision=p.mixed_precision,
                       activation_checkpointing=p.activation_checkpointing, cpu_offload=False)
    total = cfg.train.steps * cfg.algo.epochs * cfg.algo.mini_batches
    policy = parallelize(policy, state.dp_mesh, opts)
    ref = parallelize(freeze(ref), state.dp_mesh, FSDPOptions(fsdp=p.fsdp, mixed_precision=p.mixed_precision,
                                                               cpu_offload=cfg.reference.cpu_offload))
    opt = build_optimizer(policy, cfg.optim, model_cfg, total, state.tp_group, state.dp_group)
    critic_opt = None
    if critic is not None:
        critic = parallelize(critic, state.dp_mesh, opts)
        copt = replace(cfg.optim, lr=cfg.critic.lr, min_lr=cfg.critic.lr * 0.1, warmup_steps=cfg.critic.warmup_steps)
        critic_opt = build_optimizer(critic, copt, model_cfg, total, state.tp_group, state.dp_group)
    task, reward_fn, reward_norm = build_reward(cfg.reward)
    return RLTrainer(cfg, state, policy, ref, opt, tokenizer, task, reward_fn, reward_norm, critic, critic_opt)


def build(cfg: RLConfig) -> tuple[RLTrainer, Run, object]:
    """Check the config, make sure the starting checkpoint exists (SFT builds it when asked), set up
    the run and load policy, reference (and critic) into the trainer -> (trainer, run, tokenizer)."""
    dims = check_rl_config(cfg, launch_world_size())
    tokenizer = load_tokenizer(cfg.tokenizer)
    start = ensure_start_checkpoint(cfg, tokenizer, resolve_device(cfg.train.device))
    model_cfg = from_dict(ModelConfig, ckpt.read_manifest(start)["model_config"])
    run = start_run(cfg, dims, model_cfg)
    state, kv_group, device, fp = run.state, run.kv_group, run.device, tokenizer.fingerprint
    load = dict(state=state, kv_group=kv_group, device=device, tokenizer_fp=fp, verify=cfg.train.verify_checkpoints)
    policy = _load(Transformer, model_cfg, start, what="policy", **load)
    ref = _load(Transformer, model_cfg, cfg.reference.checkpoint or start, what="reference", **load)
    critic = None
    if cfg.algo.name == "ppo":
        critic = _load(Critic, model_cfg, start, what="critic", **load)
    return assemble(cfg, state, model_cfg, tokenizer, policy, ref, critic), run, tokenizer


def _modules(trainer: RLTrainer) -> dict:
    mods = {"policy": (trainer.policy, trainer.opt)}
    if trainer.critic is not None:
        mods["critic"] = (trainer.critic, trainer.critic_opt)
    if trainer.cfg.reference.sync_every or trainer.cfg.reference.sync_below is not None:
        mods["reference"] = (trainer.ref, None)  # a synced reference is part of the state
    return mods


def _extra_state(trainer: RLTrainer) -> dict:
    return {"kl_controller": trainer.controller.state_dict(), "ref_sync": trainer.ref_sync.state_dict(),
            "reward_norm": trainer.reward_norm.state_dict()}


def _resume(trainer: RLTrainer, run: Run) -> int:
    """Load the latest checkpoint when resuming -> the first step to run."""
    extra = run.resume(_modules(trainer))
    if extra is None:
        return 0
    trainer.controller.load_state_dict(extra["kl_controller"])
    trainer.ref_sync.load_state_dict(extra["ref_sync"])
    trainer.reward_norm.load_state_dict(extra["reward_norm"])
    return int(extra["step"]) + 1


def _report(rec: dict, step: int, cfg: RLConfig, is_main: bool) -> str | None:
    """Warn on stderr above guard.kl_warn; the stop message when guard.kl_stop was passed."""
    if rec["kl_warning"] and is_main:
        print(f"kltron: step {step}: mean KL {rec['kl_mean']:.3f} is above guard.kl_warn="
              f"{cfg.guard.kl_warn}", file=sys.stderr)
    if rec.get("kl_stop"):
        return (f"kltron: step {step}: mean KL {rec['kl_mean']:.3f} passed guard.kl_stop={cfg.guard.kl_stop}; "
                "stopping after this checkpoint (see python -m tools.diagnose)")
    return None


def _should_save(t, step: int, stop) -> bool:
    pause = t.stop_after is not None and step + 1 >= t.stop_after
    return step == t.steps - 1 or bool(stop) or pause or bool(t.save_every and (step + 1) % t.save_every == 0)


def run(cfg: RLConfig, stop_request: StopRequest | None = None) -> list[dict]:
    """Train as `cfg` says. A SIGTERM / SIGUSR1 caught by `stop_request` ends the run after the next
    step every rank agrees on, with its checkpoint written (raises Preempted)."""
    trainer, run, tokenizer = build(cfg)
    first = _resume(trainer, run)
    t = cfg.train
    if run.finished(t.steps - 1, "rl.train"):
        return []
    writer = run.open_outputs(cfg)
    bar = ProgressBar(t.steps, enabled=run.state.is_main and t.progress, every=t.log_every)
    dog = Watchdog.for_run(cfg.parallel.watchdog_s).start()
    guard = CollapseGuard(cfg.optim.lr, run.state.is_main)
    records, stop, preempted = [], None, False
    try:
        for step in range(first, t.steps):
            dog.beat("step", step)
            rec = trainer.step(step)
            rec["entropy_max"] = math.log(tokenizer.vocab_size)  # ln V: the uniform policy's entropy
            records.append(rec)
            writer.write(rec)
            bar.update(step + 1, reward=rec["reward_mean"], kl=rec["kl_mean"], beta=rec["beta"],
                       ent=rec["entropy"], tok_s=rec["tokens_per_s"])
            collapse = guard.check(rec)  # named before the KL limits a collapse also trips
            stop = collapse or _report(rec, step, cfg, run.state.is_main)
            preempted = stop_request is not None and stop_request.agree(run.device)
            if _should_save(t, step, stop or preempted):
                dog.beat("save", step)
                run.save(step, _modules(trainer), _extra_state(trainer), tokenizer.fingerprint)
            if stop or preempted or (t.stop_after is not None and step + 1 >= t.stop_after):
                break
    except RuntimeError as e:
        if isinstance(e, RankStalled) or not dist.is_initialized() or not is_comm_failure(e):
            raise
        raise RankStalled(dog.explain(e, cfg.parallel.timeout_s)) from e
    finally:
        dog.stop()
        run.close()
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
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    owns_group = not dist.is_initialized()
    stop_request = StopRequest().install()
    code = 1
    try:
        cfg = load_config(RLConfig, args.config, args.overrides)
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
