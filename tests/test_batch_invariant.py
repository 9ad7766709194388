"""Batch-invariant mode (parallel/invariant.py, `Transformer.batch_invariant`): the rollout's decode-time
forward and the trainer's full forward give every token the same bits.

Each test samples with `generate` (mode on), records what each decode step fed the sampler (the last
hidden state and the logits of every live row), and compares it with torch.equal against the
trainer's path over the final sequences (rl/update/logprobs.py): the hidden state at the same
position, the logits, and the log-prob from `policy_token_stats` / `packed_token_stats` against the
fused head applied to the decode hidden state of that one token. Layouts: a row alone and in batches
of other lengths, compaction of finished rows, blocked and shared prefill, the shared-prompt layout,
token-budget micro-batches (padded and packed), fused-head chunk sizes, tp 2/4, dp 2; fp32 and bf16.
With the mode off the same comparison in bf16 finds differences (the test can fail).
"""

from __future__ import annotations

import pytest
import torch

from core.config import ModelConfig
from core.generation import generate as gen_mod
from core.model import build_model
from parallel import fused, invariant, invariant_kernel
from parallel.fused import HeadMatmul, fused_head
from parallel.invariant import batch_invariant
from parallel.vocab_stats import vocab_shard
from rl.experience.rollout import Rollout
from rl.update.logprobs import logprobs_from_hidden, packed_token_stats, policy_token_stats, reference_hidden
from rl.update.micro_batches import by_token_budget, scatter_tokens
from rl.update.shared_layout import share_rollout

MODEL = dict(vocab_size=131, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
             max_seq_len=64, tie_embeddings=False)
V, TEMP = 131, 0.9
EOS = list(range(105, 131))  # a fifth of the vocabulary ends a row: skewed response lengths
REAL_SAMPLE = gen_mod.sample_from_sharded_logits
REAL_HEAD = gen_mod._last_position_head
PROMPT_LENS = [3, 9, 5, 9, 2, 6]  # rows 1 and 3 hold the same prompt (shared prefill, shared layout)


def _model(precision: str, tp_group=None, seed: int = 3, **shape):
    m = build_model(ModelConfig(**{**MODEL, **shape}), tp_group, seed=seed)
    m.set_mixed_precision(precision)
    m.batch_invariant = True
    return m


def _prompts():
    g = torch.Generator().manual_seed(0)
    P = max(PROMPT_LENS)
    ids = torch.zeros(len(PROMPT_LENS), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(PROMPT_LENS):
        ids[i, P - n:] = torch.randint(8, V, (n,), generator=g)
        mask[i, P - n:] = 1
    ids[3], mask[3] = ids[1], mask[1]
    return ids, mask


class Recorder:
    """Wraps generate's last-position head and sampler: per (row id, response index t) the hidden
    state [H] and the logits [Vp/tp] the sampler drew token t from."""

    def __init__(self, monkeypatch):
        self.hidden, self.logits, self._last = {}, {}, []

        def head_factory(tp_group):
            inner = REAL_HEAD(tp_group)

            def head(hidden, weight_local):
                self._last.append(hidden[:, -1].clone())  # blocked prefill: several forwards
                return inner(hidden, weight_local)
            return head

        def sample(logits, *, row_ids, position, **kw):
            h, self._last = torch.cat(self._last), []
            if h.shape[0] != logits.shape[0]:  # shared prefill: logits copied to the rows holding the prompt
                h = h[torch.tensor(gen_mod.distinct_prompts(*self._prompt)[0])]
            for i, r in enumerate(row_ids.tolist()):
                self.hidden[(r, position)], self.logits[(r, position)] = h[i], logits[i].clone()
            return REAL_SAMPLE(logits, row_ids=row_ids, position=position, **kw)

        monkeypatch.setattr(gen_mod, "_last_position_head", head_factory)
        monkeypatch.setattr(gen_mod, "sample_from_sharded_logits", sample)

    def run(self, model, ids, mask, row_ids, **kw) -> Rollout:
        self._prompt = (ids, mask)
        out = gen_mod.generate(model, ids, mask, max_new_tokens=10, eos_id=None, eos_ids=EOS, pad_id=0,
                               temperature=TEMP, seed=5, row_ids=row_ids, vocab_limit=V, **kw)
        B = ids.shape[0]
        return Rollout(out.sequences, out.attention_mask, out.response_mask.bool(), out.prompt_len,
                       torch.zeros(B), row_ids, [], [])


@torch.no_grad()
def _decode_logprobs(model, rec: Recorder, ro: Rollout, tp_group=None) -> torch.Tensor:
    """The fused head applied to each token's decode hidden state alone: [B, N] (0 off the response)."""
    B, N = ro.response_mask.shape
    w = model.head_weight.to(model.compute_dtype) if model.compute_dtype else model.head_weight
    out = torch.zeros(B, N)
    for b in range(B):
        for t in range(N):
            if ro.response_mask[b, t]:
                with batch_invariant(model.batch_invariant):  # what the model's forward switches on
                    h = rec.hidden[(int(ro.row_ids[b]), t)][None]
                    out[b, t] = fused_head(h, w, ro.sequences[b, ro.prompt_len + t][None], tp_group, vocab_size=V,
                                           temperature=TEMP, chunk_size=1, entropy=False).logprobs[0]
    return out


def _check_hidden_and_logits(model, rec: Recorder, ro: Rollout, tp_group=None) -> None:
    """The decode hidden states equal the full forward's at the same positions, and the logits the sampler
    drew from equal the fused heads' logits of those hidden states, bit for bit."""
    h, w = reference_hidden(model, ro.sequences, ro.attention_mask, ro.prompt_len)
    B, N = ro.response_mask.shape
    with torch.no_grad(), batch_invariant(True):  # the fused heads' logits of the trainer's hidden states
        sh = vocab_shard(w.shape[0], tp_group, V, 1.0, w.dtype, fp32=True)
        full_logits = HeadMatmul(w, sh)(h.reshape(B * N, -1)).view(B, N, -1)
    for b in range(B):
        for t in range(N):
            if ro.response_mask[b, t]:
                key = (int(ro.row_ids[b]), t)
                assert torch.equal(rec.hidden[key], h[b, t]), f"hidden of row {b} token {t}"
                assert torch.equal(rec.logits[key][:sh.nv], full_logits[b, t]), f"logits of row {b} token {t}"


def _trainer_logprobs(model, ro: Rollout, how: str, tp_group=None) -> torch.Tensor:
    """Log-probs [B, N] of the response tokens through the trainer's path `how`."""
    kw = dict(tp_group=tp_group, vocab_size=V, temperature=TEMP, entropy=True, kl=None)
    B, N = ro.response_mask.shape
    with torch.no_grad():
        if how.startswith("padded"):
            chunk = {"padded": None, "padded_chunk1": 1, "padded_chunk3": 3}[how]
            return policy_token_stats(model, ro.sequences, ro.attention_mask, ro.prompt_len, mask=ro.response_mask,
                                      chunk_size=chunk, **kw).logprobs
        if how == "shared":
            return policy_token_stats(model, ro.sequences, ro.attention_mask, ro.prompt_len, mask=ro.response_mask,
                                      packed=share_rollout(ro), chunk_size=2, **kw).logprobs
        out = torch.zeros(B, N)
        for mb in by_token_budget(ro, torch.arange(B), 24, packed=how == "packed"):
            if mb.packed is not None:
                st = packed_token_stats(model, mb.packed, mask=mb.mask(ro.response_mask), chunk_size=5, **kw)
                out += scatter_tokens(mb.packed, st.logprobs.float(), B, N)
            else:  # trimmed, padded rows (rl/update/micro_batches.py)
                sub = mb.rollout(ro)
                st = policy_token_stats(model, sub.sequences, sub.attention_mask, sub.prompt_len,
                                        mask=sub.response_mask, chunk_size=5, **kw)
                out[mb.rows, :mb.response_cols] += st.logprobs.float()
        return out


TRAINER_PATHS = ["padded", "padded_chunk1", "padded_chunk3", "shared", "budget", "packed"]


def _assert_equal_where(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, what: str) -> None:
    a, b = a.detach().float().where(mask, 0.0), b.detach().float().where(mask, 0.0)
    assert torch.equal(a, b), f"{what}: max |diff| {float((a - b).abs().max())}"


@pytest.mark.parametrize("attention", ["kernel", "torch"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("gen_kw", [{}, dict(share_prefill=True), dict(prefill_tokens=10), dict(blocks=True)],
                         ids=["plain", "shared_prefill", "blocked_prefill", "small_blocks"])
def test_decode_equals_trainer(monkeypatch, precision, gen_kw, attention):
    """`attention`: the fused CPU kernel (where it builds) or the plain-PyTorch blocks other devices run."""
    torch.set_num_threads(1)
    if attention == "kernel" and invariant_kernel.kernel() is None:
        pytest.skip("the invariant attention kernel could not be built here")
    monkeypatch.setattr(invariant_kernel, "kernel", invariant_kernel.kernel if attention == "kernel" else lambda: None)
    if gen_kw.pop("blocks", False):  # several key and query blocks per sequence (the defaults exceed these lengths)
        monkeypatch.setattr(invariant, "KEY_BLOCK", 8)
        monkeypatch.setattr(invariant, "QUERY_BLOCK", 16)
        # and the head's vocabulary blocks (fp32: 4 x 32 + a tail of 3 columns; bf16: its upcast blocks)
        monkeypatch.setattr(fused, "_FEW_ROWS_BLOCK", 32)
        monkeypatch.setattr(fused, "_UPCAST_BLOCK", 32)
    ro = _decode_equals_trainer(monkeypatch, _model(precision), **gen_kw)
    lens = ro.response_mask.sum(1).tolist()
    assert len(set(lens)) > 2 and min(lens) < 10, lens  # skewed lengths: rows finish early, the batch compacts


def _decode_equals_trainer(monkeypatch, model, **gen_kw) -> Rollout:
    """Generate with the recorder; the decode's hidden states and logits equal the full forward's, and the
    fused head on each decode hidden state equals every trainer path's log-probs. -> the rollout."""
    rec = Recorder(monkeypatch)
    ids, mask = _prompts()
    ro = rec.run(model, ids, mask, torch.arange(ids.shape[0]), **gen_kw)
    _check_hidden_and_logits(model, rec, ro)
    decode = _decode_logprobs(model, rec, ro)
    for how in TRAINER_PATHS:
        _assert_equal_where(_trainer_logprobs(model, ro, how), decode, ro.response_mask, how)
    return ro


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_decode_equals_trainer_qwen2_shape(monkeypatch, precision):
    """Qwen2's shape (biases on q, k and v; tied embedding and head; rope base 1e6) with the shared prefill:
    the decode's hidden states, logits and log-probs equal every trainer path's."""
    torch.set_num_threads(1)
    model = _model(precision, qkv_bias=True, tie_embeddings=True, rope_theta=1e6)
    with torch.no_grad():  # the biases start at 0: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    _decode_equals_trainer(monkeypatch, model, share_prefill=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_row_alone_equals_row_in_batch(monkeypatch, precision):
    """Row 2 generated alone draws the same tokens with the same hidden states and logits as in the batch."""
    torch.set_num_threads(1)
    model = _model(precision)
    ids, mask = _prompts()
    rec_all = Recorder(monkeypatch)
    ro = rec_all.run(model, ids, mask, torch.arange(ids.shape[0]))
    rec_one = Recorder(monkeypatch)
    one = rec_one.run(model, ids[2:3], mask[2:3], torch.tensor([2]))
    n = int(one.response_mask.sum())
    assert torch.equal(one.sequences[0], ro.sequences[2])
    for t in range(n):
        assert torch.equal(rec_one.hidden[(2, t)], rec_all.hidden[(2, t)])
        assert torch.equal(rec_one.logits[(2, t)], rec_all.logits[(2, t)])


def test_mode_off_bf16_differs(monkeypatch):
    """Without the mode the bf16 decode and the trainer's forward disagree (so the tests above can fail)."""
    torch.set_num_threads(1)
    model = _model("bf16")
    model.batch_invariant = False
    rec = Recorder(monkeypatch)
    ids, mask = _prompts()
    ro = rec.run(model, ids, mask, torch.arange(ids.shape[0]))
    decode = _decode_logprobs(model, rec, ro)
    trainer = _trainer_logprobs(model, ro, "padded")
    m = ro.response_mask
    assert not torch.equal(decode.where(m, 0.0), trainer.float().where(m, 0.0))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_reference_equals_policy_at_step0(precision):
    """A reference with the policy's weights: its log-probs through the trainer's reference path (hidden
    states in the shared layout, then `logprobs_from_hidden`) equal the policy's from the padded
    forward bit for bit, and the exact KL between them is 0."""
    torch.set_num_threads(1)
    policy, ref = _model(precision), _model(precision)
    ids, mask = _prompts()
    out = gen_mod.generate(policy, ids, mask, max_new_tokens=6, eos_id=None, eos_ids=EOS, pad_id=0,
                           temperature=TEMP, seed=1, vocab_limit=V)
    B = ids.shape[0]
    ro = Rollout(out.sequences, out.attention_mask, out.response_mask.bool(), out.prompt_len, torch.zeros(B),
                 torch.arange(B), [], [])
    ref_h, ref_w = reference_hidden(ref, ro.sequences, ro.attention_mask, ro.prompt_len, packed=share_rollout(ro))
    with torch.no_grad():
        st = policy_token_stats(policy, ro.sequences, ro.attention_mask, ro.prompt_len, vocab_size=V,
                                temperature=TEMP, kl="forward", ref_hidden=ref_h, ref_weight=ref_w,
                                mask=ro.response_mask, chunk_size=7)
    assert torch.equal(st.kl.where(ro.response_mask, 0.0), torch.zeros_like(st.kl))
    w = ref_w.to(ref.compute_dtype) if ref.compute_dtype else ref_w
    ref_lp = logprobs_from_hidden(ref_h, w, ro.responses_ids, vocab_size=V, temperature=TEMP, mask=ro.response_mask,
                                  invariant=True)
    _assert_equal_where(ref_lp, st.logprobs, ro.response_mask, "reference vs policy")


# ---------------------------------------------------------------------------------------------
# tp and dp


def _dist_case(tp: int, dp: int, precision: str):
    from parallel.dims import ParallelDims, init_parallel

    torch.set_num_threads(1)
    state = init_parallel(ParallelDims(dp, tp), "cpu", MODEL["n_heads"], MODEL["n_kv_heads"])
    model = _model(precision, state.tp_group)
    ids, mask = _prompts()
    rows = torch.arange(ids.shape[0])
    if dp > 1:  # this rank's share of the rows, with their global ids
        rows = rows[state.dp_rank::dp]
    with pytest.MonkeyPatch.context() as mp:  # generate's head and sampler wrapped for this case only
        rec = Recorder(mp)
        ro = rec.run(model, ids[rows], mask[rows], rows, tp_group=state.tp_group, dp_group=state.dp_group)
    _check_hidden_and_logits(model, rec, ro, state.tp_group)
    decode = _decode_logprobs(model, rec, ro, state.tp_group)
    for how in TRAINER_PATHS:
        _assert_equal_where(_trainer_logprobs(model, ro, how, state.tp_group), decode, ro.response_mask, how)
    return rows, ro.sequences, decode.detach()


@pytest.mark.slow
@pytest.mark.parametrize("tp,precision", [(2, "bf16"), (4, "bf16"), (2, "fp32"), (4, "fp32")])
def test_tp_decode_equals_trainer(dist_pools, tp, precision):
    for _ in dist_pools.run(tp, _dist_case, tp, 1, precision):
        pass  # each rank asserted decode == trainer for its layout


@pytest.mark.slow
def test_dp2_equals_single_process(dist_pools):
    """dp 2: each rank's rows give the bits the single process gives them in the whole batch."""
    _, seq1, lp1 = _dist_case(1, 1, "fp32")
    for rows, seq, lp in dist_pools.run(2, _dist_case, 1, 2, "fp32"):
        assert torch.equal(seq[:, :seq1.shape[1]], seq1[rows][:, :seq.shape[1]])
        n = min(lp.shape[1], lp1.shape[1])
        assert torch.equal(lp[:, :n], lp1[rows][:, :n])


def test_config_key():
    """parallel.batch_invariant: off by default, read as a bool, anything else named in the error."""
    from core.config import ConfigError, check_parallel, load_config
    from rl.config import RLConfig

    assert load_config(RLConfig, None, []).parallel.batch_invariant is False
    cfg = load_config(RLConfig, None, ["parallel.batch_invariant=true"])
    assert cfg.parallel.batch_invariant is True
    cfg.parallel.batch_invariant = "yes"
    with pytest.raises(ConfigError, match="parallel.batch_invariant"):
        check_parallel(cfg.parallel, 1)


def test_trainer_sets_the_mode_on_policy_and_reference():
    """The key reaches the policy and the reference `rl.train.assemble` builds (the bench's tiny job)."""
    from bench.bench_rl_step import CONFIGS, build_trainer

    for on in (False, True):
        tr = build_trainer(CONFIGS["tiny"], "grpo", extra=[f"parallel.batch_invariant={str(on).lower()}"])
        assert tr.policy.batch_invariant is on and tr.ref.batch_invariant is on


@pytest.mark.slow
@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_trainer_step0_old_equals_new_and_kl_exactly_zero(on):
    """The two invariants slime gates on, in a real step (the bench's tiny GRPO job, fp32, policy ==
    reference): the old-log-prob pass and the update's forward of the first mini-batch give the same log-probs
    (`logp_drift` = max |old - new| exactly 0, so KL(old || new) of the first update is exactly 0), and the
    exact KL against the reference is exactly 0 with the first mini-batch's old values from the update's own
    layout (`algo.old_from_update`). Off, both read float noise instead (the assertions can fail)."""
    from bench.bench_rl_step import CONFIGS, build_trainer

    torch.set_num_threads(1)
    flag = [f"parallel.batch_invariant={str(on).lower()}"]
    drift = build_trainer(CONFIGS["tiny"], "grpo", extra=flag + ["algo.old_from_update=false"]).step(0)
    exact = build_trainer(CONFIGS["tiny"], "grpo", extra=flag + ["kl.exact=true"]).step(0)
    if on:
        assert drift["logp_drift"] == 0.0
        assert exact["kl_mean"] == 0.0
    else:
        assert drift["logp_drift"] > 0.0 and exact["kl_mean"] != 0.0, (drift["logp_drift"], exact["kl_mean"])


def test_silu_tail():
    """fp32 silu of a row that ends the tensor (ATen's scalar tail) rounds differently from the same row
    inside a longer tensor; parallel/invariant.py's silu does not (the MLP's [M, I/tp] at a small I/tp).
    ATen takes whole pairs of vectors, 16 floats under AVX2 and 32 under AVX-512: of 3 rows of 8 (24
    elements) row 2 is in the scalar tail under both; of 4 rows (32 elements), in a vector under both."""
    g = torch.Generator().manual_seed(4)
    plain = mode = 0
    for _ in range(100):
        row = torch.rand(8, generator=g) * 4
        a, b = row[None].repeat(3, 1), row[None].repeat(4, 1)
        plain += not torch.equal(torch.nn.functional.silu(a)[2], torch.nn.functional.silu(b)[2])
        with batch_invariant(True):
            mode += not torch.equal(invariant.silu(a)[2], invariant.silu(b)[2])
            assert torch.equal(invariant.silu(b), torch.nn.functional.silu(b))  # no padding needed: the same
    assert plain > 0 and mode == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_old_pass_is_the_head_on_the_rollouts_hidden_states(precision):
    """With the mode on, the old-log-prob pass runs no policy forward: the policy's head on the rollout's
    recorded hidden states gives the old log-probs, entropy and exact KL to the reference bit for bit equal
    to the forward's (the same step recomputed with the hidden states dropped, which takes the old pass's
    forward), on every row (no rows deferred to the update)."""
    import dataclasses

    from bench.bench_rl_step import CONFIGS, build_trainer

    tr = build_trainer(CONFIGS["tiny"], "grpo", extra=["parallel.batch_invariant=true", "kl.exact=true",
                                                       "algo.old_from_update=false",
                                                       f"parallel.mixed_precision={precision}"])
    ex = tr.experience
    ro = tr.make_experience(0).ro
    assert ro.rollout_hidden is not None
    calls = []
    hook = tr.policy.register_forward_pre_hook(lambda *a: calls.append(1))
    fast = ex.make_experience(ro, 0)
    hook.remove()
    assert calls == []  # the reference ran; the policy did not
    slow = ex.make_experience(dataclasses.replace(ro, rollout_hidden=None), 0)
    m = ro.response_mask
    for name in ("old_logp", "entropy", "kl"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert torch.equal(a.where(m, 0.0), b.where(m, 0.0)), name
    assert torch.equal(fast.rollout_kl, torch.zeros_like(fast.rollout_kl))
