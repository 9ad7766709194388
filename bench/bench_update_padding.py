"""What padding costs the update, on a batch with skewed response lengths: today's row-count
micro-batches (padded to the batch's longest row), token-budget micro-batches (rows sorted by
length, each micro-batch trimmed to its longest row), packed sequences (rows concatenated,
block-diagonal causal attention) and the shared-prompt layout under a token budget (each prompt
group once, its responses after it, [R, W] with R x W <= the budget; rl/update/shared_layout.py), side by
side in one run. One process (tp = dp = 1), fp32.

    python -m bench.bench_update_padding [--rows 256] [--short 4] [--long 64] [--long-share 0.1]
        [--micro-rows 32] [--tokens 2560] [--pack-tokens 512] [--shared-tokens 2560] [--repeats 3]
        [--threads 1] [--device cpu] [--json OUT]

The batch: `--rows` rollouts in GRPO groups of 8 rows with one prompt each (8..`--prompt` real
tokens, left-padded), responses of `--short` tokens except a random `--long-share` of `--long`
tokens; random token ids, old log-probs from the policy itself (so ratios are 1), a k3+ KL to the
reference in the loss and random group advantages. One update = 1 epoch x 1 mini-batch (one
optimizer step) of RLTrainer.update. Every mode starts from the same weights.

Reported per mode: micro-batches, tokens through the model (rows x width summed over the
micro-batches the update runs: the real tokens for packing, R x W for the shared layout;
deterministic, unlike the times on a shared machine), the largest micro-batch's tokens, update time
(median of `--repeats` after one warm-up), peak memory of an update (CPU: tensor bytes tracked by
torch.distributed._tools.mem_tracker.MemTracker above the model, its optimizer state and the batch;
CUDA: max_memory_allocated above what was allocated before), the update's CPU seconds (this
process, all threads: less disturbed than wall time on a shared machine), ratios to padding, and
the largest parameter difference to padding after the warm-up update (float rounding only: every
mode computes the same loss).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

from core.config import ModelConfig, load_config
from core.model import build_model
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel
from rl.config import RLConfig
from rl.experience.rollout import Rollout
from rl.objectives.advantages import broadcast_to_tokens
from rl.train import assemble
from rl.update.logprobs import policy_token_stats
from rl.update.step_data import StepData

G = 8  # samples per prompt


def _config(args, mode: list[str]) -> RLConfig:
    return load_config(RLConfig, None, [
        f"rollout.prompts_per_step={args.rows // G}", f"rollout.group_size={G}",
        f"rollout.max_new_tokens={args.long}", "algo.name=grpo", "algo.epochs=1", "algo.mini_batches=1",
        "kl.estimator=k3+", "kl.where=loss", "kl_ctl.beta=0.02", "optim.lr=1e-4", "optim.warmup_steps=0",
        "train.progress=false", "train.steps=100", f"algo.kl_chunk_size={args.kl_chunk}"] + mode)


def build(args, mode: list[str]):
    mc = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, n_layers=args.layers, n_heads=args.heads,
                     n_kv_heads=args.heads // 2, intermediate_size=args.hidden * 11 // 4,
                     max_seq_len=args.prompt + args.long)
    state = init_parallel(ParallelDims(1, 1), args.device, mc.n_heads, mc.n_kv_heads)
    policy = build_model(mc, seed=11, device=state.device)
    ref = build_model(mc, seed=11, device=state.device)
    return assemble(_config(args, mode), state, mc, load_tokenizer(None), policy, ref)


def skewed_batch(args, trainer) -> StepData:
    """The synthetic step: prompts, skewed responses, old/ref log-probs from the policy, advantages."""
    g = torch.Generator().manual_seed(0)
    B, P, N, dev = args.rows, args.prompt, args.long, trainer.state.device
    p = torch.randint(8, P + 1, (B // G,), generator=g, device="cpu").repeat_interleave(G)  # one prompt per group
    n = torch.full((B,), args.short, dtype=torch.long, device="cpu")
    n[torch.randperm(B, generator=g, device="cpu")[:round(B * args.long_share)]] = args.long
    col = torch.arange(P + N, device="cpu")
    am = ((col >= P - p[:, None]) & (col < P + n[:, None])).long()
    # ids the trainer reads: the model's vocabulary capped at the tokenizer's (RLTrainer.vocab)
    seq = torch.randint(3, trainer.vocab, (B, P + N), generator=g, device="cpu")
    seq[:, :P] = seq[::G, :P].repeat_interleave(G, 0)  # the group's prompt tokens on each of its rows
    seq = seq * am
    rm = am[:, P:].bool()
    ro = Rollout(seq.to(dev), am.to(dev), rm.to(dev), P, torch.zeros(B, device=dev), torch.arange(B, device=dev),
                 [], [])
    with torch.no_grad():
        old = policy_token_stats(trainer.policy, ro.sequences, ro.attention_mask, P, vocab_size=trainer.vocab,
                                 chunk_size=args.kl_chunk, entropy=False, mask=ro.response_mask).logprobs
    adv = broadcast_to_tokens(torch.randn(B, generator=g, device="cpu").to(dev), ro.response_mask)
    zero = torch.zeros_like(old)
    return StepData(ro, ro.response_mask, old, old.clone(), None, None, zero, zero, adv)


def plan_stats(trainer, data) -> tuple[int, int, int]:
    """(micro-batches, tokens through the model, the largest micro-batch's tokens) of the one
    mini-batch, as the trainer plans it."""
    rows = torch.arange(data.mask.shape[0], device=data.mask.device)
    tokens = [m.packed.input_ids.numel() if m.packed is not None else m.rows.numel() * (m.prompt_cols +
              m.response_cols) for m in trainer.updater._micro_batches(data, rows)]
    return len(tokens), sum(tokens), max(tokens)


def peak_update(trainer, data) -> int:
    """Peak bytes of one update above the model, optimizer state and batch (see the docstring)."""
    dev = torch.device(trainer.state.device)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        trainer.update(data, 1)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - before
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    tensors = [t for t in (data.ro.sequences, data.ro.attention_mask, data.mask, data.old_logp, data.ref_logp,
                           data.kl, data.advantages)]
    mt.track_external(trainer.policy, trainer.opt.opt, *tensors)
    real = trainer.updater._micro_step

    def micro_step(*a, **k):  # MemTracker refuses a second forward of a module without this (the peak is kept)
        mt.reset_mod_stats()
        return real(*a, **k)

    trainer.updater._micro_step = micro_step
    try:
        with mt:
            base = sum(d["Total"] for d in mt.get_tracker_snapshot("current").values())
            trainer.update(data, 1)
        return sum(d["Total"] for d in mt.get_tracker_snapshot("peak").values()) - base
    finally:
        del trainer.updater._micro_step


def timed_update(trainer, data, step: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all its threads) of one update."""
    dev = torch.device(trainer.state.device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.update(data, step)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0, time.process_time() - c0


def run(args, log=print) -> list[dict]:
    modes = [("padding", [f"algo.micro_batch_size={args.micro_rows}", "algo.share_prompts=false"]),
             ("token budget", [f"algo.micro_batch_tokens={args.tokens}", "algo.share_prompts=false"]),
             ("packed", [f"algo.micro_batch_tokens={args.pack_tokens}", "algo.pack_sequences=true",
                         "algo.share_prompts=false"]),
             ("shared, token budget", [f"algo.micro_batch_tokens={args.shared_tokens}", "algo.share_prompts=true"])]
    rows, first = [], None
    for name, mode in modes:
        tr = build(args, mode)
        data = skewed_batch(args, tr)
        n_mb, tokens, widest = plan_stats(tr, data)
        timed_update(tr, data, 0)  # warm-up; its result is compared across modes
        params = [p.detach().clone() for p in tr.policy.parameters()]
        first = first or params
        diff = max(float((a - b).abs().max()) for a, b in zip(first, params))
        times, cpu = zip(*[timed_update(tr, data, s + 1) for s in range(args.repeats)])
        peak = peak_update(tr, data)
        row = {"mode": name, "setting": " ".join(mode), "micro_batches": n_mb, "model_tokens": tokens,
               "max_micro_tokens": widest, "token_ids": tr.vocab,
               "real_tokens": int(data.ro.attention_mask.sum()), "update_s": statistics.median(times),
               "update_cpu_s": statistics.median(cpu),
               "peak_bytes": peak, "max_param_diff_vs_padding": diff}
        rows.append(row)
        log(f"  {name}: {n_mb} micro-batches, {tokens} tokens, {row['update_s']:.3f} s, "
            f"{peak / 2**20:.1f} MiB")
    for r in rows:
        r["time_ratio"] = r["update_s"] / rows[0]["update_s"]
        r["cpu_ratio"] = r["update_cpu_s"] / rows[0]["update_cpu_s"]
        r["memory_ratio"] = r["peak_bytes"] / rows[0]["peak_bytes"]
    return rows


def table(rows: list[dict], args, command: str, load: tuple) -> str:
    out = [f"`{command}`", "",
           f"{args.rows} rows: prompts 8..{args.prompt} tokens, responses {args.short} tokens "
           f"({1 - args.long_share:.0%}) or {args.long} ({args.long_share:.0%}); model hidden {args.hidden}, "
           f"{args.layers} layers, vocab {args.vocab} (token ids < {rows[0]['token_ids']}, the tokenizer's); fp32, "
           f"{args.device}, {torch.get_num_threads()} threads; "
           f"median of {args.repeats} updates after 1 warm-up; load average {load[0]:.2f} -> {load[1]:.2f} "
           f"({os.cpu_count()} CPUs)", "",
           "| mode | setting | micro-batches | tokens through the model (real) | largest micro-batch | update s | "
           "x padding | update CPU s | x padding | peak MiB | x padding | max abs param diff vs padding |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['mode']} | `{r['setting']}` | {r['micro_batches']} | {r['model_tokens']} "
                   f"({r['real_tokens']}) | {r['max_micro_tokens']} | {r['update_s']:.3f} | {r['time_ratio']:.2f} | "
                   f"{r['update_cpu_s']:.3f} | {r['cpu_ratio']:.2f} | "
                   f"{r['peak_bytes'] / 2**20:.1f} | {r['memory_ratio']:.2f} | {r['max_param_diff_vs_padding']:.1e} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=16, help="longest prompt (real tokens); shortest is 8")
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--long", type=int, default=64)
    ap.add_argument("--long-share", type=float, default=0.1)
    ap.add_argument("--micro-rows", type=int, default=32, help="padding: rows per micro-batch")
    ap.add_argument("--tokens", type=int, default=2560, help="token budget per micro-batch (default: 32 x 80)")
    ap.add_argument("--pack-tokens", type=int, default=512, help="tokens per packed sequence")
    ap.add_argument("--shared-tokens", type=int, default=2560,
                    help="token budget (R x W) per micro-batch of the shared-prompt layout")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--kl-chunk", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared machine, idle OpenMP threads spin and skew the timings)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rows % G:
        ap.error(f"--rows must be a multiple of {G} (GRPO groups)")
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    rows = run(args)
    command = "python -m bench.bench_update_padding " + " ".join(argv if argv is not None else sys.argv[1:])
    print(table(rows, args, command.strip(), (load0, os.getloadavg()[0])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
