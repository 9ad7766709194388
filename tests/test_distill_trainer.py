"""Distillation in the RL trainer: a teacher of another width beside a tiny student. The step's
distillation loss equals the per-token divergence recomputed here from full float64 logits of both
models (the policy before the update); the sampled baseline's advantages are -(log s - log t) of the
sampled tokens recomputed the same way; a tokenizer or vocabulary mismatch is refused naming both
checkpoints."""

import pytest
import torch

import core.ckpt as ckpt
from core.config import ConfigError, ModelConfig, load_config
from core.model import build_model
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel, kv_replica_group
from rl.config import RLConfig
from rl.distill.config import teacher_is_reference
from rl.distill.teacher import teacher_model_config

STUDENT = dict(vocab_size=256, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
               max_seq_len=64)
TEACHER = dict(STUDENT, hidden_size=48, n_layers=3, n_heads=6, n_kv_heads=2, intermediate_size=96)
BASE = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=5", "train.steps=2",
        "reward.use_task_reward=false", "reward.fns=[tests.reward_plugins:digits_over_6]", "optim.lr=1e-2",
        "optim.warmup_steps=0", "kl_ctl.beta=0.0", "train.progress=false", "rollout.eval_every=0",
        "teacher.checkpoint=unused-in-assemble"]


def _trainer(overrides, tp=1, dp=1):
    from rl.train import assemble

    cfg = load_config(RLConfig, None, BASE + list(overrides))
    sc, tc = ModelConfig(**STUDENT), ModelConfig(**TEACHER)
    state = init_parallel(ParallelDims(dp, tp), "cpu", sc.n_heads, sc.n_kv_heads)
    kv = kv_replica_group(state, sc.n_kv_heads)
    policy = build_model(sc, state.tp_group, kv, seed=3, dtype=torch.float64)
    ref = None if teacher_is_reference(cfg) else build_model(sc, state.tp_group, kv, seed=3, dtype=torch.float64)
    teacher = build_model(tc, state.tp_group, kv_replica_group(state, tc.n_kv_heads), seed=9, dtype=torch.float64)
    return assemble(cfg, state, sc, load_tokenizer(None), policy, ref, teacher=teacher)


def _full_logprobs(model, ro, vocab, temperature=1.0):
    """log-softmax over the tokenizer's ids at the response positions [B, N, V], float64, full logits."""
    with torch.no_grad():
        logits = model(ro.sequences, attention_mask=ro.attention_mask)[:, ro.prompt_len - 1:-1, :vocab]
    return torch.log_softmax(logits.double() / temperature, -1)


def _divergence(ls, lt, kind, beta=0.5):
    S, P = ls.exp(), lt.exp()
    if kind == "reverse_kl":
        return (S * (ls - lt)).sum(-1)
    if kind == "forward_kl":
        return (P * (lt - ls)).sum(-1)
    M = (beta * P + (1 - beta) * S).log()
    return beta * (P * (lt - M)).sum(-1) + (1 - beta) * (S * (ls - M)).sum(-1)


@pytest.mark.parametrize("loss,extra", [("reverse_kl", []), ("jsd", []), ("forward_kl", ["teacher.temperature=2.0"]),
                                        ("reverse_kl", ["kl.exact=true", "kl_ctl.beta=0.1"])])
def test_distill_loss_equals_full_logits(loss, extra):
    """reverse_kl / forward_kl inside the policy's head (the teacher in its KL slot); jsd, and any term beside an
    exact reference KL, as a chunk term of the same loss-inside head (parallel/distill_chunk.py)."""
    t = _trainer(["algo.name=distill", f"distill.loss={loss}", "distill.beta=0.3"] + extra)
    tau_t = t.cfg.teacher.temperature
    data = t.make_experience(0)
    ls = _full_logprobs(t.policy, data.ro, t.vocab)
    lt = _full_logprobs(t.teacher, data.ro, t.vocab, tau_t)
    m = data.mask
    want = float(_divergence(ls, lt, loss, 0.3)[m].mean())  # token-mean: one mini-batch, the update's first forward
    upd = t.update(data, 0)
    assert upd["distill_loss"] == pytest.approx(want, rel=1e-6)  # the token weights are fp32
    assert want > 0
    assert float(data.advantages.abs().max()) == 0.0  # pure distillation: no reward reaches the loss
    if "kl.exact=true" in extra:  # the reference keeps its KL slot: policy == reference at step 0, so its KL is 0
        assert float(data.kl.abs().max()) < 1e-12 and abs(upd["kl_loss"]) < 1e-12
    tl = lt.gather(-1, data.ro.responses_ids[..., None])[..., 0]
    torch.testing.assert_close(data.teacher_logp, torch.where(m, tl, 0.0).float(), atol=1e-6, rtol=1e-6)


def _update_grads(overrides):
    """(the rollout's sequences, the policy's gradient of the first update's loss) before clipping."""
    t = _trainer(overrides)
    data = t.make_experience(0)
    got, norm = {}, t.opt.grad_norm

    def grab():
        got.update({n: p.grad.clone() for n, p in t.policy.named_parameters() if p.grad is not None})
        return norm()

    t.opt.grad_norm = grab
    t.update(data, 0)
    return data.ro.sequences, got


@pytest.mark.slow  # two trainers each (~10 s); the fast tier checks the chunk term in tests/test_distill.py
@pytest.mark.parametrize("overrides", [
    ["algo.name=distill", "distill.loss=jsd", "distill.beta=0.3"],
    ["algo.name=distill", "distill.loss=topk_forward_kl", "distill.top_k=5", "teacher.temperature=1.5"],
    ["algo.name=grpo", "distill.coef=0.7", "kl.exact=true", "kl_ctl.beta=0.1"]])
def test_term_in_the_loss_head_gives_the_second_head_calls_gradient(overrides):
    """The term inside the loss-inside head (its gradient added to the policy's per chunk) and the same term as a
    second head call (algo.fused_loss=false: the policy's recomputing head, the term's own autograd backward,
    parallel/distill_head.py and distill_topk.py, checked against full logits in tests/test_distill.py) give
    the policy the same gradient on the same rollout."""
    seq_in, g_in = _update_grads(overrides)
    seq_out, g_out = _update_grads(overrides + ["algo.fused_loss=false"])
    assert torch.equal(seq_in, seq_out)
    assert g_in.keys() == g_out.keys() and len(g_in) > 0
    for n in g_in:
        torch.testing.assert_close(g_in[n], g_out[n], atol=1e-12, rtol=1e-9, msg=n)


def test_bf16_teacher_keeps_the_fp32_divergence():
    """teacher.dtype=bf16: its weights in bf16, the divergence still reduced in fp32 (here fp64, the student's
    dtype): the loss is the full-logit divergence of the bf16 teacher (whose logits the reference here rounds
    to bf16, the fused head does not) to 1e-3 (measured 9e-5)."""
    t = _trainer(["algo.name=distill", "teacher.dtype=bf16"])
    assert next(t.teacher.parameters()).dtype == torch.bfloat16
    data = t.make_experience(0)
    ls = _full_logprobs(t.policy, data.ro, t.vocab)
    lt = _full_logprobs(t.teacher, data.ro, t.vocab)  # the bf16 teacher's own forward, upcast
    want = float(_divergence(ls, lt, "reverse_kl")[data.mask].mean())
    assert t.update(data, 0)["distill_loss"] == pytest.approx(want, rel=1e-3)


def test_sampled_baseline_advantages_and_step():
    t = _trainer(["algo.name=distill", "distill.loss=sampled_reverse_kl", "distill.coef=2.0"])
    data = t.make_experience(0)
    ids = data.ro.responses_ids[..., None]
    ls = _full_logprobs(t.policy, data.ro, t.vocab).gather(-1, ids)[..., 0]
    lt = _full_logprobs(t.teacher, data.ro, t.vocab).gather(-1, ids)[..., 0]
    want = torch.where(data.mask, -2.0 * (ls - lt), 0.0).float()
    torch.testing.assert_close(data.advantages, want, atol=1e-5, rtol=1e-5)
    rec = t.step(1)
    assert rec["distill_coef"] == 2.0 and rec["distill_loss"] == 0.0


def test_grpo_with_scheduled_distill_term():
    t = _trainer(["algo.name=grpo", "distill.coef=0.5", "distill.coef_end=0.0", "distill.coef_steps=2",
                  "distill.loss=topk_forward_kl", "distill.top_k=4", "kl_ctl.beta=0.05"])
    r0, r1 = t.step(0), t.step(1)
    assert r0["distill_coef"] == 0.5 and r1["distill_coef"] == 0.25
    assert r0["distill_loss"] > 0 and r1["distill_loss"] > 0


@pytest.mark.slow
def test_distill_term_beside_a_sequence_level_objective():
    """GSPO's sequence ratio prepares its loss from a no-grad head pass off-policy: the term then runs beside it."""
    t = _trainer(["algo.name=grpo", "algo.recipe=gspo", "algo.mini_batches=2", "distill.coef=0.5"])
    rec = t.step(0)
    assert rec["distill_loss"] > 0 and rec["distill_coef"] == 0.5


def _save(model_kw, path, fp):
    m = build_model(ModelConfig(**model_kw), seed=0)
    ckpt.save_model_weights(m, str(path), None, tokenizer_fingerprint=fp)
    return str(path)


def test_teacher_tokenizer_and_vocab_mismatch_refused(tmp_path):
    small = dict(STUDENT, n_layers=1)
    s = _save(small, tmp_path / "student", "a" * 64)
    good = _save(dict(small, hidden_size=48, n_heads=6, n_kv_heads=3), tmp_path / "teacher", "a" * 64)
    assert teacher_model_config(s, good, "a" * 64).hidden_size == 48
    other_tok = _save(small, tmp_path / "teacher_tok", "b" * 64)
    with pytest.raises(ConfigError, match="tokenizer mismatch") as e:
        teacher_model_config(s, other_tok)
    assert str(tmp_path / "student") in str(e.value) and str(tmp_path / "teacher_tok") in str(e.value)
    other_vocab = _save(dict(small, vocab_size=300), tmp_path / "teacher_vocab", "a" * 64)
    with pytest.raises(ConfigError, match="vocabulary mismatch"):
        teacher_model_config(s, other_vocab)


def test_distill_config_refusals():
    with pytest.raises(ValueError, match="teacher.checkpoint"):
        load_config(RLConfig, None, ["algo.name=distill"])
    with pytest.raises(ValueError, match="teacher.checkpoint"):
        load_config(RLConfig, None, ["distill.coef=0.1"])
    with pytest.raises(ValueError, match="distill.loss"):
        load_config(RLConfig, None, ["distill.loss=tvd"])


def _distill_losses(tp, dp, overrides):
    t = _trainer(overrides, tp, dp)
    return [t.step(s)["distill_loss"] for s in range(2)]


@pytest.mark.slow
def test_layouts_match_single_process(dist_pools):
    """The same run (seeded models, layout-invariant sampling) at tp 2 and dp 2: the distillation losses of two
    steps as in one process; the teacher's width and head count differ from the student's."""
    for ov in (["algo.name=distill"], ["algo.name=distill", "distill.loss=jsd"]):
        want = _distill_losses(1, 1, ov)
        for tp, dp in ((2, 1), (1, 2)):
            got = dist_pools.run(2, _distill_losses, tp, dp, ov)
            for g in got:
                assert g == pytest.approx(want, rel=1e-9), (ov, tp, dp)
