"""Side-by-side cost of the KL head: (a) gather full logits then KL, (b) vocab-parallel on
materialised logits, (c) the same chunked, (d) fused head exact KL, (d') the same with the loss inside and the gradient
formed in forward, (e) fused head sampled-token k3, (e') the same with the loss inside, (f) the matmul floor.

    timeout 900 python -m bench.bench_kl_head [--tokens 8192 --hidden 1024 --vocab 32000 --tp 1]
        [--dtype fp32] [--chunk-size 512] [--pass forward+backward|forward|both] [--json OUT.json]
        [--methods gather,fused_exact,fused_exact_loss]

Median of --repeats runs after a warm-up (see tools/kl_memory.py for what is measured and how); prints a markdown
table with peak memory and time relative to (a) and to the matmul floor.
"""

from __future__ import annotations

import argparse

from tools import kl_memory
from tools.klcost.methods import DEFAULT, DTYPES

LABELS = {"gather": "(a) gather full logits, then KL", "vp_materialized": "(b) vocab-parallel, materialised",
          "vp_chunked": "(c) vocab-parallel, chunked", "fused_exact": "(d) fused head, exact KL",
          "fused_exact_loss": "(d') fused head + loss, exact KL, grad in forward",
          "fused_k3": "(e) fused head, sampled-token k3",
          "fused_k3_loss": "(e') fused head + loss, sampled-token k3, grad in forward",
          "matmul_floor": "(f) the head's matmuls alone (floor)", "verl_k3": "verl/OpenRLHF-style gather + k3",
          "trl_k3": "TRL selective_log_softmax + k3", "cce_k3": "Cut Cross-Entropy + k3",
          "liger_jsd": "Liger fused linear JSD"}


def table(rows) -> str:
    out = ["| method | pass | peak MiB | peak / (a) | time s (median) | time / (a) | time / floor | comm bytes |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    base = {r["pass"]: r for r in rows if r["name"] == "gather"}
    for r in rows:
        b = base.get(r["pass"])
        ratio = lambda k, r=r, b=b: f"{r[k] / b[k]:.3f}" if b and b[k] else "-"
        out.append(f"| {LABELS[r['name']]} | {r['pass']} | {r['peak_bytes'] / 2**20:.1f} | {ratio('peak_bytes')} "
                   f"| {r['time_s']:.2f} | {ratio('time_s')} | {r.get('time_vs_floor') or '-'} | {r['comm_bytes']} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--pass", dest="pass_", default="forward+backward", choices=["forward", "forward+backward", "both"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--methods", default=",".join(["matmul_floor"] + DEFAULT))
    ap.add_argument("--peers", default="")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    args = ["--tokens", str(a.tokens), "--hidden", str(a.hidden), "--vocab", str(a.vocab), "--tp", str(a.tp),
            "--dtype", a.dtype, "--chunk-size", str(a.chunk_size), "--pass", a.pass_,
            "--json", a.json or "/tmp/bench_kl_head.json", "--methods", a.methods, "--peers", a.peers,
            "--repeats", str(a.repeats)]
    rows = kl_memory.main(args)
    print(f"T={a.tokens} H={a.hidden} V={a.vocab} tp={a.tp} {a.dtype} chunk={a.chunk_size}, median of {a.repeats} "
          "runs after 1 warm-up, CPU")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
