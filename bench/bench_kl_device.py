"""The fused exact-KL head against gathering logits, on any device (the GPU check's KL section).

    python -m bench.bench_kl_device --device cuda [--tokens 32768 --hidden 4096 --vocab 128256 --dtype bf16]
        [--chunk-size 1024] [--json OUT]

Both compute, for T tokens, log p(target), and the exact KL(p||q) over the full vocabulary between
the policy head (hidden [T, H] @ weight [V, H].T) and a frozen reference head (its own hidden and
weight), then backpropagate sum(KL) + sum(log p) into the policy hidden and weight:
  gather  the usual way: full logits [T, V] in the weights' dtype, fp32 log_softmax of each, KL
  fused   parallel/fused.py's fused_head (chunks of --chunk-size tokens, fp32 logits, no [T, V])
Reported per method: peak_bytes (the allocator's peak above the inputs on CUDA; on CPU the CPU
allocator's peak from its events in one more, untimed run, tools/klcost/cpu_peak.py: the RSS
high-water mark read 0 for the fused head, whose memory the gather's freed pages served), time_s
(mean of --repeats runs after one warm-up, synchronised), and
"oom" when the method ran out of memory. (tools.kl_memory does the full study, more methods and
projections, on CPU or `--device cuda`.)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from core.runtime.metrics import phase_peak_begin, phase_peak_end
from parallel.fused import fused_head

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _gather(h, w, rh, rw, t, chunk):
    lp = torch.log_softmax((h @ w.T).float(), -1)  # [T, V] fp32
    with torch.no_grad():
        lq = torch.log_softmax((rh @ rw.T).float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return kl, lp.gather(1, t[:, None])[:, 0]


def _fused(h, w, rh, rw, t, chunk):
    out = fused_head(h, w, t, ref_hidden=rh, ref_weight_local=rw, kl="forward", entropy=False, chunk_size=chunk)
    return out.kl, out.logprobs


METHODS = {"gather": _gather, "fused": _fused}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(T, H, V, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s, scale: (torch.randn(*s, generator=g, device="cpu") * scale).to(device=device, dtype=dtype)
    h, w = mk(T, H, scale=1.0).requires_grad_(), mk(V, H, scale=H ** -0.5).requires_grad_()
    rh, rw = mk(T, H, scale=1.0), mk(V, H, scale=H ** -0.5)
    t = torch.randint(0, V, (T,), generator=g, device="cpu").to(device)
    return h, w, rh, rw, t


def run_one(name, T, H, V, dtype, device, chunk, repeats) -> dict:
    h, w, rh, rw, t = _inputs(T, H, V, dtype, device)
    fn, times, peak = METHODS[name], [], 0
    try:
        for i in range(repeats + 1):
            h.grad = w.grad = None
            gc.collect()
            _sync(device)
            phase_peak_begin(device)  # after a reset the CPU high-water mark is the current RSS
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else phase_peak_end(device)[0]
            t0 = time.perf_counter()
            kl, lp = fn(h, w, rh, rw, t, chunk)
            (kl.sum() + lp.sum()).backward()
            _sync(device)
            if i:  # the first run warms up
                times.append(time.perf_counter() - t0)
                peak = max(peak, phase_peak_end(device)[0] - base)
            del kl, lp
        if device.type == "cpu":
            from tools.klcost.cpu_peak import profiled_peak

            h.grad = w.grad = None

            def once():
                kl, lp = fn(h, w, rh, rw, t, chunk)
                (kl.sum() + lp.sum()).backward()

            peak = profiled_peak(once)[0]
    except torch.OutOfMemoryError:
        return {"method": name, "status": "oom"}
    return {"method": name, "status": "ok", "peak_bytes": int(peak), "time_s": sum(times) / len(times)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_kl_device", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = []
    for name in METHODS:
        rows.append(run_one(name, a.tokens, a.hidden, a.vocab, DTYPES[a.dtype], device, a.chunk_size, a.repeats))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    by = {r["method"]: r for r in rows}
    res = {"tokens": a.tokens, "hidden": a.hidden, "vocab": a.vocab, "dtype": a.dtype, "device": str(device),
           "chunk_size": a.chunk_size, "methods": rows}
    g, f = by["gather"], by["fused"]
    if g["status"] == f["status"] == "ok":
        res["fused_over_gather_memory"] = f["peak_bytes"] / max(g["peak_bytes"], 1)
        res["fused_over_gather_time"] = f["time_s"] / g["time_s"]
    for r in rows:
        print(f"kl head {r['method']:>6}: " + (f"peak {r['peak_bytes'] / 2**30:.3f} GiB, {r['time_s'] * 1e3:.1f} ms"
                                               if r["status"] == "ok" else r["status"]), file=sys.stderr)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return res


if __name__ == "__main__":
    main()
