"""Projected per-rank memory of one GRPO step, LoRA against full fine-tuning, at 8B and 70B
(core/runtime/budget.py, the numbers `rl.train --dry-run` prints). configs/grpo_llama3_8b_multinode.yaml's
job (bf16 on CUDA, FSDP over dp, activation checkpointing, 1536-token rows), with the model and the
layout of each row.

    python -m bench.bench_lora_budget [--rank 16]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from core.config import load_config
from core.model_shapes import PRESETS
from core.runtime.budget import projected_peak_bytes
from rl.config import RLConfig

CONFIG = "configs/grpo_llama3_8b_multinode.yaml"
ROWS = (("llama3-8b", 1, 1), ("llama3-8b", 8, 8), ("llama3-8b", 8, 16), ("llama3-70b", 8, 64))  # model, tp, world size
PARTS = ("policy weights", "gradients", "AdamW state", "reference")


def project(model: str, tp: int, world: int, lora_rank: int) -> dict:
    extra = [f"parallel.tp={tp}"] + ([f"lora.rank={lora_rank}", f"lora.alpha={2 * lora_rank}"] if lora_rank else [])
    cfg = load_config(RLConfig, CONFIG, extra)
    cfg = replace(cfg, model=PRESETS[model])
    return projected_peak_bytes(cfg, world, "cuda")


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    a = ap.parse_args(argv)
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    lines = ["| model | ranks (tp x dp) | training | " + " | ".join(PARTS) + " | peak per rank GiB | LoRA / full |",
             "|---|---|---|" + "---:|" * (len(PARTS) + 2)]
    for model, tp, world in ROWS:
        full = project(model, tp, world, 0)
        lora = project(model, tp, world, a.rank)
        for name, r in (("full + separate reference", full), (f"LoRA r={a.rank}, base as reference", lora)):
            ratio = f"{lora['peak'] / full['peak']:.2f}" if r is lora else ""
            lines.append(f"| {model} | {world} ({tp} x {world // tp}) | {name} | "
                         + " | ".join(gib(r["parts"][p]) for p in PARTS) + f" | {gib(r['peak'])} | {ratio} |")
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
