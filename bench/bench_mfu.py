"""Training throughput and MFU of a ~1B Llama (the Llama-3.2-1B shape) in bf16 with FSDP2.

    torchrun --nproc_per_node N -m bench.bench_mfu [--tp 1] [--seq 2048] [--mb 4] [--steps 10] [--ac]
    python -m bench.bench_mfu --cpu        # CPU fallback: a tiny model, 3 steps (checks the path only)

One step = forward + backward (loss from kltron's vocab-parallel cross entropy inside forward) +
clip + AdamW, on random tokens; the first `--warmup` steps are not timed. With dp > 1 the model is
FSDP2-sharded with bf16 params and fp32 reduction; with dp = 1 FSDP is skipped and the step runs
under bf16 autocast over fp32 weights (what core.sft does).

MFU = achieved model FLOP/s / peak dense bf16 FLOP/s of one GPU, per GPU, with model FLOPs per
token = 6 * (parameters in matmuls, incl. the LM head) + 12 * n_layers * hidden * seq (attention
scores and values; causal masking not discounted, as in the PaLM / Megatron convention). Peak:
989 TFLOP/s for H100/H200, 312 for A100, else --peak-tflops (or MFU is not reported).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch
import torch.distributed as dist

from core.config import ModelConfig, OptimConfig
from core.model import build_model
from core.optim import build_optimizer
from core.sft import cross_entropy_head
from parallel.comm import all_reduce
from parallel.dims import ParallelDims, init_parallel, kv_replica_group, launch_world_size, resolve_device
from parallel.fsdp import FSDPOptions, is_fsdp, parallelize

LLAMA_1B = ModelConfig(vocab_size=128256, hidden_size=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                       intermediate_size=8192, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True)
TINY = ModelConfig(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=176,
                   max_seq_len=128)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}


def flops_per_token(cfg: ModelConfig, seq: int) -> float:
    H, L, hd = cfg.hidden_size, cfg.n_layers, cfg.head_dim
    per_layer = H * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * H * cfg.intermediate_size
    matmul_params = L * per_layer + cfg.vocab_size * H  # the LM head is a matmul; the embedding is not
    return 6 * matmul_params + 12 * L * H * seq


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny model on CPU (checks the code path)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mb", type=int, default=4, help="sequences per DP rank per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def time_steps(step, args, device, cuda: bool) -> tuple[float, float]:
    """`args.warmup` untimed steps, then the mean seconds of `args.steps` -> (seconds, last loss)."""
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / args.steps, loss


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    cfg = LLAMA_1B if cuda else TINY
    if not cuda:
        args.seq, args.mb, args.steps, args.warmup = 64, 2, 3, 1
        torch.set_num_threads(1)  # tiny matmuls: threads only contend
    device = resolve_device("cuda" if cuda else "cpu")
    dims = ParallelDims(launch_world_size() // args.tp, args.tp)
    state = init_parallel(dims, device, cfg.n_heads, cfg.n_kv_heads)
    kv_group = kv_replica_group(state, cfg.n_kv_heads)
    model = build_model(cfg, state.tp_group, kv_group, seed=0, device=device)
    model = parallelize(model, state.dp_mesh, FSDPOptions(mixed_precision="bf16" if cuda else "fp32",
                                                          activation_checkpointing=args.ac))
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda and not is_fsdp(model)
                else contextlib.nullcontext())
    opt = build_optimizer(model, OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant"), cfg,
                          args.steps + args.warmup, state.tp_group, state.dp_group)
    g = torch.Generator().manual_seed(1 + state.dp_rank)  # each DP rank its own tokens, same over TP
    n_global_tokens = dims.dp * args.mb * args.seq

    def step() -> float:
        ids = torch.randint(0, cfg.vocab_size, (args.mb, args.seq + 1), generator=g).to(device)
        with autocast:
            loss_tok = model(ids[:, :-1], head=cross_entropy_head(ids[:, 1:], state.tp_group, cfg.vocab_size))
        loss = loss_tok.float().sum() / n_global_tokens
        loss.backward()
        opt.step()
        total = loss.detach().reshape(1)
        all_reduce(total, "sum", state.dp_group)  # each DP rank holds its share of the global mean
        return float(total)

    dt, loss = time_steps(step, args, device, cuda)
    tokens_per_s = n_global_tokens / dt
    per_gpu = tokens_per_s / dims.world_size
    peak = peak_flops(device, args.peak_tflops)
    mfu = per_gpu * flops_per_token(cfg, args.seq) / peak if peak else None
    n_params = sum(p.numel() for p in model.parameters())  # local shards
    res = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "world": dims.world_size,
           "dp": dims.dp, "tp": dims.tp, "fsdp": is_fsdp(model), "ac": args.ac, "seq": args.seq, "mb": args.mb,
           "step_s": dt, "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": per_gpu, "mfu": mfu, "loss": loss,
           "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
           "local_params": n_params}
    if state.is_main:
        mfu_s = f"{100 * mfu:.1f}%" if mfu is not None else "n/a (no GPU peak known)"
        print(f"bench_mfu: {res['device']} x{dims.world_size} dp={dims.dp} tp={dims.tp} fsdp={res['fsdp']} "
              f"ac={args.ac} seq={args.seq} mb={args.mb}: {dt * 1e3:.0f} ms/step, {tokens_per_s:,.0f} tok/s "
              f"({per_gpu:,.0f}/GPU), MFU {mfu_s}, loss {loss:.3f}"
              + (f", peak {res['peak_mem_gib']:.1f} GiB" if cuda else ""), file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
