"""The policy's starting checkpoint: use `init.checkpoint`, or build `{init.sft_dir}/final` by
supervised training on the task's own examples when it is absent (the README's default job).

Every rank runs this; the decision depends only on files every rank sees (a shared file system
on multi-node runs), and SFT itself is the ordinary distributed `core.sft.train`.
"""

from __future__ import annotations

import os
import random

import core.ckpt as ckpt
from core.config import ConfigError, DataConfig, SFTConfig, TrainConfig
from core.sft import train as sft_train
from rl.config import RLConfig
from rl.experience.rewards import build_reward
from rl.experience.tasks import sft_text

DATA_WAIT_S = 120.0  # how long ranks > 0 wait for rank 0's task corpus (no process group exists yet)


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


def ensure_start_checkpoint(cfg: RLConfig, tokenizer, device, stop_request=None) -> str:
    """`init.start_checkpoint`, built first by SFT when absent. A SIGTERM / SIGUSR1 caught by `stop_request`
    stops the SFT at its next step with its checkpoint (core.runtime.lifecycle.Preempted); the same command
    resumes it."""
    path = cfg.init.start_checkpoint
    if _is_checkpoint(path):
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
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        write_task_corpus(cfg, data_file)
    else:  # the other ranks wait for rank 0's file (no process group exists yet)
        import time

        deadline = time.monotonic() + DATA_WAIT_S
        while not os.path.exists(data_file):
            if time.monotonic() > deadline:
                raise ckpt.CheckpointError(
                    f"rank {rank}: {data_file}, written by rank 0 for the supervised warm start, did not appear in "
                    f"{DATA_WAIT_S:g} s: init.sft_dir={cfg.init.sft_dir} must be on a file system every rank sees "
                    "(or set init.checkpoint to a checkpoint every rank sees)")
            time.sleep(0.2)
    sft = SFTConfig(model=cfg.model, parallel=cfg.parallel,
                    optim=type(cfg.optim)(lr=cfg.init.sft_lr, min_lr=cfg.init.sft_lr * 0.1, warmup_steps=20),
                    data=DataConfig(text_file=data_file, tokenizer=cfg.tokenizer, seq_len=cfg.init.sft_seq_len,
                                    micro_batch_size=cfg.init.sft_micro_batch_size),
                    train=TrainConfig(steps=cfg.init.sft_steps, seed=cfg.train.seed, out_dir=cfg.init.sft_dir,
                                      progress=cfg.train.progress, device=str(device.type), log_every=10))
    sft_train(sft, stop_request)
    if not _is_checkpoint(path):
        raise ckpt.CheckpointError(f"supervised warm start finished but wrote no checkpoint at {path}")
    return path
