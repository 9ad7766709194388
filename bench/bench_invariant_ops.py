"""The batch-invariant mode's cost in isolation: one attention layer, a short `generate`, and the attention
op alone (SDPA, the mode's CPU kernel, its plain-PyTorch path), mode off vs on.

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m bench.bench_invariant_ops [--what layer,generate,attention]
        [--reps 3] [--rows 8] [--seq 576] [--new-tokens 128] [--precision fp32] [--lengths 256,1024]

layer: one `Attention` of the 58.5M model (hidden 512, 8 heads of 64) forward + backward on [rows, seq]
tokens (the mode on: the canonical layout of the full rows); generate: that model (bench_rl_vs_trl's "60m",
max_seq_len 64 + 256) sampling `--new-tokens` after 8 prompts of 24..64 tokens, `model.batch_invariant`
off and on alternately; attention: [rows, 8 heads, ., 64] fp32, a decode step (one query per head against a
KV cache of capacity length + 64, filled to `length`) and a causal full forward of `length` tokens, for each
of `--lengths`: SDPA, `inv_attention` with the kernel and with the plain-PyTorch blocks (milliseconds).
Median wall and process CPU seconds over `--reps` rounds after one warm-up each; one torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from bench.bench_rl_vs_trl import SIZES
from core.generation.generate import generate
from core.model import Attention, build_model
from core.rope import rope_cos_sin, rope_inv_freq
from parallel import invariant_kernel
from parallel.invariant import batch_invariant, canonical_layout, inv_attention

CFG = replace(SIZES["60m"], max_seq_len=64 + 256)


def _alternate(fns: dict, reps: int) -> dict:
    """Each fn once to warm up, then `reps` rounds of each in turn (a shared machine's load falls on
    all alike): the median wall and process CPU seconds per fn."""
    for fn in fns.values():
        fn()
    wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in fns}


def bench_layer(rows: int, seq: int, reps: int, precision: str) -> dict:
    cfg = replace(CFG, max_seq_len=seq)
    torch.manual_seed(0)
    attn = Attention(cfg, None, None)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    attn.to(dtype)
    x = torch.randn(rows, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
    pos = torch.arange(seq).expand(rows, seq)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), pos, dtype)
    def step(on):
        with batch_invariant(on):
            mask = canonical_layout(pos, torch.ones(rows, seq, dtype=torch.bool)) if on else None
            y = attn(x, cos, sin, mask, None, 0)
            y.float().square().mean().backward()
    return _alternate({"off": lambda: step(False), "on": lambda: step(True)}, reps)


def bench_generate(new_tokens: int, reps: int, precision: str) -> dict:
    model = build_model(CFG, seed=0)
    model.set_mixed_precision(precision)
    g = torch.Generator().manual_seed(0)
    lens = [24, 64, 40, 56, 32, 48, 64, 30]
    P = max(lens)
    ids = torch.zeros(len(lens), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, P - n:] = torch.randint(3, CFG.vocab_size, (n,), generator=g)
        mask[i, P - n:] = 1
    def run(on):
        model.batch_invariant = on
        generate(model, ids, mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_id=None,
                 pad_id=0, temperature=1.0, seed=1)
    return _alternate({"off": lambda: run(False), "on": lambda: run(True)}, reps)


def _inv(on: bool, *args) -> None:
    with invariant_kernel.use_kernel(on):
        inv_attention(*args)


def _attend(on: bool, layout, q, k, v) -> None:
    with invariant_kernel.use_kernel(on):
        layout.attend(q, k, v)  # the model's full-forward entry (the plain path: query blocks of 128)


def _attention_fns(rows: int, n: int, g: torch.Generator) -> dict:
    """The six attention calls at length n: a decode step's (inv_attention over a cache) and a causal full
    forward's (the canonical layout's attend), three ways each."""
    h, hd = 8, 64
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ck, cv = (torch.randn(rows, h, n + 64, hd, generator=g) for _ in range(2))
    q1 = torch.randn(rows, h, 1, hd, generator=g)
    pos1, seen = torch.full((rows, 1), n - 1), torch.ones(rows, n + 64, dtype=torch.bool)
    q, k, v = (torch.randn(rows, h, n, hd, generator=g) for _ in range(3))
    layout = canonical_layout(torch.arange(n).expand(rows, n), torch.ones(rows, n, dtype=torch.bool))
    return {
        "decode sdpa": lambda: sdpa(q1, ck[:, :, :n], cv[:, :, :n]),
        "decode kernel": lambda: _inv(True, q1, ck, cv, pos1, None, seen, n),
        "decode plain": lambda: _inv(False, q1, ck, cv, pos1, None, seen, n),
        "forward sdpa": lambda: sdpa(q, k, v, is_causal=True),
        "forward kernel": lambda: _attend(True, layout, q, k, v),
        "forward plain": lambda: _attend(False, layout, q, k, v),
    }


def bench_attention(rows: int, lengths: list[int], reps: int) -> dict:
    """SDPA against the invariant attention (kernel, plain PyTorch), a decode step and a full forward."""
    g = torch.Generator().manual_seed(0)
    res = {}
    for n in lengths:  # the decode calls alternate among themselves, then the forwards (whose large buffers
        fns = _attention_fns(rows, n, g)  # would otherwise be freed and faulted in again around each decode)
        res[n] = {**_alternate({k: f for k, f in fns.items() if k.startswith("decode")}, reps),
                  **_alternate({k: f for k, f in fns.items() if k.startswith("forward")}, reps)}
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", default="layer,generate")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=576)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--lengths", default="256,1024")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {}
    for what in a.what.split(","):
        if what == "attention":
            res[what] = r = bench_attention(a.rows, [int(x) for x in a.lengths.split(",")], a.reps)
            for n, fns in r.items():
                print(f"attention length {n}: " + ", ".join(
                    f"{k} {w * 1e3:.2f} ms (CPU {c * 1e3:.2f})" for k, (w, c) in fns.items()), flush=True)
            continue
        r = (bench_layer(a.rows, a.seq, a.reps, a.precision) if what == "layer"
             else bench_generate(a.new_tokens, a.reps, a.precision))
        res[what] = r
        (w0, c0), (w1, c1) = r["off"], r["on"]
        print(f"{what:9s} wall off {w0:.3f} s on {w1:.3f} s on/off {w1 / w0:.2f} | "
              f"CPU off {c0:.3f} s on {c1:.3f} s on/off {c1 / c0:.2f}", flush=True)
    return res


if __name__ == "__main__":
    main()
