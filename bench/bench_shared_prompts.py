"""kltron's GRPO step with and without the shared-prompt forward (rl/update/shared_layout.py), same run.

The workload of bench/bench_rl_vs_trl.py (same weights, prompts, batch 32 x 8, 6 new tokens, 2 epochs
x 2 mini-batches), kltron side only, once per variant in a fresh child process, variants alternated
over --rounds; prints the median per-phase seconds of each.

    python -m bench.bench_shared_prompts --size 60m --steps 2 --warmup 1

The "+tokens" variants run the update in micro-batches by a token budget (`--tokens`, algo.micro_batch_tokens):
padded rows trimmed per micro-batch, or the shared-prompt layout with R x W <= the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

VARIANTS = {
    "unshared": ["algo.share_prompts=false", "rollout.share_prefill=false"],
    "shared": ["algo.share_prompts=true", "rollout.share_prefill=true"],
    "shared+groups": ["algo.share_prompts=true", "rollout.share_prefill=true", "algo.group_mini_batches=true"],
    "unshared+tokens": ["algo.share_prompts=false", "rollout.share_prefill=false"],
    "shared+tokens": ["algo.share_prompts=true", "rollout.share_prefill=true"],
}
DEFAULT_VARIANTS = ("unshared", "shared", "shared+groups")


def overrides(variant: str, tokens: int) -> list[str]:
    """The config overrides of `variant`; the "+tokens" ones with algo.micro_batch_tokens=`tokens`."""
    return VARIANTS[variant] + ([f"algo.micro_batch_tokens={tokens}"] if variant.endswith("+tokens") else [])


KEYS = ("step", "rollout", "ref_logprobs", "old_logprobs", "update")


def child(a) -> None:
    import torch

    from bench.bench_rl_vs_trl import kltron_side
    torch.set_num_threads(a.threads)
    ns = argparse.Namespace(size=a.size, ckpt=a.ckpt, hf_dir=a.hf_dir, warmup=a.warmup, steps=a.steps,
                            override=overrides(a.variant, a.tokens))
    print(json.dumps(kltron_side(ns)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="60m")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"some of {', '.join(VARIANTS)}")
    ap.add_argument("--tokens", type=int, default=1024, help="algo.micro_batch_tokens of the +tokens variants")
    for internal in ("--variant", "--ckpt", "--hf-dir"):
        ap.add_argument(internal, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.variant:
        return child(a)
    from bench.bench_rl_vs_trl import prepare
    out: dict = {v: [] for v in a.variants.split(",")}
    if set(out) - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(set(out) - set(VARIANTS))}; expected some of {sorted(VARIANTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        setup = prepare(a.size, os.path.join(tmp, a.size), a.warmup + a.steps)
        for _ in range(a.rounds):
            for v in out:
                cmd = [sys.executable, "-m", "bench.bench_shared_prompts", "--variant", v, "--size", a.size,
                       "--ckpt", setup["ckpt"], "--hf-dir", setup["hf_dir"], "--steps", str(a.steps),
                       "--warmup", str(a.warmup), "--threads", str(a.threads), "--tokens", str(a.tokens)]
                run = subprocess.run(cmd, check=True, capture_output=True, text=True)
                res = json.loads(run.stdout.splitlines()[-1])
                out[v].append(res)
                print(f"{v}: " + " ".join(f"{k} {res[k]:.2f}" for k in KEYS), file=sys.stderr, flush=True)
    print(f"| variant ({a.size}, median s) | " + " | ".join(KEYS) + " |")
    print("|---" * (len(KEYS) + 1) + "|")
    for v, runs in out.items():
        print(f"| {v} | " + " | ".join(f"{statistics.median(r[k] for r in runs):.2f}" for k in KEYS) + " |")
    return out


if __name__ == "__main__":
    main()
