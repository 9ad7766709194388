"""The RL step's memory budget (core/runtime/budget.py): checked against MemTracker at a Qwen2.5-0.5B shape
here, and projected for Llama-3-8B and Llama-3-70B on 8 and 64 GPUs.

    python -m bench.bench_budget check [--json OUT]     # one GRPO step, Qwen2.5-0.5B shape, random weights
    python -m bench.bench_budget project [--report DIR] # stacked budgets, markdown table and PNG

`check`: a GRPO trainer (fp32, CPU, tp = dp = 1) on a model shaped like Qwen2.5-0.5B (H=896, 24
layers, 14 heads / 2 KV heads, intermediate 4864, V=151936, tied embeddings, qkv bias; random
weights) takes one step (so AdamW state exists); then the policy's update forward+backward and the
reference's no-grad pass run alone under MemTracker (bench/bench_rl_step.py's component_memory);
each peak is printed next to the budget's prediction. The rollout (generation calls the model once
per position, which MemTracker refuses) is read from the CPU allocator's events instead
(tools/klcost/cpu_peak.py): what it allocates above the weights, optimizer state and reference
already in memory, which the budget counts exactly from the shapes.
"""

from __future__ import annotations

import argparse
import json
import os

from core.config import ModelConfig
from core.runtime.budget import KL_METHODS, PLACEMENTS, Batch, Layout, rollout_fields, step_budget

QWEN05B = ModelConfig(vocab_size=151936, hidden_size=896, n_layers=24, n_heads=14, n_kv_heads=2,
                      intermediate_size=4864, max_seq_len=64, qkv_bias=True, tie_embeddings=True)
LLAMA8B = ModelConfig(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      intermediate_size=14336, max_seq_len=8192)
LLAMA70B = ModelConfig(vocab_size=128256, hidden_size=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       intermediate_size=28672, max_seq_len=8192)
GB = 1e9


def rollout_memory(tr, step: int) -> dict:
    """The allocator peak of one rollout (generation and scoring) of trainer `tr` above what was live
    before it, and the rows and prompt length it generated."""
    from rl.experience.rollout import collect_rollout
    from tools.klcost.cpu_peak import profiled_peak

    cfg, st = tr.cfg, tr.state
    peak, ro = profiled_peak(lambda: collect_rollout(
        tr.policy, tr.tok, tr.task, tr.reward_fn, cfg.rollout, seed=cfg.train.seed, step=step,
        dp_rank=st.dp_rank, dp_size=st.dims.dp, tp_group=tr.tp_group, dp_group=tr.dp_group, device=st.device,
        world_group=tr.world_group))
    return {"peak_above_start": peak, "rows": ro.sequences.shape[0], "prompt_len": ro.prompt_len,
            "seq_len": ro.sequences.shape[1]}


def check(json_path=None) -> dict:
    import torch

    from bench import bench_rl_step as bench

    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    spec = bench.BenchConfig(QWEN05B, ["rollout.prompts_per_step=2", "rollout.group_size=2",
                                       "rollout.max_new_tokens=16", "algo.epochs=1", "algo.mini_batches=1"])
    tr = bench.build_trainer(spec, "grpo")
    tr.step(0)
    pol, ref = bench.component_memory(tr, 2)
    P = tr.make_experience(3).ro.prompt_len
    batch = Batch(rollout_rows=pol["rows"], update_rows=pol["rows"], seq_len=pol["seq_len"],
                  response_len=pol["seq_len"] - P, kl_chunk=tr.cfg.algo.kl_chunk_size,
                  **rollout_fields(tr.cfg.rollout))
    b = step_budget(QWEN05B, Layout(), batch, placement="tp", kl_method="fused")
    parts = b["parts"]
    ro = rollout_memory(tr, 2)
    ro_batch = Batch(rollout_rows=ro["rows"], update_rows=ro["rows"], seq_len=ro["seq_len"],
                     response_len=ro["seq_len"] - ro["prompt_len"], **rollout_fields(tr.cfg.rollout))
    rb = step_budget(QWEN05B, Layout(), ro_batch, placement="tp", kl_method="fused")
    resident = rb["parts"]["policy weights"] + rb["parts"]["AdamW state"] + rb["parts"]["reference"]
    rows = [("policy update forward+backward", pol["peak_total"], b["update_peak"] - parts["reference"]),
            ("reference forward (no grad)", ref["peak_total"], b["reference_forward_peak"]),
            ("rollout (generation)", resident + ro["peak_above_start"], rb["rollout_peak"])]
    print(f"Qwen2.5-0.5B shape, random weights, GRPO, {pol['rows']} rows x {pol['seq_len']} tokens, fp32 CPU")
    print("| phase | measured peak GB | budget GB | budget / measured |\n|---|---:|---:|---:|")
    for name, got, want in rows:
        print(f"| {name} | {got / GB:.3f} | {want / GB:.3f} | {want / got:.3f} |")
    print("budget parts (GB): " + ", ".join(f"{k} {v / GB:.3f}" for k, v in parts.items()))
    cats = ("peak_param", "peak_grad", "peak_opt", "peak_act", "peak_temp", "peak_other")
    for name, m in (("policy", pol), ("reference", ref)):
        print(f"measured {name} by MemTracker category (GB): " + ", ".join(f"{c[5:]} {m[c] / GB:.3f}" for c in cats))
    print(f"rollout: allocated {ro['peak_above_start'] / GB:.4f} GB above the resident weights, optimizer and "
          f"reference; budget KV cache {rb['parts']['rollout KV cache'] / GB:.4f} + rollout work "
          f"{rb['parts']['rollout work'] / GB:.4f} GB")
    out = {"rows": [dict(phase=n, measured=g, budget=w) for n, g, w in rows], "parts": parts,
           "measured": {"policy": pol, "reference": ref, "rollout": ro}}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def projections():
    """(label, budget) for 8B and 70B on 8 and 64 GPUs, bf16, 8k update tokens per rank."""
    out = []
    batch = Batch(rollout_rows=64, update_rows=4, seq_len=2048, response_len=1536)  # kl_chunk: auto
    for name, cfg, layouts in (("8B", LLAMA8B, [(1, 8), (8, 1), (8, 8)]), ("70B", LLAMA70B, [(8, 1), (8, 8)])):
        for tp, dp in layouts:
            for ac in (False, True):
                for placement in PLACEMENTS:
                    for kl in KL_METHODS:
                        lay = Layout(tp=tp, dp=dp, fsdp=True, compute_dtype="bf16", activation_checkpointing=ac)
                        label = f"{name} tp{tp}xdp{dp}{' AC' if ac else ''} ref={placement} kl={kl}"
                        # the policy's base as reference exists with LoRA only: rank 16 on every projection
                        lora = dict(lora_rank=16) if placement == "policy_base" else {}
                        out.append((label, dict(model=name, tp=tp, dp=dp, ac=ac, placement=placement, kl=kl,
                                                **step_budget(cfg, lay, batch, placement, kl, **lora))))
    return out


def project(report=None) -> str:
    rows = projections()
    lines = ["8k update tokens per rank (4 rows x 2048, 1536 response), 64 rollout rows x 2048 in the KV cache, "
             "bf16 compute, fp32 master weights / grads / AdamW, FSDP over dp", "",
             "| model | tp x dp | AC | reference | KL | weights | grads | AdamW | acts | KL head | KV cache "
             "| rollout work | ref | peak GB | fits 80 | fits 141 |",
             "|---|---|---|---|---|" + "---:|" * 9 + "---|---|"]
    for _, b in rows:
        p = {k: v / GB for k, v in b["parts"].items()}
        acts = p["activations"] + p["sequence activations"] + p["CP attention"]
        lines.append(f"| {b['model']} | {b['tp']}x{b['dp']} | {'on' if b['ac'] else 'off'} | {b['placement']} "
                     f"| {b['kl']} | {p['policy weights']:.1f} | {p['gradients']:.1f} | {p['AdamW state']:.1f} "
                     f"| {acts:.1f} | {p['KL head']:.1f} | {p['rollout KV cache']:.1f} "
                     f"| {p['rollout work']:.1f} | {p['reference']:.1f} | {b['peak'] / GB:.1f} "
                     f"| {'yes' if b['peak'] <= 80 * GB else 'no'} "
                     f"| {'yes' if b['peak'] <= 141 * GB else 'no'} |")
    text = "\n".join(lines)
    print(text)
    if report:
        from tools.klcost.report import atomic_write, plot_budget

        os.makedirs(report, exist_ok=True)
        atomic_write(os.path.join(report, "budget.md"), text + "\n")
        pick = [(lab, b) for lab, b in rows if b["ac"] and (b["kl"] != "vp_materialized")
                and b["placement"] in ("tp", "tp_fsdp") and (b["model"], b["tp"], b["dp"]) in
                {("8B", 1, 8), ("70B", 8, 1), ("70B", 8, 8)}]
        plot_budget(pick, os.path.join(report, "budget.png"), "RL step memory per rank (projected, AC on)")
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["check", "project"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", default=None)
    a = ap.parse_args(argv)
    return check(a.json) if a.what == "check" else project(a.report)


if __name__ == "__main__":
    main()
