"""bf16 compute with fp32 master weights (single process / TP: autocast over the fp32 weights),
the bf16 reference with an fp32 KL path, the bf16 KV cache, and per-phase peak memory.

Tolerances: bf16 keeps 8 significant bits (unit roundoff 2**-9 ~ 2e-3 per rounding). Losses and
KLs here are means over hundreds of tokens, reduced in fp32, so independent roundings average out;
we allow 1e-2 relative (5x one rounding) between a bf16 and an fp32 run of the same steps, which
a run that silently computed in fp32 would also meet, so separate checks prove the bf16 compute
(Linear outputs are bf16) and the fp32 master weights and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from core.config import ModelConfig, SFTConfig, load_config
from core.model import KVCache, build_model
from parallel.fused import fused_head
from tests.test_rl_trainer import GRPO, _trainer

MC = ModelConfig(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                 max_seq_len=64)


def _linear_output_dtypes(model, ids, **kw):
    seen = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
             for m in model.modules() if type(m).__name__ in ("ColumnParallelLinear", "RowParallelLinear")]
    out = model(ids, **kw)
    for h in hooks:
        h.remove()
    return seen, out


def test_bf16_forward_backward_keeps_fp32_master_weights_and_grads():
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 16))
    ref = build_model(MC, seed=3)
    model = build_model(MC, seed=3).set_mixed_precision("bf16")
    dtypes, logits = _linear_output_dtypes(model, ids)
    assert dtypes == {torch.bfloat16}, "the projections must compute in bf16"
    dtypes32, logits32 = _linear_output_dtypes(ref, ids)
    assert dtypes32 == {torch.float32}
    torch.testing.assert_close(logits.float(), logits32, atol=3e-2, rtol=3e-2)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1)[:, :256], ids.flatten())
    loss.backward()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, n
    assert model.activation_dtype == torch.bfloat16 and ref.activation_dtype == torch.float32


def test_fused_head_under_bf16_model_returns_fp32_matching_float64():
    """The KL path: policy fp32, reference in bf16 weights; the fused head's outputs are fp32 and
    equal a float64 computation on the same (bf16-rounded) operands."""
    torch.manual_seed(1)
    T, H, V = 24, 32, 64
    h, w = torch.randn(T, H), torch.randn(V, H) * 0.3
    rh, rw = torch.randn(T, H).bfloat16(), (torch.randn(V, H) * 0.3).bfloat16()
    tgt = torch.randint(0, V, (T,))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a caller's autocast must not round the logits
        out = fused_head(h.bfloat16(), w.bfloat16(), tgt, ref_hidden=rh, ref_weight_local=rw, kl="forward",
                         chunk_size=8)
    assert out.kl.dtype == torch.float32 and out.logprobs.dtype == torch.float32
    lp = torch.log_softmax(h.bfloat16().double() @ w.bfloat16().double().T, -1)
    lq = torch.log_softmax(rh.double() @ rw.double().T, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    torch.testing.assert_close(out.kl.double(), kl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logprobs.double(), lp.gather(1, tgt[:, None])[:, 0], atol=1e-5, rtol=1e-5)


def test_generate_keeps_a_bf16_kv_cache(monkeypatch):
    from core.generation import generate as gen

    made = []
    orig = KVCache.empty

    def spy(*a, **kw):
        c = orig(*a, **kw)
        made.append(c.k[0].dtype)
        return c
    monkeypatch.setattr(gen.KVCache, "empty", spy)
    model = build_model(MC, seed=5).set_mixed_precision("bf16")
    ids = torch.randint(3, 200, (2, 5))
    out = gen.generate(model, ids, torch.ones_like(ids), max_new_tokens=4, eos_id=None, pad_id=0, temperature=0.0)
    assert made == [torch.bfloat16] and out.sequences.shape == (2, 9)


def _sft_losses(tmp_path, key: str, values, steps: int) -> dict:
    """{value: the tiny SFT run's per-step losses with `key=value`} (same seed, data and model)."""
    from core.sft import train

    out = {}
    for v in values:
        cfg = load_config(SFTConfig, "configs/sft_tiny.yaml",
                          [f"{key}={v}", f"train.steps={steps}", "train.progress=false",
                           f"train.out_dir={tmp_path / v}", "model.hidden_size=32", "model.intermediate_size=64"])
        out[v] = train(cfg)["losses"]
    return out


def test_bf16_sft_run_is_close_to_fp32(tmp_path):

    losses = _sft_losses(tmp_path, "parallel.mixed_precision", ("fp32", "bf16"), steps=12)
    assert all(math.isfinite(x) for x in losses["bf16"])
    for a, b in zip(losses["fp32"], losses["bf16"]):
        assert b == pytest.approx(a, rel=1e-2)
    assert losses["bf16"][-1] < losses["bf16"][0] - 0.2


@pytest.mark.slow
def test_bf16_grpo_steps_with_bf16_reference_close_to_fp32():
    torch.set_num_threads(1)
    recs = {}
    for name, ov in (("fp32", []), ("bf16", ["parallel.mixed_precision=bf16", "reference.dtype=bf16"])):
        trainer, _ = _trainer(1, 1, GRPO + ov)
        recs[name] = [trainer.step(s) for s in range(2)]
        if name == "bf16":
            assert all(p.dtype == torch.float32 for p in trainer.policy.parameters()), "master weights fp32"
            assert all(p.dtype == torch.bfloat16 for p in trainer.ref.parameters()), "reference in bf16"
            assert trainer.ref.inv_freq.dtype == torch.float32, "rotary frequencies stay fp32"
            assert trainer.policy.compute_dtype == torch.bfloat16
    for a, b in zip(recs["fp32"], recs["bf16"]):
        for k in ("reward_mean", "entropy", "pg_loss", "grad_norm"):
            assert math.isfinite(b[k]), k
        # same rollouts (the sampler's noise is keyed; bf16 logits can flip a near-tie, hence the tolerance)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=2e-2), (a["entropy"], b["entropy"])
        assert b["kl_mean"] == pytest.approx(a["kl_mean"], abs=2e-2)
    for k in ("peak_mem_rollout_bytes", "peak_mem_ref_bytes", "peak_mem_old_bytes", "peak_mem_update_bytes"):
        assert recs["bf16"][0][k] > 0, k
    assert recs["bf16"][0]["peak_mem_phase_kind"] in ("cpu_rss_hwm", "cpu_max_rss")
    assert recs["bf16"][0]["peak_mem_bytes"] >= max(recs["bf16"][0][f"peak_mem_{k}_bytes"]
                                                   for k in ("rollout", "ref", "old", "update"))


@pytest.mark.slow
def test_compiled_blocks_match_eager_and_decoding_stays_eager():
    from core.generation.generate import generate

    torch.manual_seed(2)
    ids = torch.randint(3, 200, (2, 12))
    model = build_model(MC, seed=7)
    with torch.no_grad():
        eager = model(ids)
        greedy = generate(model, ids[:, :5], torch.ones(2, 5, dtype=torch.long), max_new_tokens=4, eos_id=None,
                          pad_id=0, temperature=0.0).sequences
    model.compile_blocks()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), eager, atol=1e-5, rtol=1e-5)
        again = generate(model, ids[:, :5], torch.ones(2, 5, dtype=torch.long), max_new_tokens=4, eos_id=None,
                         pad_id=0, temperature=0.0).sequences
    assert torch.equal(again, greedy)
    assert not any(n.startswith("_compiled") or "_orig_mod" in n for n, _ in model.named_parameters()), \
        "compiling must not rename parameters (checkpoints)"


@pytest.mark.slow
def test_sft_train_compile_matches_eager(tmp_path):

    losses = _sft_losses(tmp_path, "train.compile", ("false", "true"), steps=3)
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)
