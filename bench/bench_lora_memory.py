"""Peak tensor memory of a whole RL step (GRPO): LoRA with the adapters-off reference against full
fine-tuning with a separate reference. One process, fp32, CPU, the 58.5M model.

    python -m bench.bench_lora_memory [--rank 16] [--json OUT]

Each side: a seeded trainer runs one warm-up step (so AdamW state exists), then step 1 runs under
torch.distributed._tools.mem_tracker.MemTracker with the policy, the reference (full side) and the
optimizer registered with `track_external`: the peak counts every weight, gradient, optimizer state,
activation and temporary the step holds at its high-water mark (rollout, reference and old log-probs,
the update).
"""

from __future__ import annotations

import argparse
import gc
import json
from dataclasses import replace

import torch

from bench.bench_rl_step import COMMON, WideVocabTokenizer
from bench.bench_rl_vs_trl import SIZES
from core.config import load_config
from core.model import build_model
from core.runtime.budget import projected_peak_bytes
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel
from rl.config import RLConfig
from rl.train import assemble

JOB = ["algo.name=grpo", "kl.estimator=k3+", "kl.where=loss", "rollout.prompts_per_step=2", "rollout.group_size=4",
       "rollout.max_new_tokens=32", "rollout.min_new_tokens=32", "algo.epochs=1", "algo.mini_batches=2",
       "reward.task_args={max_operand: 99999, ops: '+'}"]


class FullVocabTokenizer(WideVocabTokenizer):
    """WideVocabTokenizer whose vocabulary is the model's (32000): the trainer's heads then run over every
    row of the head weight, as with a real tokenizer of that size (with the shipped 256-piece tokenizer the
    heads would cover 256 rows only, and the KL head's memory would be that of a tiny vocabulary)."""

    def __init__(self, inner, vocab_size: int):
        super().__init__(inner)
        self.vocab_size = vocab_size


def build(lora_rank: int, mc=None, job=None):
    """The trainer of one side: `mc` the model (default the 58.5M bench model), `job` the overrides (JOB)."""
    extra = [f"lora.rank={lora_rank}", f"lora.alpha={2 * lora_rank}"] if lora_rank else []
    cfg = load_config(RLConfig, None, COMMON + (JOB if job is None else job) + extra)
    mc = mc or SIZES["60m"]
    state = init_parallel(ParallelDims(1, 1), "cpu", mc.n_heads, mc.n_kv_heads)
    policy = build_model(mc, seed=11)
    ref = None if cfg.reference.from_policy_base else build_model(mc, seed=11)
    return assemble(cfg, state, mc, FullVocabTokenizer(load_tokenizer(None), mc.vocab_size), policy, ref)


class _NoHook:
    def remove(self) -> None:
        pass


def _step_tracker(frozen):
    """MemTracker that accepts the step's many root forwards (every decoding step, each pass): its
    per-module statistics are cleared before a root module runs again; the device peak is kept.
    `frozen` parameters get no gradient hook (MemTracker would try to hook them and fail; they have
    no gradient to count)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # a root module called again: a new iteration for MemTracker
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

        # a module whose statistics were cleared: its per-module numbers are lost, the device peak is not
        def _post_fw_hook(self, module, inputs, outputs):
            if module in self.memory_tracking:
                super()._post_fw_hook(module, inputs, outputs)

        def _pre_bw_hook(self, module, args):
            if module in self.memory_tracking:
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module, args):
            if module in self.memory_tracking:
                super()._post_bw_hook(module, args)

    mt = StepMemTracker()
    for p in frozen:
        mt._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    return mt


def step_peak(lora_rank: int, mc=None, job=None) -> dict:
    """MemTracker's peak of a whole step (the second) of one side, with the budget's projection at its shape."""
    tr = build(lora_rank, mc, job)
    tr.step(0)
    gc.collect()
    models = [tr.policy] + ([] if tr.cfg.reference.from_policy_base else [tr.ref])
    mt = _step_tracker([p for m in models for p in m.parameters() if not p.requires_grad])
    mt.track_external(*models, tr.opt.opt)
    with mt:
        tr.step(1)
    peak: dict = {}
    for d in mt.get_tracker_snapshot("peak").values():
        for k, v in d.items():  # keys: "Total" and the _MemRefType members (PARAM, GRAD, OPT, ACT, TEMP, ...)
            k = str(k).split(".")[-1]
            peak[k] = peak.get(k, 0) + v
    # the budget (core/runtime/budget.py) at the step's shape: its rows are prompt + max_new_tokens long
    # (min_new_tokens = max_new_tokens: every response runs to the end, the budget's worst case)
    seq_len = tr.make_experience(2).ro.sequences.shape[1]
    budget = projected_peak_bytes(replace(tr.cfg, model=replace(tr.policy.cfg, max_seq_len=seq_len)), 1, "cpu")
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {"lora_rank": lora_rank, "peak_total": peak["Total"], "budget_peak": budget["peak"], "seq_len": seq_len,
            **{f"peak_{k}": v for k, v in peak.items()},
            "policy_param_bytes": nbytes(tr.policy.parameters()),
            "trainable_param_bytes": nbytes(p for p in tr.policy.parameters() if p.requires_grad),
            "reference_param_bytes": 0 if tr.cfg.reference.from_policy_base else nbytes(tr.ref.parameters()),
            "opt_state_bytes": nbytes(v for s in tr.opt.opt.state.values() for v in s.values() if torch.is_tensor(v))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    full, lora = step_peak(0), step_peak(a.rank)
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print("| side | step peak MiB | params | grads | optimizer state | activations+temps | ref weights |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    sides = (("full fine-tuning + separate reference", full), (f"LoRA r={a.rank}, adapters-off reference", lora))
    for name, r in sides:
        act = r.get("peak_ACT", 0) + r.get("peak_TEMP", 0)
        print(f"| {name} | {mib(r['peak_total'])} | {mib(r.get('peak_PARAM', 0))} | "
              f"{mib(r.get('peak_GRAD', 0))} | {mib(r.get('peak_OPT', 0))} | {mib(act)} | "
              f"{mib(r['reference_param_bytes'])} |")
    ratio = lora["peak_total"] / full["peak_total"]
    print(f"LoRA / full step peak: {ratio:.3f}")
    for name, r in sides:
        print(f"{name}: budget {mib(r['budget_peak'])} MiB / measured {mib(r['peak_total'])} MiB = "
              f"{r['budget_peak'] / r['peak_total']:.3f} (rows of {r['seq_len']} tokens)")
    out = {"full": full, "lora": lora, "ratio": ratio}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
