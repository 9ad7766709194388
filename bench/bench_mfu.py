"""Training throughput and MFU of a ~1B Llama (the Llama-3.2-1B shape) in bf16 with FSDP2.

    torchrun --nproc_per_node N -m bench.bench_mfu [--tp 1] [--seq 2048] [--mb 4] [--steps 10] [--ac] [--compile]
    python -m bench.bench_mfu --cpu [--model tiny|mid] [--compile] [--dtype fp32|bf16]   # CPU: path check / timing

`--compile` torch.compiles each transformer block (core.model.Transformer.compile_blocks);
`compile_s` is the wall time of the warm-up steps (compilation happens there), `step_s` the mean
of the timed steps after it.

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
import json
import os
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
MID = ModelConfig(vocab_size=4096, hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=4, intermediate_size=704,
                  max_seq_len=256)  # ~5M parameters: a CPU-sized stand-in where compile can pay off
MODELS = {"tiny": TINY, "mid": MID, "1b": LLAMA_1B}
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (default model: tiny)")
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="default: 1b on GPU, tiny on CPU")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="default 2048 (GPU), 64 (CPU)")
    ap.add_argument("--mb", type=int, default=None, help="sequences per DP rank per step; default 4 (GPU), 2 (CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps; default 10 (GPU), 3 (CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps; default 3 (GPU), 1 (CPU)")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    for k, gpu, cpu in (("model", "1b", "tiny"), ("dtype", "bf16", "fp32"), ("seq", 2048, 64), ("mb", 4, 2),
                        ("steps", 10, 3), ("warmup", 3, 1)):
        if getattr(args, k) is None:
            setattr(args, k, gpu if cuda else cpu)
    return args, cuda


def _build(args, cfg, state, device):
    kv_group = kv_replica_group(state, cfg.n_kv_heads)
    model = build_model(cfg, state.tp_group, kv_group, seed=0, device=device)
    model = parallelize(model, state.dp_mesh, FSDPOptions(mixed_precision=args.dtype,
                                                          activation_checkpointing=args.ac))
    model.set_mixed_precision(args.dtype)  # without FSDP: autocast over fp32 weights; with it a no-op
    if args.compile:
        model.compile_blocks()
    return model


def main(argv=None) -> dict:
    args, cuda = parse_args(argv)
    cfg = MODELS[args.model]
    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = resolve_device("cuda" if cuda else "cpu")
    dims = ParallelDims(launch_world_size() // args.tp, args.tp)
    state = init_parallel(dims, device, cfg.n_heads, cfg.n_kv_heads)
    model = _build(args, cfg, state, device)
    opt = build_optimizer(model, OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant"), cfg,
                          args.steps + args.warmup, state.tp_group, state.dp_group)
    g = torch.Generator().manual_seed(1 + state.dp_rank)  # each DP rank its own tokens, same over TP
    n_global_tokens = dims.dp * args.mb * args.seq

    def step() -> float:
        ids = torch.randint(0, cfg.vocab_size, (args.mb, args.seq + 1), generator=g, device="cpu").to(device)
        loss_tok = model(ids[:, :-1], head=cross_entropy_head(ids[:, 1:], state.tp_group, cfg.vocab_size))
        loss = loss_tok.float().sum() / n_global_tokens
        loss.backward()
        opt.step()
        total = loss.detach().reshape(1)
        all_reduce(total, "sum", state.dp_group)  # each DP rank holds its share of the global mean
        return float(total)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    t_w = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync()
    compile_s = time.perf_counter() - t_w
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    return _report(args, cfg, dims, device, cuda, model, state, dt, compile_s, loss, n_global_tokens)


def _report(args, cfg, dims, device, cuda, model, state, dt, compile_s, loss, n_global_tokens) -> dict:
    tokens_per_s = n_global_tokens / dt
    per_gpu = tokens_per_s / dims.world_size
    peak = peak_flops(device, args.peak_tflops)
    mfu = per_gpu * flops_per_token(cfg, args.seq) / peak if peak else None
    n_params = sum(p.numel() for p in model.parameters())  # local shards
    res = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "world": dims.world_size,
           "model": args.model, "dtype": args.dtype, "compile": args.compile,
           "dp": dims.dp, "tp": dims.tp, "fsdp": is_fsdp(model), "ac": args.ac, "seq": args.seq, "mb": args.mb,
           "step_s": dt, "compile_s": compile_s, "warmup_steps": args.warmup, "tokens_per_s": tokens_per_s,
           "tokens_per_s_per_gpu": per_gpu, "flops_per_token": flops_per_token(cfg, args.seq), "mfu": mfu,
           "loss": loss, "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
           "local_params": n_params}
    if state.is_main:
        mfu_s = f"{100 * mfu:.1f}%" if mfu is not None else "n/a (no GPU peak known)"
        print(f"bench_mfu: {res['device']} x{dims.world_size} {args.model} {args.dtype} compile={args.compile} "
              f"dp={dims.dp} tp={dims.tp} fsdp={res['fsdp']} ac={args.ac} seq={args.seq} mb={args.mb}: "
              f"warm-up {compile_s:.1f}s, {dt * 1e3:.0f} ms/step, {tokens_per_s:,.0f} tok/s ({per_gpu:,.0f}/GPU), "
              f"MFU {mfu_s}, loss {loss:.3f}" + (f", peak {res['peak_mem_gib']:.1f} GiB" if cuda else ""),
              file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
