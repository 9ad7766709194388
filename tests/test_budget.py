"""core/runtime/budget.py against MemTracker: the budget's parts add up to the measured peak of the policy's
update pass and the reference's pass of a tiny GRPO step (bench/bench_rl_step.py) within 15%."""

import pytest

from bench import bench_rl_step as bench
from core.config import ModelConfig
from core.runtime.budget import Batch, Layout, param_counts, rollout_fields, step_budget

SHAPES = {  # one where the parameters dominate, one where the activations do
    "params": bench.BenchConfig(ModelConfig(vocab_size=2048, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                            intermediate_size=32, max_seq_len=32),
                                ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
                                 "algo.epochs=1", "algo.mini_batches=2", "algo.kl_chunk_size=4"]),
    "activations": bench.BenchConfig(ModelConfig(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4,
                                                 n_kv_heads=2, intermediate_size=176, max_seq_len=64),
                                     ["rollout.prompts_per_step=8", "rollout.group_size=4",
                                      "rollout.max_new_tokens=24", "algo.epochs=1", "algo.mini_batches=1",
                                      "algo.kl_chunk_size=64"]),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.slow
def test_budget_adds_up_to_the_measured_peak(shape):
    spec = SHAPES[shape]
    tr = bench.build_trainer(spec, "grpo")
    tr.step(0)  # AdamW state exists from here on
    pol, ref = bench.component_memory(tr, 1)
    cfg = spec.model
    batch = Batch(rollout_rows=0, update_rows=pol["rows"], seq_len=pol["seq_len"],
                  response_len=pol["seq_len"] - tr.make_experience(2).ro.prompt_len, kl_chunk=tr.cfg.algo.kl_chunk_size)
    full = step_budget(cfg, Layout(), batch, placement="tp", kl_method="fused")
    b = full["parts"]
    want = full["update_peak"] - b["reference"]  # the reference is measured in its own pass
    assert b["policy weights"] == pol["param_bytes"]  # exact: counted from the shape
    assert abs(want - pol["peak_total"]) <= 0.15 * pol["peak_total"], (shape, want, pol)
    got = full["reference_forward_peak"]
    assert abs(got - ref["peak_total"]) <= 0.15 * ref["peak_total"], (shape, got, ref)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.slow
def test_rollout_budget_matches_the_allocator_peak(shape):
    """The rollout phase (MemTracker refuses generation's repeated module calls): what one rollout
    allocates above the resident weights, read from the CPU allocator's events, against the budget's
    KV cache + rollout work (prefill of one row per prompt with the shared prefill, or a decode
    position's logits and sampler temporary) within 15%."""
    from bench.bench_budget import rollout_memory

    spec = SHAPES[shape]
    tr = bench.build_trainer(spec, "grpo")
    tr.step(0)
    ro = rollout_memory(tr, 1)
    batch = Batch(rollout_rows=ro["rows"], update_rows=ro["rows"], seq_len=ro["seq_len"],
                  response_len=ro["seq_len"] - ro["prompt_len"], **rollout_fields(tr.cfg.rollout))
    parts = step_budget(spec.model, Layout(), batch, placement="tp", kl_method="fused")["parts"]
    want = parts["rollout KV cache"] + parts["rollout work"] + parts["rollout hidden"]
    assert abs(want - ro["peak_above_start"]) <= 0.15 * ro["peak_above_start"], (shape, want, ro, parts)


def test_param_counts_match_the_built_model():
    from core.model import build_model

    cfg = ModelConfig(vocab_size=131, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2, intermediate_size=48,
                      qkv_bias=True)
    model = build_model(cfg, seed=None, device="meta")
    got = sum(p.numel() for p in model.parameters())
    pc = param_counts(cfg, 1)
    assert got == pc["total"] - 2 * (cfg.padded_vocab_size(1) - cfg.vocab_size) * cfg.hidden_size or got == pc["total"]


def test_projected_peak_bytes_for_an_rl_config():
    from core.config import load_config
    from core.model import build_model
    from core.runtime.budget import projected_peak_bytes
    from rl.config import RLConfig
    from tests.dist import REPO

    path = f"{REPO}/configs/grpo_tiny.yaml"
    cfg = load_config(RLConfig, path, ["parallel.tp=1"])
    n = sum(p.numel() for p in build_model(cfg.model, seed=None, device="meta").parameters())
    out = projected_peak_bytes(cfg, world_size=1, device="cpu")
    assert out["parts"]["policy weights"] >= 4 * n  # fp32 master weights (padding rows included)
    assert out["peak"] >= 4 * 4 * n  # weights + grads + AdamW's two moments, at least
    assert out["placement"] == "tp" and out["layout"].dp == 1
    with pytest.raises(ValueError, match="does not match world_size=3"):
        projected_peak_bytes(load_config(RLConfig, path, ["parallel.tp=2", "parallel.dp=2"]), 3)


@pytest.mark.parametrize("over,deferred", [([], True), (["algo.off_policy.correction=decoupled"], True),
                                           (["algo.off_policy.correction=seq_tis"], False),
                                           (["kl.where=reward", "kl.estimator=k1"], False)])
def test_the_plan_prices_the_old_pass_over_the_rows_the_trainer_runs(over, deferred):
    """The pre-flight plan's old-log-prob pass covers the rows rl/update/step_data.py's ExperienceMaker computes:
    every row but epoch 0's first mini-batch where that mini-batch's old values come from the update, every row
    where something reads them first (a sequence-level correction, the KL in the reward)."""
    import torch

    from core.config import load_config
    from rl.config import RLConfig
    from rl.preflight import memory_plan
    from tests.dist import REPO

    cfg = load_config(RLConfig, f"{REPO}/configs/grpo_tiny.yaml", ["parallel.tp=1", "algo.mini_batches=2", *over])
    b = memory_plan(cfg, cfg.model, 1, torch.device("cpu"))["batch"]
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    old_rows = b.rollout_rows if b.old_rows is None else b.old_rows  # None: every rollout row
    assert b.rollout_rows == rows and old_rows == (rows - rows // 2 if deferred else rows)


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 8])
@pytest.mark.parametrize("exact", [False, True])
def test_budget_of_a_whole_step_with_lora_and_without(lora_rank, exact):
    """projected_peak_bytes against MemTracker's peak of a whole GRPO step (rollout, reference and old
    passes, update) on a model whose activations and KL head matter beside its weights: LoRA with the
    adapters-off reference (frozen base: no base gradients or AdamW state, the adapters' only) and full
    fine-tuning with a separate reference, each within 10%."""
    from bench.bench_lora_memory import JOB, step_peak

    mc = ModelConfig(vocab_size=4096, hidden_size=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=352,
                     max_seq_len=64, bos_id=1, eos_id=2, pad_id=0)
    # the exact KL: the reference's hidden states and head copy are kept through the update
    job = [j for j in JOB if not j.startswith("kl.estimator")] + ["kl.exact=true"] if exact else JOB
    r = step_peak(lora_rank, mc, job)
    assert abs(r["budget_peak"] - r["peak_total"]) <= 0.10 * r["peak_total"], r
