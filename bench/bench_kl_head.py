"""Side-by-side cost of the KL head: (a) gather full logits then KL, (b) vocab-parallel on
materialised logits, (c) the same chunked, (d) fused head exact KL, (d') the same with the loss inside and the gradient
formed in forward, (e) fused head sampled-token k3.

    timeout 900 python -m bench.bench_kl_head [--tokens 8192 --hidden 1024 --vocab 32000 --tp 1]
        [--dtype fp32] [--chunk-size 512] [--pass forward+backward|forward|both] [--json OUT.json]
        [--methods gather,fused_exact,fused_exact_loss]

One run of each (see tools/kl_memory.py for what is measured and how); prints a markdown table with
peak memory and time relative to (a).
"""

from __future__ import annotations

import argparse

from tools import kl_memory

LABELS = {"gather": "(a) gather full logits, then KL", "vp_materialized": "(b) vocab-parallel, materialised",
          "vp_chunked": "(c) vocab-parallel, chunked", "fused_exact": "(d) fused head, exact KL",
          "fused_exact_loss": "(d') fused head + loss, exact KL, grad in forward",
          "fused_k3": "(e) fused head, sampled-token k3"}


def table(rows) -> str:
    out = ["| method | pass | peak MiB | peak / (a) | time s | time / (a) | comm bytes |",
           "|---|---|---:|---:|---:|---:|---:|"]
    base = {r["pass"]: r for r in rows if r["name"] == "gather"}
    for r in rows:
        b = base.get(r["pass"])
        ratio = lambda k, r=r, b=b: f"{r[k] / b[k]:.3f}" if b and b[k] else "-"
        out.append(f"| {LABELS[r['name']]} | {r['pass']} | {r['peak_bytes'] / 2**20:.1f} | {ratio('peak_bytes')} "
                   f"| {r['time_s']:.2f} | {ratio('time_s')} | {r['comm_bytes']} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="fp32", choices=sorted(kl_memory.DTYPES))
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--pass", dest="pass_", default="forward+backward", choices=["forward", "forward+backward", "both"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--methods", default=",".join(kl_memory.METHODS))
    a = ap.parse_args(argv)
    args = ["--tokens", str(a.tokens), "--hidden", str(a.hidden), "--vocab", str(a.vocab), "--tp", str(a.tp),
            "--dtype", a.dtype, "--chunk-size", str(a.chunk_size), "--pass", a.pass_,
            "--json", a.json or "/tmp/bench_kl_head.json", "--methods", a.methods]
    rows = kl_memory.main(args)
    print(f"T={a.tokens} H={a.hidden} V={a.vocab} tp={a.tp} {a.dtype} chunk={a.chunk_size}, one run each, CPU")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
