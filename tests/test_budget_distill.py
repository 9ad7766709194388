"""The memory budget of a distillation step (core/runtime/budget.py's add_teacher, rl/preflight.py's
planned_teacher) against MemTracker's peak of a whole measured step (rollout, teacher / reference and old
passes, update) on a model whose activations and heads matter beside its weights, the heads over the
model's full vocabulary (bench/bench_lora_memory.py's step tracker and FullVocabTokenizer)."""

import gc
from dataclasses import replace

import pytest
import torch

from core.config import ModelConfig, load_config
from core.model import build_model
from core.runtime.budget import projected_peak_bytes
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel
from rl.config import RLConfig
from rl.distill.config import teacher_is_reference

STUDENT = ModelConfig(vocab_size=4096, hidden_size=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=352,
                      max_seq_len=64, bos_id=1, eos_id=2, pad_id=0)
TEACHER = replace(STUDENT, hidden_size=192, n_layers=3, n_heads=6, n_kv_heads=2, intermediate_size=512)
JOB = ["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=32", "rollout.min_new_tokens=32",
       "algo.epochs=1", "algo.mini_batches=2", "reward.task_args={max_operand: 99999, ops: '+'}",
       "teacher.checkpoint=seeded-in-process"]


def distill_step_peak(overrides) -> dict:
    """MemTracker's peak of the second step of a distillation job, and the budget's projection at its shape."""
    from bench.bench_lora_memory import FullVocabTokenizer, _step_tracker
    from bench.bench_rl_step import COMMON
    from rl.train import assemble

    cfg = load_config(RLConfig, None, COMMON + JOB + list(overrides))
    state = init_parallel(ParallelDims(1, 1), "cpu", STUDENT.n_heads, STUDENT.n_kv_heads)
    torch.manual_seed(0)
    policy, teacher = build_model(STUDENT, seed=11), build_model(TEACHER, seed=29)
    ref = None if teacher_is_reference(cfg) else build_model(STUDENT, seed=11)
    tr = assemble(cfg, state, STUDENT, FullVocabTokenizer(load_tokenizer(None), STUDENT.vocab_size), policy, ref,
                  teacher=teacher)
    tr.step(0)
    gc.collect()
    models = [m for m in (tr.policy, tr.ref, tr.teacher) if m is not None]
    mt = _step_tracker([p for m in models for p in m.parameters() if not p.requires_grad])
    mt.track_external(*models, tr.opt.opt)
    with mt:
        tr.step(1)
    peak = sum(d["Total"] for d in mt.get_tracker_snapshot("peak").values())
    seq_len = tr.make_experience(2).ro.sequences.shape[1]
    plan = projected_peak_bytes(replace(tr.cfg, model=replace(STUDENT, max_seq_len=seq_len)), 1, "cpu",
                                teacher=TEACHER, teacher_is_reference=teacher_is_reference(tr.cfg))
    return {"peak": peak, "budget": plan["peak"], "plan": plan}


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["algo.name=distill", "distill.loss=jsd", "kl_ctl.mode=fixed", "kl_ctl.beta=0.0"],
    ["algo.name=grpo", "kl.estimator=k3+", "kl.where=loss", "distill.coef=0.5", "distill.loss=topk_forward_kl"]])
def test_budget_of_a_whole_distillation_step(overrides):
    """Pure distillation (the teacher, 1.5x wide and deep, stands in for the reference) and GRPO with a k3 KL to
    a separate reference and a distillation term (three models): the budget within 10% of the measured peak
    (measured 1-3% below it: rollout, experience and update phases each within 2% for the first)."""
    r = distill_step_peak(overrides)
    assert abs(r["budget"] - r["peak"]) <= 0.10 * r["peak"], {k: r[k] for k in ("peak", "budget")}


def update_peak(overrides) -> int:
    """MemTracker's peak of one update (bytes above the models, AdamW state and the step's data, which it
    registers first), on a rollout of the same seed in every call; the teacher of the policy's shape."""
    from bench.bench_lora_memory import FullVocabTokenizer, _step_tracker
    from bench.bench_rl_step import COMMON
    from rl.train import assemble

    cfg = load_config(RLConfig, None, COMMON + JOB + list(overrides))
    state = init_parallel(ParallelDims(1, 1), "cpu", STUDENT.n_heads, STUDENT.n_kv_heads)
    torch.manual_seed(0)
    policy = build_model(STUDENT, seed=11)
    teacher = build_model(STUDENT, seed=29) if cfg.distill.coef or cfg.algo.name == "distill" else None
    ref = None if teacher is not None and teacher_is_reference(cfg) else build_model(STUDENT, seed=11)
    tr = assemble(cfg, state, STUDENT, FullVocabTokenizer(load_tokenizer(None), STUDENT.vocab_size), policy, ref,
                  teacher=teacher)
    tr.step(0)
    d = tr.make_experience(1)
    models = list({id(m): m for m in (tr.policy, tr.ref, tr.teacher) if m is not None}.values())
    held = [t for t in (d.ref_hidden, d.ref_weight, d.teacher_hidden, d.teacher_weight) if t is not None]
    gc.collect()
    mt = _step_tracker([p for m in models for p in m.parameters() if not p.requires_grad])
    mt.track_external(*models, tr.opt.opt, *held)
    total = lambda snap: sum(v["Total"] for v in snap.values())  # noqa: E731
    with mt:
        base = total(mt.get_tracker_snapshot("current"))
        tr.update(d, 1)
    return int(total(mt.get_tracker_snapshot("peak")) - base)


@pytest.mark.slow
def test_distillation_update_memory_against_grpo_exact_kl():
    """The JSD and the top-k term inside the loss-inside head: one update's memory (the same model, batch and
    seed) at most 1.1x GRPO's with the exact reference KL; as a second head call the JSD's second fp32
    weight-gradient buffer [4096, 128] (2 MiB) and autograd's sum with the first made it 1.31x (now 1.03x)."""
    grpo = update_peak(["algo.name=grpo", "kl.exact=true", "kl.where=loss", "kl_ctl.mode=fixed", "kl_ctl.beta=0.02"])
    for loss in ("jsd", "topk_forward_kl"):
        got = update_peak(["algo.name=distill", f"distill.loss={loss}", "kl_ctl.mode=fixed", "kl_ctl.beta=0.0"])
        assert got <= 1.10 * grpo, (loss, got, grpo, got / grpo)
