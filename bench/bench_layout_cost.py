"""The shared-prompt layout's plan against response length: forward+backward of one batch of GRPO groups
padded row by row, in the default shared plan (each group one piece, two median groups a row) and in the
plan the layout cost model picks (rl/update/shared_layout.py: `LayoutCost`, `_cheapest_plan`), side by side.

    python -m bench.bench_layout_cost [--hidden 256] [--layers 2] [--groups 4] [--group-size 8] [--repeats 2]
        [--device cuda --dtype bf16] [--shapes 64x512,256x2048] [--json OUT]

With a dense mask every attention score is computed, so a row holding a whole group of G long responses
costs G^2 N^2 scores where G rows of one response cost G N^2: the default plan, right for short
responses, loses several-fold once responses are long; the cost plan splits groups into pieces of fewer
responses (and stops packing two groups a row) where the model prices that cheaper. Responses are drawn
between N/2 and N tokens. Times are medians of `--repeats` after one warm-up (synchronised on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from core.config import ModelConfig
from core.model import build_model
from rl.experience.rollout import Rollout
from rl.update.shared_layout import LayoutCost, share_rollout

SHAPES = ((16, 6), (64, 64), (64, 256), (64, 512), (256, 512))  # (prompt tokens, response tokens)


def rollout(P: int, N: int, groups: int, G: int, vocab: int, seed: int = 0, device="cpu") -> Rollout:
    """`groups` prompts of P tokens, G responses each of N/2..N tokens (right-padded to N)."""
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    seq = torch.randint(3, vocab, (B, P + N), generator=g, device="cpu")
    for k in range(groups):
        seq[k * G:(k + 1) * G, :P] = seq[k * G, :P]
    am = torch.ones_like(seq)
    rm = torch.ones(B, N, dtype=torch.bool, device="cpu")
    lens = torch.randint(N // 2, N + 1, (B,), generator=g, device="cpu")
    for i in range(B):
        rm[i, lens[i]:] = False
        am[i, P + lens[i]:] = 0
    return Rollout(seq.to(device), am.to(device), rm.to(device), P, torch.zeros(B, device=device),
                   torch.arange(B, device=device), [], [])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(f"{p}x{n}" for p, n in SHAPES), help="PxN,...")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dev, dtype = torch.device(a.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    H = a.hidden
    cfg = ModelConfig(vocab_size=1024, hidden_size=H, n_layers=a.layers, n_heads=max(H // 64, 1),
                      n_kv_heads=max(H // 64, 1), intermediate_size=H * 11 // 4, max_seq_len=16384)
    model, cost = build_model(cfg, seed=0, device=dev, dtype=dtype), LayoutCost.of(cfg)
    rows = []
    for shape in a.shapes.split(","):
        P, N = (int(x) for x in shape.split("x"))
        ro = rollout(P, N, a.groups, a.group_size, cfg.vocab_size, device=dev)
        plans = {"padded": None, "default": share_rollout(ro), "cost": share_rollout(ro, cost=cost)}

        def run(sh, ro=ro):
            if sh is None:
                h = model(ro.sequences, attention_mask=ro.attention_mask)
            else:
                h = model(sh.input_ids, position_ids=sh.position_ids, document_ids=sh.document_ids,
                          prefix_ids=sh.prefix_ids)
            h.float().mean().backward()
            model.zero_grad(set_to_none=True)

        times = {k: [] for k in plans}
        for sh in plans.values():
            run(sh)  # warm-up
        for _ in range(a.repeats):
            for k, sh in plans.items():  # interleaved, so drift spreads over all three
                sync()
                t0 = time.perf_counter()
                run(sh)
                sync()
                times[k].append(time.perf_counter() - t0)
        row = {"P": P, "N": N}
        for k, sh in plans.items():
            shp = list(ro.sequences.shape) if sh is None else list(sh.input_ids.shape)
            row[k] = {"shape": shp, "s": statistics.median(times[k]), "model": cost(*shp)}
        rows.append(row)
    print(f"`python -m bench.bench_layout_cost {' '.join(argv) if argv is not None else ''}`".replace(" `", "`"))
    print(f"\nH={H}, {a.layers} layers, {a.groups} groups x {a.group_size} responses, {a.dtype} on {dev.type}, "
          f"{a.threads} threads; "
          "forward+backward seconds (median), [rows, width], modelled cost relative to padded\n")
    print("| prompt x response | padded | default shared | cost plan | cost plan / default |")
    print("|---|---|---|---|---:|")
    def cell(r, k):
        return f"{r[k]['s']:.3f} s {r[k]['shape']} ({r[k]['model'] / r['padded']['model']:.2f})"

    for r in rows:
        print(f"| {r['P']} x {r['N']} | {cell(r, 'padded')} | {cell(r, 'default')} | {cell(r, 'cost')} | "
              f"{r['cost']['s'] / r['default']['s']:.2f}x |")
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump({"device": dev.type, "dtype": a.dtype, "hidden": H, "layers": a.layers, "rows": rows}, f,
                      indent=1)
        os.replace(a.json + ".tmp", a.json)
    return rows


if __name__ == "__main__":
    main()
