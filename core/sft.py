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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.ckpt import CheckpointError, load_model_weights, save_model_weights
from core.config import ConfigError, SFTConfig, check_train, load_config
from core.model import build_model
from core.optim import OptimConfigError, build_optimizer, check_optim_config
from core.runtime.lifecycle import PREEMPTED_EXIT, Preempted, RankMismatchError, StopRequest, exit_process, shutdown
from core.runtime.metrics import PhaseTimer, ProgressBar, Throughput, peak_memory, reset_peak_memory
from core.runtime.run import Run, saving, start_run
from core.sft_data import DataError, SequenceLoader, tokenize_text_file
from core.tokenizer import TokenizerError, load_tokenizer
from parallel.comm import all_reduce
from parallel.dims import LayoutError, ParallelDims, launch_world_size
from parallel.fsdp import FSDPOptions, parallelize, set_gradient_sync, sync_replicated_grads
from parallel.layers import vocab_parallel_logits
from parallel.vocab import vocab_parallel_cross_entropy

# errors that mean "this config or launch cannot work": reported as one line, exit status 2
USER_ERRORS = (ConfigError, LayoutError, DataError, TokenizerError, OptimConfigError, CheckpointError,
               RankMismatchError)

# ---------------------------------------------------------------------------------------------
# checks (pure: no collective)


def check_sft_config(cfg: SFTConfig, world_size: int) -> ParallelDims:
    """Raise a ConfigError/LayoutError naming the culprit if `cfg` cannot run on `world_size`
    ranks; return the layout. Pure arithmetic: safe before any collective."""
    m, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.train
    m.validate()
    check_optim_config(cfg.optim)
    check_train(t)
    if p.cp != 1:
        raise LayoutError(f"parallel.cp={p.cp}: context parallelism runs the RL passes (python -m rl.train); "
                          "supervised fine-tuning runs with parallel.cp=1")
    dims = ParallelDims(p.resolve_dp(world_size), p.tp).validate(world_size, m.n_heads, m.n_kv_heads)
    if m.intermediate_size % p.tp:
        raise LayoutError(f"parallel.tp={p.tp} must divide model.intermediate_size={m.intermediate_size}")
    FSDPOptions(mixed_precision=p.precision("cpu"))  # validates the name
    for key, v in (("data.seq_len", d.seq_len), ("data.micro_batch_size", d.micro_batch_size),
                   ("data.grad_accum", d.grad_accum)):
        if v < 1:
            raise ConfigError(f"{key} must be positive, got {v}")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    return dims


# ---------------------------------------------------------------------------------------------
# build


def cross_entropy_head(targets: torch.Tensor, tp_group, vocab_size: int):
    """A `head=` callback: (hidden [B,S,H] replicated, weight_local [Vp/tp,H]) -> loss per token [B,S]."""

    def head(hidden, weight_local):
        logits_local = vocab_parallel_logits(hidden, weight_local, tp_group)  # [B, S, Vp/tp]
        return vocab_parallel_cross_entropy(logits_local, targets, tp_group, vocab_size=vocab_size)
    return head


@dataclass
class SFTJob:
    """What the loop needs: the run (groups, device, out_dir, metrics), the FSDP-wrapped model, its
    optimizer, this DP rank's loader and the tokenizer. (bf16 compute is the model's own setting:
    `Transformer.set_mixed_precision`.)"""

    run: Run
    model: torch.nn.Module
    opt: object
    loader: SequenceLoader
    tokenizer: object

    def modules(self) -> dict:
        return {"policy": (self.model, self.opt)}


def _load_tokens(cfg: SFTConfig, dp: int):
    """The tokenizer and the token stream, checked against the model and the layout (no collective)."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} pieces ({tokenizer.path})")
    tokens = tokenize_text_file(cfg.data.text_file, tokenizer)
    SequenceLoader(tokens, cfg.data.seq_len, cfg.data.micro_batch_size, cfg.train.seed, 0, dp)  # checks size
    return tokenizer, tokens


def build(cfg: SFTConfig) -> SFTJob:
    """Check everything that can fail, then set up the run, the model (seeded, or from
    `init_checkpoint`), FSDP, the optimizer and the loader."""
    dims = check_sft_config(cfg, launch_world_size())
    tokenizer, tokens = _load_tokens(cfg, dims.dp)
    m, p = cfg.model, cfg.parallel
    run = start_run(cfg, dims, m)
    state = run.state
    model = build_model(m, state.tp_group, run.kv_group, seed=None if cfg.init_checkpoint else cfg.train.seed,
                        device=run.device)
    if cfg.init_checkpoint:
        load_model_weights(model, cfg.init_checkpoint, state, tokenizer_fingerprint=tokenizer.fingerprint,
                           verify=cfg.train.verify_checkpoints)
    mp = p.precision(run.device.type)
    opts = FSDPOptions(fsdp=p.fsdp, mixed_precision=mp,
                       activation_checkpointing=p.activation_checkpointing, cpu_offload=p.cpu_offload)
    model = parallelize(model, state.dp_mesh, opts)
    model.sequence_parallel = cfg.parallel.sequence_parallel  # core/seq_parallel.py
    model.train()
    model.set_mixed_precision(mp)  # bf16: autocast over the fp32 master weights
    if cfg.train.compile:
        model.compile_blocks()
    opt = build_optimizer(model, cfg.optim, m, cfg.train.steps, state.tp_group, state.dp_group)
    loader = SequenceLoader(tokens, cfg.data.seq_len, cfg.data.micro_batch_size, cfg.train.seed,
                            state.dp_rank, dims.dp)
    return SFTJob(run, model, opt, loader, tokenizer)


# ---------------------------------------------------------------------------------------------
# the loop


def train_step(job: SFTJob, cfg: SFTConfig, timer: PhaseTimer) -> tuple[float, int, object]:
    """One optimizer step over `grad_accum` micro-batches -> (global mean loss, global target
    tokens, the optimizer's StepStats)."""
    state, device, model = job.run.state, job.run.device, job.model
    with timer("data"):
        batches = [next(job.loader) for _ in range(cfg.data.grad_accum)]
        n_tokens = torch.tensor([float(sum(b.targets.numel() for b in batches))], device=device)
        # every dp rank's target count: the loss is normalised by the global total
        all_reduce(n_tokens, "sum", state.dp_group)
    loss_sum = torch.zeros(1, device=device)
    with timer("forward_backward"):
        for i, b in enumerate(batches):
            set_gradient_sync(model, i == len(batches) - 1)
            targets = b.targets.to(device)
            loss_tok = model(b.input_ids.to(device), head=cross_entropy_head(targets, state.tp_group,
                                                                             cfg.model.vocab_size))
            loss = loss_tok.float().sum() / n_tokens
            loss.backward()
            loss_sum += loss.detach()
        sync_replicated_grads(model, state.dp_group)
    with timer("optim"):
        stats = job.opt.step()
    # each dp rank holds its share of the global mean; the sum is the global mean loss
    all_reduce(loss_sum, "sum", state.dp_group)
    return float(loss_sum), int(n_tokens.item()), stats


def train(cfg: SFTConfig, stop_request: StopRequest | None = None) -> dict:
    """Run SFT as `cfg` says; usable in-process (e.g. tests) or from `main`. Returns
    {"losses": [...], "grad_norms": [...], "skipped_total": int, "out_dir": str, "saved": path | None}."""
    job = build(cfg)
    run, t = job.run, cfg.train
    extra = run.resume(job.modules())  # weights, AdamW state, schedule, RNG and data position
    if extra is not None:
        job.loader.load_state_dict(extra["data"])
    first = 1 if extra is None else extra["step"] + 1
    if run.finished(t.steps, "sft"):  # else, at the last step without a verified model, the loop writes it
        run.close()
        return {"losses": [], "grad_norms": [], "skipped_total": job.opt.skipped_total, "out_dir": run.out_dir,
                "saved": None}
    writer = run.open_outputs(cfg)
    bar = ProgressBar(t.steps, enabled=run.state.is_main and t.progress, every=max(t.log_every, t.steps // 20))
    timer, meter = PhaseTimer(run.device), Throughput()
    reset_peak_memory(run.device)
    losses, norms = [], []
    step, preempted = first - 1, False
    for step in range(first, t.steps + 1):
        loss, n_tokens, stats = train_step(job, cfg, timer)
        losses.append(loss)
        norms.append(stats.grad_norm)
        tps = meter.update(n_tokens)
        if step % t.log_every == 0 or step == t.steps:
            with saving(f"the metrics of step {step}"):  # a full disk: the file and the step named
                writer.write({"step": step, "loss": loss, "grad_norm": stats.grad_norm, "lr": stats.lr,
                              "skipped": stats.skipped, "skipped_total": stats.skipped_total, "tokens": n_tokens,
                              "tokens_per_s": tps, **peak_memory(run.device), **timer.pop()})
        bar.update(step, loss=loss, lr=stats.lr, gnorm=stats.grad_norm, tok_s=tps)
        preempted = stop_request is not None and stop_request.agree(run.device)  # every rank stops together
        stop = (t.stop_after is not None and step >= t.stop_after) or preempted
        if (t.save_every and step % t.save_every == 0) or stop:
            run.save(step, job.modules(), {"data": job.loader.state_dict()}, job.tokenizer.fingerprint)
        if stop:
            break
    run.close()
    if preempted:
        raise Preempted(f"kltron.sft: stop requested by signal {stop_request.signum or 'on another rank'}; saved "
                        f"the checkpoint of step {step} in {run.ckpt_root}; run the same command to resume")
    saved = None  # stopped early (train.stop_after): the train checkpoint is the state to resume from
    if step >= t.steps:
        saved = save_model_weights(job.model, os.path.join(run.out_dir, "model"), run.state,
                                   tokenizer_fingerprint=job.tokenizer.fingerprint, step=t.steps)
    return {"losses": losses, "grad_norms": norms, "skipped_total": job.opt.skipped_total, "out_dir": run.out_dir,
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
    ok, stop_request = False, StopRequest().install()
    try:
        cfg = load_config(SFTConfig, args.config, args.overrides)
        summary = train(cfg, stop_request)
        ok = True
    except Preempted as e:
        print(e, file=sys.stderr)
        ok = True
        return PREEMPTED_EXIT
    except USER_ERRORS as e:
        rank = os.environ.get("RANK", "0")
        print(f"kltron.sft: error (rank {rank}): {e}", file=sys.stderr)
        return 2
    finally:
        stop_request.uninstall()
        if owns_group:
            shutdown(barrier=ok)  # on success every rank meets before any tears down
    if summary["losses"]:
        print(f"kltron.sft: done, {len(summary['losses'])} steps, loss {summary['losses'][0]:.4f} -> "
              f"{summary['losses'][-1]:.4f}, metrics in {summary['out_dir']}/metrics.jsonl", file=sys.stderr)
    return 0


if __name__ == "__main__":
    exit_process(main())
