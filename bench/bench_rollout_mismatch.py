"""The rollout-vs-training mismatch of a real job, per precision, from its metrics.jsonl; and what recording
the rollout's log-probs and hidden states costs the generation.

    python -m bench.bench_rollout_mismatch [--config configs/grpo_tiny.yaml --steps 20 --out /tmp/mismatch]
                                           [--precisions fp32 bf16] [-- extra overrides]
    python -m bench.bench_rollout_mismatch --cost [--repeats 3]

`--cost`: the sampler alone at [256, 32000] float32 logits, top_p 0.9, with and without the drawn tokens'
two log-probs (the fastest of 5 x `--repeats` calls each, interleaved: robust on a loaded machine); then
`generate` with record=False, record=True, and record=True with record_hidden=True (medians of `--repeats`,
interleaved) on the tiny model (256 rows x 6 tokens) and a 32000-vocabulary one (H=512, 8 layers; 32 rows
x 16 tokens), top_p 0.9.

Runs `python -m rl.train --config CONFIG train.steps=STEPS parallel.mixed_precision=P` once per precision
(and per `algo.old_from_update` true / false: with it, one mini-batch's old log-probs come from the update's
first forward; without, every row's from the old-log-prob pass) and prints, over all steps, the mean and the
largest of each mismatch metric (rl/health/mismatch.py) as a markdown table (token_mult_prob_error as its excess
over 1). With bf16 a last row runs the same job with the rollout's head as it was before it computed the
trainer's float32 logits (a bf16 `F.linear`, patched in for this run only: `--train-bf16-head`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

KEYS = ("rollout_logp_diff_max", "rollout_logp_diff_mean", "rollout_ratio_out_share", "token_mult_prob_error",
        "rollout_kl_mean", "rollout_kl_p99", "rollout_kl_max")


def run(config: str, steps: int, out: str, precision: str, old_from_update: bool, extra: list[str],
        bf16_head: bool = False) -> list[dict]:
    """The job's metrics records (runs it unless `out`/metrics.jsonl already holds `steps` of them)."""
    path = os.path.join(out, "metrics.jsonl")
    if not (os.path.exists(path) and sum(1 for _ in open(path, encoding="utf-8")) >= steps):
        entry = ["bench.bench_rollout_mismatch", "--train-bf16-head", "--"] if bf16_head else ["rl.train"]
        cmd = [sys.executable, "-m", *entry, "--config", config, f"train.steps={steps}", f"train.out_dir={out}",
               "train.save_every=0", f"parallel.mixed_precision={precision}",
               f"algo.old_from_update={str(old_from_update).lower()}", "train.progress=false", *extra]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def summary(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """(mean over steps, max over steps) of each of KEYS that the records hold."""
    out = {}
    for k in KEYS:
        xs = [float(r[k]) - (k == "token_mult_prob_error") for r in rows if isinstance(r.get(k), (int, float))]
        if xs:
            out[k] = (sum(xs) / len(xs), max(xs))
    return out


def cost(repeats: int) -> None:
    """Prints the generation time with and without the records (module docstring)."""
    import statistics
    import time

    import torch

    from core.config import ModelConfig
    from core.generation.generate import generate
    from core.generation.sampling import sample_from_sharded_logits, tempered_logprob
    from core.model import build_model

    z = torch.randn(256, 32000, generator=torch.Generator().manual_seed(0)) * 3
    kw = dict(vocab_size=32000, temperature=1.0, top_p=0.9, seed=1, step=0, row_ids=torch.arange(256), position=0)
    best = [float("inf"), float("inf")]
    for _ in range(5 * repeats):
        for i in (0, 1):
            t0 = time.perf_counter()
            out = sample_from_sharded_logits(z, return_logprobs=bool(i), **kw)
            if i:
                tempered_logprob(z, out[0], vocab_size=32000, temperature=1.0)
            best[i] = min(best[i], time.perf_counter() - t0)
    print(f"sampler [256, 32000] top_p 0.9: {best[0] * 1e3:.1f} ms, with both log-probs {best[1] * 1e3:.1f} ms "
          f"({best[1] / best[0]:.2f}x)\n")
    shapes = {"tiny (V=256, H=64)": (dict(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                          intermediate_size=176, max_seq_len=64), 256, 6),
              "V=32000, H=512, 8 layers": (dict(vocab_size=32000, hidden_size=512, n_layers=8, n_heads=8,
                                                n_kv_heads=4, intermediate_size=1376, max_seq_len=64), 32, 16)}
    print("| model | rows x tokens | plain s | + log-probs | + log-probs and hidden |")
    print("|---|---|---:|---:|---:|")
    for name, (mc, rows, n) in shapes.items():
        model = build_model(ModelConfig(**mc), seed=0)
        ids = torch.randint(3, mc["vocab_size"], (rows, 8), generator=torch.Generator().manual_seed(0))
        kw = dict(max_new_tokens=n, eos_id=None, pad_id=0, temperature=1.0, top_p=0.9, seed=1, compact=False)
        modes = [dict(), dict(record=True), dict(record=True, record_hidden=True)]
        times = [[] for _ in modes]
        for _ in range(repeats):
            for i, m in enumerate(modes):
                t0 = time.perf_counter()
                generate(model, ids, torch.ones_like(ids), **kw, **m)
                times[i].append(time.perf_counter() - t0)
        med = [statistics.median(t) for t in times]
        print(f"| {name} | {rows} x {n} | {med[0]:.3f} | {med[1]:.3f} ({med[1] / med[0]:.2f}x) | "
              f"{med[2]:.3f} ({med[2] / med[0]:.2f}x) |")


def train_with_bf16_head(argv: list[str]) -> int:
    """`rl.train` with the rollout head of before: logits = F.linear(hidden, weight) in the compute dtype (bf16
    under parallel.mixed_precision=bf16), upcast only for the sampler."""
    import torch.nn.functional as F

    import core.generation.generate as gen
    from parallel.comm import copy_to_tp
    from rl.train import main as train

    def bf16_head(tp_group):
        def head(hidden, weight_local):
            return F.linear(copy_to_tp(hidden[:, -1], tp_group), weight_local).float(), hidden[:, -1]
        return head
    gen._last_position_head = bf16_head
    return train(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--train-bf16-head"]:
        return train_with_bf16_head(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/grpo_tiny.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="/tmp/mismatch")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--cost", action="store_true", help="time generate with and without the records")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("extra", nargs="*", help="more config overrides")
    a = ap.parse_args(argv)
    if a.cost:
        cost(a.repeats)
        return 0
    names = [k + (" - 1" if k == "token_mult_prob_error" else "") for k in KEYS]
    print("| precision | old_from_update | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(KEYS))
    for p in a.precisions:
        for ofu in (True, False):
            rows = run(a.config, a.steps, os.path.join(a.out, f"{p}_{ofu}"), p, ofu, a.extra)
            s = summary(rows)
            cells = [f"{s[k][0]:.3g} / {s[k][1]:.3g}" if k in s else "-" for k in KEYS]
            print(f"| {p} | {ofu} | " + " | ".join(cells) + " |")
    if "bf16" in a.precisions:
        rows = run(a.config, a.steps, os.path.join(a.out, "bf16_head_False"), "bf16", False, a.extra, bf16_head=True)
        s = summary(rows)
        cells = [f"{s[k][0]:.3g} / {s[k][1]:.3g}" if k in s else "-" for k in KEYS]
        print("| bf16, the rollout head before (bf16 logits) | False | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
