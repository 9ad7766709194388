"""Forward + backward of kltron's Transformer against transformers' LlamaForCausalLM of the same
shape, on the same machine, in one run.

    python -m bench.bench_model [--configs tiny,mid] [--repeats 5] [--threads N] [--json OUT]

Both models run in fp32 with SDPA attention and the same loss (`F.cross_entropy` over the logits
of the true vocabulary). Repeats are interleaved (ours, theirs, ours, ...) after warm-up so drift
in machine load hits both alike; the median is reported, and ratio = ours / transformers (<= 1.0:
kltron is at least as fast). Process CPU time is reported beside wall time: on a shared machine it
is the steadier of the two (use --threads 1 there). Peak memory is the peak of tensor memory during one fwd+bwd (params,
activations, grads, temporaries) measured by `torch.distributed._tools.mem_tracker.MemTracker` in
a separate, untimed pass (it intercepts every op, so it is not used while timing).

"mid" is ~50M parameters (hidden 512, 8 layers, vocab 32000, untied).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from core.config import ModelConfig
from core.model import build_model

CONFIGS = {
    "tiny": dict(model=ModelConfig(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                   intermediate_size=176, max_seq_len=128), batch=8, seq=64),
    "mid": dict(model=ModelConfig(vocab_size=32000, hidden_size=512, n_layers=8, n_heads=8, n_kv_heads=4,
                                  intermediate_size=1408, max_seq_len=256), batch=2, seq=128),
}


def hf_model(cfg: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                     num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                     max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                     tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False)
    hc._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(hc).float()


def make_steps(cfg: ModelConfig, batch: int, seq: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    V = cfg.vocab_size
    ours, theirs = build_model(cfg, seed=0), hf_model(cfg)

    def step_ours():
        logits = ours(ids)[..., :V]  # padded vocabulary columns dropped
        F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1)).backward()
        ours.zero_grad(set_to_none=True)

    def step_theirs():
        logits = theirs(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1)).backward()
        theirs.zero_grad(set_to_none=True)

    n_params = sum(p.numel() for p in ours.parameters())
    return step_ours, step_theirs, ours, theirs, n_params


def peak_tensor_bytes(fn, module) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(module)
    with mt:
        fn()
    return max(d["Total"] for d in mt.get_tracker_snapshot("peak").values())


def bench(name: str, repeats: int) -> dict:
    spec = CONFIGS[name]
    step_ours, step_theirs, ours, theirs, n_params = make_steps(spec["model"], spec["batch"], spec["seq"])
    for _ in range(2):  # warm-up
        step_ours()
        step_theirs()
    times = {"ours": [], "theirs": []}
    cpu = {"ours": [], "theirs": []}
    for _ in range(repeats):
        for who, fn in (("ours", step_ours), ("theirs", step_theirs)):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[who].append(time.perf_counter() - t0)
            cpu[who].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {"config": name, "params": n_params, "tokens": spec["batch"] * spec["seq"],
            "ours_ms": 1e3 * med["ours"], "hf_ms": 1e3 * med["theirs"], "ratio": med["ours"] / med["theirs"],
            "ours_cpu_ms": 1e3 * med_cpu["ours"], "hf_cpu_ms": 1e3 * med_cpu["theirs"],
            "cpu_ratio": med_cpu["ours"] / med_cpu["theirs"],
            "ours_peak_mib": peak_tensor_bytes(step_ours, ours) / 2**20,
            "hf_peak_mib": peak_tensor_bytes(step_theirs, theirs) / 2**20,
            "threads": torch.get_num_threads(), "repeats": repeats}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="tiny,mid")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [bench(n, args.repeats) for n in args.configs.split(",")]
    print(f"{'config':6} {'params':>10} {'tokens':>6} {'kltron ms':>10} {'HF ms':>9} {'ratio':>6} "
          f"{'kltron cpu ms':>13} {'HF cpu ms':>9} {'cpu ratio':>9} {'kltron peak MiB':>15} {'HF peak MiB':>11}")
    for r in rows:
        print(f"{r['config']:6} {r['params']:>10,} {r['tokens']:>6} {r['ours_ms']:>10.1f} {r['hf_ms']:>9.1f} "
              f"{r['ratio']:>6.2f} {r['ours_cpu_ms']:>13.1f} {r['hf_cpu_ms']:>9.1f} {r['cpu_ratio']:>9.2f} "
              f"{r['ours_peak_mib']:>15.1f} {r['hf_peak_mib']:>11.1f}")
    print(f"(fp32, CPU, {rows[0]['threads']} threads, median of {args.repeats} interleaved repeats; ms = wall time, "
          "cpu ms = process CPU time (less sensitive to other load on a shared machine); peak = MemTracker "
          "tensor memory during one fwd+bwd)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
