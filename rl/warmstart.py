"""The policy's starting checkpoint: use `init.checkpoint`, or build `{init.sft_dir}/final` by
supervised training on the task's own examples when it is absent (the README's default job).

Every rank runs this; the decision depends only on files every rank sees (a shared file system
on multi-node runs), and SFT itself is the ordinary distributed `core.sft.train`.
"""

from __future__ import annotations

import copy
import os
import random
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

import core.ckpt as ckpt
from core.config import ConfigError, DataConfig, SFTConfig, TrainConfig
from core.sft import train as sft_train
from parallel.dims import backend_for, launch_world_size
from rl.config import RLConfig
from rl.experience.rewards import build_reward
from rl.experience.tasks import sft_text

VISIBLE_GRACE_S = 10.0  # how long a rank retries seeing a file another rank sees (a network file system's lag)


def corrupt_answer(answer: str, rng: random.Random) -> str:
    """The answer with one character replaced by another of its kind (digit or letter)."""
    if not answer:
        return answer
    i = rng.randrange(len(answer))
    pool = "0123456789" if answer[i].isdigit() else "abcdefgh" if answer[i].isalpha() else answer[i]
    choices = [c for c in pool if c != answer[i]] or [answer[i]]
    return answer[:i] + rng.choice(choices) + answer[i + 1:]


def write_task_corpus(cfg: RLConfig, path: str) -> None:
    """`init.sft_examples` lines "prompt+answer" from the task, drawn with a seed that the RL
    prompts never use; a share `init.sft_answer_noise` of them carries a wrong answer (one
    character changed): a noisy demonstration set, whose mistakes the policy imitates and RL
    against the exact-match verifier then removes. Written atomically."""
    task, _, _ = build_reward(cfg.reward)
    rng = random.Random(f"sft-{cfg.train.seed}")
    lines = []
    for _, meta in task.sample_prompts(cfg.init.sft_examples, rng):
        if rng.random() < cfg.init.sft_answer_noise:
            meta = dict(meta, answer=corrupt_answer(meta["answer"], rng))
        lines.append(sft_text(meta))
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "manifest.json"))


def _launch_group(cfg: RLConfig, device) -> None:
    """The launch's process group (torchrun's env://), created here when none exists, as SFT or the
    RL run would a moment later, so that the ranks can agree on what they see."""
    device = torch.device(device)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend_for(device), timeout=timedelta(seconds=cfg.parallel.timeout_s))


def _all_see(test, what: str, fix: str) -> bool:
    """`test()` on every rank, retried for VISIBLE_GRACE_S where it fails (a network file system's cache
    lag) once some rank has passed; True when all pass, False when none does, else a CheckpointError on
    every rank naming the ranks that do not see `what` (a file system not shared by all ranks)."""
    world = dist.get_world_size()
    seen = [None] * world
    dist.all_gather_object(seen, test())
    if any(seen) and not all(seen):
        deadline = time.monotonic() + VISIBLE_GRACE_S
        ok = test()
        while not ok and time.monotonic() < deadline:
            time.sleep(0.2)
            ok = test()
        dist.all_gather_object(seen, ok)
    if all(seen) or not any(seen):
        return bool(seen[0])
    blind = [r for r, ok in enumerate(seen) if not ok]
    raise ckpt.CheckpointError(f"rank{'s' if len(blind) > 1 else ''} {', '.join(map(str, blind))} cannot see "
                               f"{what}, which rank{'s' if world - len(blind) > 1 else ''} "
                               f"{', '.join(str(r) for r in range(world) if r not in blind)} "
                               f"see{'' if world - len(blind) > 1 else 's'}: {fix} must be on "
                               "a file system every rank sees")


def ensure_start_checkpoint(cfg: RLConfig, tokenizer, device, stop_request=None) -> str:
    """`init.start_checkpoint`, built first by SFT when absent. A SIGTERM / SIGUSR1 caught by `stop_request`
    stops the SFT at its next step with its checkpoint (core.runtime.lifecycle.Preempted); the same command
    resumes it."""
    path = cfg.init.start_checkpoint
    world = launch_world_size()
    if world > 1:
        _launch_group(cfg, device)
        key = f"init.checkpoint={path}" if cfg.init.checkpoint is not None else f"init.sft_dir={cfg.init.sft_dir}"
        if _all_see(lambda: _is_checkpoint(path), f"the start checkpoint {path}", key):
            return path
    elif _is_checkpoint(path):
        return path
    if cfg.init.checkpoint is not None:
        raise ckpt.CheckpointError(f"init.checkpoint={path}: no kltron checkpoint there (manifest.json missing); "
                                   "convert one with python -m tools.convert_hf import, or unset init.checkpoint "
                                   "to build one by supervised training")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} pieces")
    os.makedirs(cfg.init.sft_dir, exist_ok=True)
    data_file = os.path.join(cfg.init.sft_dir, "task_data.txt")
    if world == 1 or dist.get_rank() == 0:
        write_task_corpus(cfg, data_file)
    if world > 1:
        dist.all_gather_object([None] * world, None)  # a barrier: the corpus is complete before anyone looks
        _all_see(lambda: os.path.exists(data_file), f"{data_file}, written by rank 0 for the supervised warm start",
                 f"init.sft_dir={cfg.init.sft_dir}")
    # context parallelism is the RL passes' (SFT runs cp = 1): the warm start spreads over dp = world / tp
    par = replace(cfg.parallel, cp=1, dp=-1) if cfg.parallel.cp > 1 else cfg.parallel
    sft = SFTConfig(model=cfg.model, parallel=par,
                    optim=type(cfg.optim)(lr=cfg.init.sft_lr, min_lr=cfg.init.sft_lr * 0.1, warmup_steps=20),
                    data=DataConfig(text_file=data_file, tokenizer=cfg.tokenizer, seq_len=cfg.init.sft_seq_len,
                                    micro_batch_size=cfg.init.sft_micro_batch_size),
                    train=TrainConfig(steps=cfg.init.sft_steps, seed=cfg.train.seed, out_dir=cfg.init.sft_dir,
                                      progress=cfg.train.progress, device=str(device.type), log_every=10))
    sft_train(sft, stop_request)
    if not _is_checkpoint(path):
        raise ckpt.CheckpointError(f"supervised warm start finished but wrote no checkpoint at {path}")
    return path


def ensure_teacher_checkpoint(cfg: RLConfig, tokenizer, device, stop_request=None) -> str:
    """The distillation teacher's checkpoint (`teacher.checkpoint`), built first when absent by this same
    supervised warm start with `teacher.sft_dir` / `teacher.model` / `teacher.sft_steps` / `teacher.sft_lr` /
    `teacher.sft_answer_noise` in place of the policy's `init` and `model` (rl/distill/config.py)."""
    t = cfg.teacher
    if t.sft_dir is None or t.checkpoint != os.path.join(t.sft_dir, "model"):
        return t.checkpoint  # a given checkpoint: loaded (and checked) as it is
    init = replace(cfg.init, checkpoint=None, sft_dir=t.sft_dir, sft_steps=t.sft_steps, sft_lr=t.sft_lr,
                   sft_answer_noise=t.sft_answer_noise)
    built = copy.copy(cfg)  # not dataclasses.replace: the run's config is resolved already, not re-checked
    built.init, built.model = init, t.model or cfg.model
    return ensure_start_checkpoint(built, tokenizer, device, stop_request)
