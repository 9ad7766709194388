"""A distillation step against a GRPO step with the exact reference KL, on the same model and batch, side by
side in one process (tp = dp = 1, fp32, CPU): step time and the tracked peak memory of the step's work
after the rollout (reference / teacher / old passes, advantages, the update).

    python -m bench.bench_distill [--steps 5] [--json OUT] [--vocab full|tokenizer]

`--steps 0`: the memory only (one warm-up step per row, then the tracked peak). The heads run over the
model's full vocabulary (32000 rows: bench/bench_lora_memory.py's FullVocabTokenizer); `--vocab tokenizer`
gives the shipped 256-piece tokenizer's vocabulary instead (the heads then cover 256 rows only, as in the
measurements made before this option existed).

Rows (the policy, its batch and its seed identical in all):
  grpo_exact_kl      algo.name=grpo, the exact KL(pi || ref) in the loss (kl.exact=true), beta 0.02
  distill            algo.name=distill, exact reverse KL(student || teacher) from the fused heads; the teacher
                     has the policy's shape (another seed): the same parameter bytes as the reference
  distill_jsd        the same with distill.loss=jsd (two forward passes over the vocabulary instead of one)
  grpo_distill_kl    GRPO + exact reference KL + distill.coef=1: both heads' terms
  distill_wide       distill with a teacher of 2x the hidden width and 2x the layers (its parameters add)

Time: the median over `--steps` steps after one warm-up step (the rows' steps interleaved) of the whole step
(`step_s`) and of the step without its rollout (`post_rollout_s`: the same sampling in every row).
Memory: MemTracker's peak of everything it tracks (models, optimizer state, activations, temporaries) over
the post-rollout work on one step's rollout, after the timed steps (AdamW's state exists): the larger of two
tracked peaks, the experience passes' and the update's (with the step's data tensors registered, since they
are alive during the update).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from bench.bench_lora_memory import FullVocabTokenizer
from bench.bench_rl_step import REWARD, WideVocabTokenizer, tracked_peak
from core.config import ModelConfig, load_config
from core.model import build_model
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel
from rl.config import RLConfig
from rl.distill.config import teacher_is_reference
from rl.train import assemble

MODEL = ModelConfig(vocab_size=32000, hidden_size=256, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=704,
                    max_seq_len=128)
WIDE = ModelConfig(vocab_size=32000, hidden_size=512, n_layers=8, n_heads=8, n_kv_heads=4, intermediate_size=1408,
                   max_seq_len=128)
COMMON = ["reward.use_task_reward=false", f"reward.fns=[{REWARD}]", "train.progress=false", "train.steps=100",
          "optim.lr=1e-4", "optim.warmup_steps=0", "train.seed=1234", "rollout.prompts_per_step=4",
          "rollout.group_size=4", "rollout.max_new_tokens=32", "rollout.eval_every=0", "algo.epochs=1",
          "algo.mini_batches=1", "algo.share_prompts=false", "reward.task_args={max_operand: 99999, ops: '+'}"]
ROWS = {
    "grpo_exact_kl": (["algo.name=grpo", "kl.exact=true", "kl.where=loss", "kl_ctl.mode=fixed", "kl_ctl.beta=0.02"],
                      None),
    "distill": (["algo.name=distill", "kl_ctl.mode=fixed", "kl_ctl.beta=0.0"], MODEL),
    "distill_jsd": (["algo.name=distill", "distill.loss=jsd", "kl_ctl.mode=fixed", "kl_ctl.beta=0.0"], MODEL),
    "grpo_distill_kl": (["algo.name=grpo", "kl.exact=true", "kl.where=loss", "kl_ctl.mode=fixed", "kl_ctl.beta=0.02",
                         "distill.coef=1.0"], MODEL),
    "distill_wide": (["algo.name=distill", "kl_ctl.mode=fixed", "kl_ctl.beta=0.0"], WIDE),
}


def build(overrides: list, teacher_cfg: ModelConfig | None, full_vocab: bool = True):
    extra = [] if teacher_cfg is None else ["teacher.checkpoint=seeded-in-process"]
    cfg = load_config(RLConfig, None, COMMON + overrides + extra)
    state = init_parallel(ParallelDims(1, 1), "cpu", MODEL.n_heads, MODEL.n_kv_heads)
    policy = build_model(MODEL, seed=11)
    teacher = None if teacher_cfg is None else build_model(teacher_cfg, seed=29)
    ref = None if teacher_is_reference(cfg) else build_model(MODEL, seed=11)  # as rl.train.build loads them
    inner = load_tokenizer(None)
    tok = FullVocabTokenizer(inner, MODEL.vocab_size) if full_vocab else WideVocabTokenizer(inner)
    return assemble(cfg, state, MODEL, tok, policy, ref, teacher=teacher)


def post_rollout_peak(tr, step: int) -> int:
    """Tracked peak (bytes) of make_experience's passes and the update on one rollout."""
    inner = tr.experience.make_experience
    grabbed = {}
    tr.experience.make_experience = lambda ro, s: grabbed.setdefault("ro", ro)
    try:
        tr.make_experience(step)  # the rollout only
    finally:
        tr.experience.make_experience = inner
    models = list({id(m): m for m in (tr.policy, tr.ref, tr.teacher) if m is not None}.values())
    frozen = [p for m in models for p in m.parameters() if not p.requires_grad]
    for p in frozen:  # MemTracker hooks the parameters of modules it sees run; the passes stay no-grad
        p.requires_grad_(True)

    out = {}
    try:  # two trackers: MemTracker keeps per-module state that a second forward of a module would confuse
        exp = tracked_peak(lambda mt: out.setdefault("data", inner(grabbed["ro"], step)), *models, tr.opt.opt)
        d = out["data"]
        held = [t for t in (d.ref_hidden, d.ref_weight, d.teacher_hidden, d.teacher_weight, d.old_logp, d.ref_logp,
                            d.kl, d.entropy, d.advantages, d.ro.sequences, d.ro.rollout_hidden) if t is not None]
        upd = tracked_peak(lambda mt: tr.update(d, step), *models, tr.opt.opt, *held)
    finally:
        for p in frozen:
            p.requires_grad_(False)
    return int(max(exp["Total"], upd["Total"]))


def bench_rows(names: list, steps: int, log=print, full_vocab: bool = True) -> list[dict]:
    """All rows' trainers built first, then their steps interleaved (step s of every row, then s + 1): on a
    machine shared with other jobs the load falls on every row alike. `steps` 0: the memory only (one
    warm-up step, then the tracked peak)."""
    trainers = {}
    for name in names:
        overrides, teacher_cfg = ROWS[name]
        torch.manual_seed(0)
        trainers[name] = build(overrides, teacher_cfg, full_vocab)
        trainers[name].step(0)  # warm-up
    recs = {name: [] for name in names}
    for s in range(1, steps + 1):
        for name in names:
            recs[name].append(trainers[name].step(s))
    rows = []
    for name in names:
        row = {"row": name, "peak_bytes": post_rollout_peak(trainers[name], steps + 1)}
        if steps:
            med = lambda f, rs=recs[name]: statistics.median(f(r) for r in rs)  # noqa: E731
            row.update(step_s=med(lambda r: r["step_time_s"]),
                       post_rollout_s=med(lambda r: r["step_time_s"] - r["time_rollout_s"]),
                       response_tokens=med(lambda r: r["response_len"] * r["samples"]))
            log(f"{name:16s} step {row['step_s']:.3f} s  post-rollout {row['post_rollout_s']:.3f} s  "
                f"peak {row['peak_bytes'] / 2**20:.1f} MiB  tokens {row['response_tokens']:.0f}")
        else:
            log(f"{name:16s} peak {row['peak_bytes'] / 2**20:.1f} MiB")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--vocab", choices=("full", "tokenizer"), default="full",
                    help="the heads over the model's 32000 rows (default), or the shipped tokenizer's 256")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = bench_rows(args.rows.split(","), args.steps, full_vocab=args.vocab == "full")
    base = next((r for r in rows if r["row"] == "grpo_exact_kl"), None)
    if base is not None:
        for r in rows:
            r["memory_ratio"] = r["peak_bytes"] / base["peak_bytes"]
            if args.steps:
                r["time_ratio"] = r["step_s"] / base["step_s"]
                r["post_rollout_ratio"] = r["post_rollout_s"] / base["post_rollout_s"]
                print(f"{r['row']:16s} time x{r['time_ratio']:.2f} (post-rollout x{r['post_rollout_ratio']:.2f})  "
                      f"memory x{r['memory_ratio']:.3f}")
            else:
                print(f"{r['row']:16s} memory x{r['memory_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": MODEL.__dict__, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
