"""What fits: one RL (GRPO) step with long responses on N GPUs, every tp x cp x dp layout, sequence
parallelism on and off, and the two KL paths (the exact fused head; gathered full-vocabulary logits).

    python -m tools.long_fit --model llama3-8b --response 32k,128k --gpus 8 --gpu-gb 80,141 \\
        [--prompt 1024] [--rollout-rows 1] [--cp-impl ulysses] [--usable 0.9] [--markdown OUT.md] [--json OUT.json]

Pure arithmetic on core/runtime/budget.py's `step_budget` (nothing is allocated; runs anywhere). The
step: bf16 compute with fp32 master weights, gradients and AdamW state, FSDP2 over dp x cp, activation
checkpointing, a bf16 reference sharded like the policy, `--rollout-rows` rows generated at once on
each rank (each a KV cache of prompt + response tokens), one row per update micro-batch, the rollout's
hidden states kept (rollout.record_hidden). A layout fits when its peak per rank is at most `--usable`
x the GPU's memory (the rest: CUDA context, communication buffers, allocator fragmentation).
"""

from __future__ import annotations

import argparse
import json
import sys

from core.model_shapes import PRESETS
from core.runtime.budget import Batch, Layout, step_budget
from core.runtime.budget_seq import CP_IMPLS

KL_PATHS = {"fused": "exact fused head", "gather": "gathered logits"}
GIB = 2**30


def parse_tokens(s: str) -> int:
    s = s.strip().lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


def layouts(cfg, gpus: int):
    """(tp, cp, dp) with tp x cp x dp = gpus, tp dividing the heads and dividing or divided by the KV heads."""
    for tp in (d for d in range(1, gpus + 1) if gpus % d == 0):
        if cfg.n_heads % tp or (cfg.n_kv_heads % tp and tp % cfg.n_kv_heads):
            continue
        for cp in (d for d in range(1, gpus // tp + 1) if (gpus // tp) % d == 0):
            yield tp, cp, gpus // (tp * cp)


def plan(cfg, gpus: int, response: int, prompt: int = 1024, rollout_rows: int = 1, cp_impl: str = "ulysses") -> list:
    """One row per (layout, SP, KL path): the budget's peak per rank and its phases, for this response length."""
    rows = []
    batch = Batch(rollout_rows=rollout_rows, update_rows=1, seq_len=prompt + response, response_len=response,
                  rollout_hidden=True)
    for tp, cp, dp in layouts(cfg, gpus):
        for sp in ((False, True) if tp > 1 else (False,)):
            lay = Layout(tp=tp, dp=dp, fsdp=True, compute_dtype="bf16", activation_checkpointing=True, sp=sp, cp=cp,
                         cp_impl=cp_impl)
            for kl in KL_PATHS:
                b = step_budget(cfg, lay, batch, "tp_fsdp" if lay.fsdp_shards > 1 else "tp", kl, ref_dtype="bf16")
                rows.append({"tp": tp, "cp": cp, "dp": dp, "sp": sp, "kl": kl, "response": response,
                             "peak_bytes": b["peak"], "rollout_peak": b["rollout_peak"],
                             "update_peak": b["update_peak"], "experience_peak": b["experience_peak"],
                             "parts": b["parts"]})
    return rows


def table(cfg_name: str, results: dict, gpu_gbs: list, usable: float) -> str:
    """Markdown: one line per (layout, SP, KL path), one column per (response, GPU size): peak GiB, fits or not."""
    cols = [(resp, gb) for resp in results for gb in gpu_gbs]
    head = "| tp | cp | dp | SP | KL path | " + " | ".join(f"{r // 1024}k on {gb} GB" for r, gb in cols) + " |"
    out = [head, "|" + "---|" * 5 + "---:|" * len(cols)]
    first = next(iter(results.values()))
    for i, row in enumerate(first):
        cells = []
        for resp, gb in cols:
            r = results[resp][i]
            ok = r["peak_bytes"] <= usable * gb * 1e9
            cells.append(f"{r['peak_bytes'] / GIB:.1f} {'fits' if ok else 'no'}")
        out.append(f"| {row['tp']} | {row['cp']} | {row['dp']} | {'on' if row['sp'] else 'off'} | "
                   f"{KL_PATHS[row['kl']]} | " + " | ".join(cells) + " |")
    out.append("")
    for resp, gb in cols:
        fit = sorted((r for r in results[resp] if r["peak_bytes"] <= usable * gb * 1e9), key=lambda r: r["peak_bytes"])
        best = ", ".join(f"tp{r['tp']} cp{r['cp']} dp{r['dp']}{' SP' if r['sp'] else ''} {r['kl']}"
                         f" ({r['peak_bytes'] / GIB:.1f} GiB)" for r in fit[:3]) or "nothing"
        out.append(f"- {cfg_name}, {resp // 1024}k-token responses, {gb} GB GPUs: {len(fit)} of "
                   f"{len(results[resp])} fit; lowest peaks: {best}")
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.long_fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(PRESETS), default="llama3-8b")
    ap.add_argument("--response", default="32k,128k", help="response lengths in tokens, e.g. 32k,128k")
    ap.add_argument("--prompt", type=parse_tokens, default=1024)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu-gb", default="80,141", help="memory per GPU in GB (1e9 bytes), e.g. 80,141")
    ap.add_argument("--rollout-rows", type=int, default=1)
    ap.add_argument("--cp-impl", choices=CP_IMPLS, default="ulysses")
    ap.add_argument("--usable", type=float, default=0.9, help="share of the GPU's memory a step may use")
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        responses = [parse_tokens(x) for x in a.response.split(",") if x.strip()]
        gbs = [float(x) if "." in x else int(x) for x in a.gpu_gb.split(",") if x.strip()]
    except ValueError as e:
        ap.error(f"--response / --gpu-gb: {e}")
    if a.gpus < 1 or a.prompt < 1 or a.rollout_rows < 1 or not responses or min(responses) < 1 or not gbs:
        ap.error("--gpus, --prompt, --rollout-rows and every --response must be positive")
    if not 0 < a.usable <= 1:
        ap.error(f"--usable must be in (0, 1], got {a.usable}")
    cfg = PRESETS[a.model]
    results = {r: plan(cfg, a.gpus, r, a.prompt, a.rollout_rows, a.cp_impl) for r in responses}
    text = table(a.model, results, gbs, a.usable)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({str(r): rows for r, rows in results.items()}, f, indent=1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
