"""A multi-turn episode's rollout against a single-turn rollout of the same total length.

    python -m bench.bench_multiturn [--rows 16] [--total 256] [--turns 4] [--obs 8] [--reps 3] [--threads 1]

Single turn: `generate` samples `total` tokens per row (no stop drawn before them). Multi-turn
(core/generation/multiturn.py): `turns` turns, each sampling total / turns - obs tokens and then
appending an `obs`-token observation to every row from the KV cache (one forward, nothing re-run),
so both rollouts put the same number of tokens through the same cache. Both on the 58.5M model with
random weights, fp32, the same prompts; the two are timed alternately, median of `reps` after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from bench.bench_rl_vs_trl import SIZES
from core.generation import multiturn as mt
from core.generation.generate import Stopper, generate
from core.model import build_model

SEED = 7


def single(model, ids, mask, total: int) -> int:
    out = generate(model, ids, mask, max_new_tokens=total, min_new_tokens=total, eos_id=None, eos_ids=[], pad_id=0,
                   vocab_limit=model.cfg.vocab_size, seed=SEED, step=0)
    return int(out.response_mask.sum())


def episode(model, ids, mask, total: int, turns: int, obs: int) -> int:
    B = ids.shape[0]
    conv = mt.start(model, ids, mask, columns=total, pad_id=0)
    kw = dict(vocab_size=model.cfg.vocab_size, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=SEED, step=0)
    stopper = Stopper(set(), None, None, ids.device)
    dev = ids.device
    active = torch.ones(B, dtype=torch.bool, device=dev)
    budget = torch.full((B,), total, dtype=torch.long, device=dev)
    rows = torch.arange(B, device=dev)
    per = total // turns - obs
    observation = [5 + (i % 50) for i in range(obs)]
    for _ in range(turns):
        mt.decode(model, conv, active, max_new_tokens=per, budget=budget, stopper=stopper, sample_kw=kw, row_ids=rows)
        mt.append(model, conv, [observation] * B)
    return int(mt.finish(conv)["attention_mask"][:, ids.shape[1]:].sum())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--total", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--obs", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    P = 16
    model = build_model(replace(SIZES["60m"], max_seq_len=P + a.total), seed=3).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 32000, (a.rows, P), generator=g)
    mask = torch.ones_like(ids)
    runs = {"single": lambda: single(model, ids, mask, a.total),
            "multi": lambda: episode(model, ids, mask, a.total, a.turns, a.obs)}
    times = {k: [] for k in runs}
    tokens = {}
    for rep in range(a.reps + 1):
        for k, f in runs.items():
            t0 = time.perf_counter()
            tokens[k] = f()
            if rep:
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"rows {a.rows}, {a.total} tokens after the prompt per row ({a.turns} turns of "
          f"{a.total // a.turns - a.obs} sampled + {a.obs} appended), median of {a.reps}:")
    for k in runs:
        print(f"  {k:7s} {med[k]:8.3f} s  tokens {tokens[k]}")
    print(f"  multi / single = {med['multi'] / med['single']:.3f}")
    return {"median_s": med, "tokens": tokens, "ratio": med["multi"] / med["single"]}


if __name__ == "__main__":
    main()
