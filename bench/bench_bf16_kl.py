"""Exact-KL error of the heads with bf16 inputs, against float64.

    python -m bench.bench_bf16_kl [--tokens 512 --hidden 128 --vocab 32768 --device cpu --json OUT]

The audit's case: bf16 hidden states and head weights whose logits are ~ N(20, 7.7), a reference
head a small bf16 perturbation away (true KL ~ 1e-3). The truth is the float64 KL of the very
same bf16 values (every product of two bf16 numbers is exact in float64). Compared:
  bf16_logits  the logits rounded to bf16, then reduced in float32: what the fused head did
               before its matmul had an fp32 output (vocab_parallel_kl on bf16 logits)
  fused        parallel/fused.py's fused_head (fp32=True)
  fused_loss   parallel/fused_loss.py's fused_head_loss (fp32=True), the KL in its stats
Prints mean and max absolute error of the per-token KL, and the mean true KL.
"""

from __future__ import annotations

import argparse
import json

import torch

from parallel.fused import fused_head
from parallel.fused_loss import fused_head_loss
from parallel.vocab import vocab_parallel_kl


def audit_case(T: int, H: int, V: int, seed: int = 0, device="cpu", noise: float | None = None):
    """bf16 (hidden [T, H], weight [V, H], ref_weight [V, H]) with logits ~ N(20, 7.7): column 0
    of hidden is 1 and of the weights 20 (the mean); the rest ~ N(0, 7.7^2 / (H-1)) per logit."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(T, H, generator=g, device="cpu", dtype=torch.float64)
    h[:, 0] = 1.0
    w = torch.randn(V, H, generator=g, device="cpu", dtype=torch.float64) * (7.7 / (H - 1) ** 0.5)
    w[:, 0] = 20.0
    noise = (3.9e-3 / (H - 1)) ** 0.5 if noise is None else noise
    wr = w + torch.randn(V, H, generator=g, device="cpu", dtype=torch.float64) * noise
    return tuple(x.to(device=device, dtype=torch.bfloat16) for x in (h, w, wr))


def true_kl(h, w, wr) -> torch.Tensor:
    """float64 KL(p||q) [T] of the bf16 values, computed from gathered float64 logits."""
    zp, zq = h.double() @ w.double().T, h.double() @ wr.double().T
    lp, lq = torch.log_softmax(zp, -1), torch.log_softmax(zq, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def measure(T: int, H: int, V: int, seed: int = 0, device="cpu", chunk_size: int = 128) -> dict:
    h, w, wr = audit_case(T, H, V, seed, device)
    truth = true_kl(h.cpu(), w.cpu(), wr.cpu())
    got = {"bf16_logits": vocab_parallel_kl(h @ w.T, h @ wr.T, chunk_size=chunk_size),
           "fused": fused_head(h, w, ref_weight_local=wr, kl="forward", entropy=False, chunk_size=chunk_size).kl}
    _, st = fused_head_loss(h, w, ref_weight_local=wr, kl="forward", entropy=False, chunk_size=chunk_size,
                            token_loss=lambda lp, ent, kl, tok: kl)
    got["fused_loss"] = st.kl
    logits = (h.double() @ w.double().T)
    out = {"tokens": T, "hidden": H, "vocab": V, "device": str(device), "true_kl_mean": truth.mean().item(),
           "logits_mean": logits.mean().item(), "logits_std": logits.std().item()}
    for k, v in got.items():
        err = (v.double().cpu() - truth).abs()
        out[k] = {"mean_abs_err": err.mean().item(), "max_abs_err": err.max().item()}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    r = measure(a.tokens, a.hidden, a.vocab, a.seed, a.device)
    print(f"T={a.tokens} H={a.hidden} V={a.vocab} device={a.device}: logits mean {r['logits_mean']:.2f} "
          f"std {r['logits_std']:.2f}, true KL mean {r['true_kl_mean']:.3e}")
    print("| path | mean abs err | max abs err |\n|---|---:|---:|")
    for k in ("bf16_logits", "fused", "fused_loss"):
        print(f"| {k} | {r[k]['mean_abs_err']:.2e} | {r[k]['max_abs_err']:.2e} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return r


if __name__ == "__main__":
    main()
