"""Supervised next-token training: `python -m core.sft --config configs/sft_tiny.yaml [key=value ...]`,
or the same under `torchrun --nproc_per_node N -m core.sft ...` (world size = dp * tp).

One step: `grad_accum` micro-batches per DP rank; the loss is the sum of per-token cross entropy
(vocab-parallel, computed inside forward through the `head=` callback so FSDP keeps the head weight
gathered) divided by the global number of target tokens, so the gradient summed over micro-steps
and DP ranks is that of the global mean. Then clip + AdamW (core/optim) and one line of
metrics.jsonl in `train.out_dir`.

Every check that can fail on a bad config or launch (unknown key, wrong type, tp not dividing the
heads, dp * tp != world size, data too short, ...) runs before any collective, on numbers every
rank has, so every rank raises the same error and none hangs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import yaml

from core.ckpt import (
    CheckpointError,
    load_model_weights,
    resume_train_checkpoint,
    save_model_weights,
    save_train_checkpoint,
)
from core.config import ConfigError, SFTConfig, load_config, to_dict
from core.data import DataError, SequenceLoader, tokenize_text_file
from core.metrics import MetricsWriter, PhaseTimer, ProgressBar, Throughput, peak_memory, reset_peak_memory
from core.model import build_model
from core.optim import OptimConfigError, build_optimizer, check_optim_config
from core.tokenizer import TokenizerError, load_tokenizer
from parallel.comm import all_reduce
from parallel.dims import LayoutError, ParallelDims, init_parallel, seed_everything, tp_subgroup
from parallel.fsdp import FSDPOptions, parallelize, set_gradient_sync, sync_replicated_grads
from parallel.layers import vocab_parallel_logits

# errors that mean "this config or launch cannot work": reported as one line, exit status 2
USER_ERRORS = (ConfigError, LayoutError, DataError, TokenizerError, OptimConfigError, CheckpointError)

# ---------------------------------------------------------------------------------------------
# checks (pure: no collective)


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_sft_config(cfg: SFTConfig, world_size: int) -> ParallelDims:
    """Raise a ConfigError/LayoutError naming the culprit if `cfg` cannot run on `world_size`
    ranks; return the layout. Pure arithmetic: safe before any collective."""
    m, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.train
    m.validate()
    check_optim_config(cfg.optim)
    if not isinstance(p.tp, int) or p.tp < 1:
        raise LayoutError(f"parallel.tp must be a positive integer, got {p.tp!r}")
    if p.dp == -1 and world_size % p.tp:
        raise LayoutError(f"parallel.tp={p.tp} does not divide the world size {world_size}")
    dims = ParallelDims(p.resolve_dp(world_size), p.tp).validate(world_size, m.n_heads, m.n_kv_heads)
    if m.intermediate_size % p.tp:
        raise LayoutError(f"parallel.tp={p.tp} must divide model.intermediate_size={m.intermediate_size}")
    FSDPOptions(mixed_precision=p.mixed_precision)  # validates the name
    for key, v in (("data.seq_len", d.seq_len), ("data.micro_batch_size", d.micro_batch_size),
                   ("data.grad_accum", d.grad_accum), ("train.steps", t.steps), ("train.log_every", t.log_every)):
        if v < 1:
            raise ConfigError(f"{key} must be positive, got {v}")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if t.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device must be auto, cpu or cuda, got {t.device!r}")
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but CUDA is not available")
    return dims


def _device(cfg: SFTConfig) -> torch.device:
    if cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


# ---------------------------------------------------------------------------------------------
# the loop


def cross_entropy_head(targets: torch.Tensor, tp_group, vocab_size: int):
    """A `head=` callback: (hidden [B,S,H] replicated, weight_local [Vp/tp,H]) -> loss per token [B,S]."""
    from parallel.vocab import vocab_parallel_cross_entropy

    def head(hidden, weight_local):
        logits_local = vocab_parallel_logits(hidden, weight_local, tp_group)  # [B, S, Vp/tp]
        return vocab_parallel_cross_entropy(logits_local, targets, tp_group, vocab_size=vocab_size)
    return head


def train(cfg: SFTConfig) -> dict:
    """Run SFT as `cfg` says; usable in-process (e.g. tests) or from `main`. Returns
    {"losses": [...], "grad_norms": [...], "skipped_total": int, "out_dir": str, "saved": path | None}."""
    dims = check_sft_config(cfg, _world_size())
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} pieces ({tokenizer.path})")
    tokens = tokenize_text_file(cfg.data.text_file, tokenizer)
    SequenceLoader(tokens, cfg.data.seq_len, cfg.data.micro_batch_size, cfg.train.seed, 0, dims.dp)  # checks size

    device = _device(cfg)
    state = init_parallel(dims, device, cfg.model.n_heads, cfg.model.n_kv_heads)
    seed_everything(cfg.train.seed)
    m = cfg.model
    kv_group = tp_subgroup(state, dims.tp // m.n_kv_heads) if dims.tp > m.n_kv_heads else None
    model = build_model(m, state.tp_group, kv_group, seed=None if cfg.init_checkpoint else cfg.train.seed,
                        device=device)
    if cfg.init_checkpoint:
        load_model_weights(model, cfg.init_checkpoint, state, tokenizer_fingerprint=tokenizer.fingerprint)
    p = cfg.parallel
    opts = FSDPOptions(fsdp=p.fsdp, mixed_precision=p.mixed_precision,
                       activation_checkpointing=p.activation_checkpointing, cpu_offload=p.cpu_offload)
    model = parallelize(model, state.dp_mesh, opts)
    model.train()
    model.set_mixed_precision(p.mixed_precision)  # bf16: autocast over the fp32 master weights
    if cfg.train.compile:
        model.compile_blocks()
    opt = build_optimizer(model, cfg.optim, m, cfg.train.steps, state.tp_group, state.dp_group)
    loader = SequenceLoader(tokens, cfg.data.seq_len, cfg.data.micro_batch_size, cfg.train.seed,
                            state.dp_rank, dims.dp)

    out_dir = cfg.train.out_dir
    ckpt_root = os.path.join(out_dir, "checkpoints")
    first = 1
    extra = (resume_train_checkpoint(ckpt_root, state, {"policy": (model, opt)}, verify=cfg.train.verify_checkpoints)
             if cfg.train.resume else None)
    if extra is not None:  # resume: weights, AdamW state, schedule, RNG and data position
        loader.load_state_dict(extra["data"])
        first = extra["step"] + 1
    if state.is_main:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    writer = MetricsWriter(os.path.join(out_dir, "metrics.jsonl"), enabled=state.is_main,
                           mode="a" if first > 1 else "w")
    bar = ProgressBar(cfg.train.steps, enabled=state.is_main and cfg.train.progress,
                      every=max(cfg.train.log_every, cfg.train.steps // 20))
    timer, meter = PhaseTimer(device), Throughput()
    reset_peak_memory(device)
    losses, norms = [], []
    step = first - 1
    for step in range(first, cfg.train.steps + 1):
        with timer("data"):
            batches = [next(loader) for _ in range(cfg.data.grad_accum)]
            n_tokens = torch.tensor([float(sum(b.targets.numel() for b in batches))], device=device)
            # every dp rank's target count: the loss is normalised by the global total
            all_reduce(n_tokens, "sum", state.dp_group)
        loss_sum = torch.zeros(1, device=device)
        with timer("forward_backward"):
            for i, b in enumerate(batches):
                set_gradient_sync(model, i == len(batches) - 1)
                targets = b.targets.to(device)
                loss_tok = model(b.input_ids.to(device), head=cross_entropy_head(targets, state.tp_group,
                                                                                 m.vocab_size))
                loss = loss_tok.float().sum() / n_tokens
                loss.backward()
                loss_sum += loss.detach()
            sync_replicated_grads(model, state.dp_group)
        with timer("optim"):
            stats = opt.step()
        # each dp rank holds its share of the global mean; the sum is the global mean loss
        all_reduce(loss_sum, "sum", state.dp_group)
        loss_v = float(loss_sum)
        losses.append(loss_v)
        norms.append(stats.grad_norm)
        tps = meter.update(int(n_tokens.item()))
        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            writer.write({"step": step, "loss": loss_v, "grad_norm": stats.grad_norm, "lr": stats.lr,
                          "skipped": stats.skipped, "skipped_total": stats.skipped_total,
                          "tokens": int(n_tokens.item()), "tokens_per_s": tps, **peak_memory(device),
                          **timer.pop()})
        bar.update(step, loss=loss_v, lr=stats.lr, gnorm=stats.grad_norm, tok_s=tps)
        stop = cfg.train.stop_after is not None and step >= cfg.train.stop_after
        if (cfg.train.save_every and step % cfg.train.save_every == 0) or stop:
            save_train_checkpoint(ckpt_root, step, state, {"policy": (model, opt)},
                                  extra={"data": loader.state_dict()}, keep_last=cfg.train.keep_last,
                                  tokenizer_fingerprint=tokenizer.fingerprint)
        if stop:
            break
    writer.close()
    if step < cfg.train.steps:  # stopped early: the train checkpoint is the state to resume from
        return {"losses": losses, "grad_norms": norms, "skipped_total": opt.skipped_total, "out_dir": out_dir,
                "saved": None}
    saved = save_model_weights(model, os.path.join(out_dir, "model"), state,
                               tokenizer_fingerprint=tokenizer.fingerprint, step=cfg.train.steps)
    return {"losses": losses, "grad_norms": norms, "skipped_total": opt.skipped_total, "out_dir": out_dir,
            "saved": saved}


# ---------------------------------------------------------------------------------------------
# command line


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m core.sft", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="YAML file with SFTConfig sections")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.steps=10")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    owns_group = not (dist.is_available() and dist.is_initialized())
    try:
        cfg = load_config(SFTConfig, args.config, args.overrides)
        summary = train(cfg)
    except USER_ERRORS as e:
        rank = os.environ.get("RANK", "0")
        print(f"kltron.sft: error (rank {rank}): {e}", file=sys.stderr)
        return 2
    finally:
        if owns_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if summary["losses"]:
        print(f"kltron.sft: done, {len(summary['losses'])} steps, loss {summary['losses'][0]:.4f} -> "
              f"{summary['losses'][-1]:.4f}, metrics in {summary['out_dir']}/metrics.jsonl", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
