"""The rollout's recorded log-probs and hidden states against float64 computations written here: the
sampled (truncated, renormalised) and the tempered distributions, at any TP / DP layout, through
batch compaction and the shared prefill; the bf16 rollout head against the trainer's fp32 logits;
the mismatch metrics against their hand formulas."""

import math

import pytest
import torch

import core.generation.generate as gen_mod
from core.config import ModelConfig
from core.generation.generate import generate
from core.model import build_model

V = 131
CFG = dict(vocab_size=V, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64, max_seq_len=64)
SETTINGS = [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.8, top_p=0.8),
            dict(temperature=1.2, min_p=0.1), dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05)]


def _model(tp_group=None, dtype=torch.float64, scale=8.0):
    m = build_model(ModelConfig(**CFG), tp_group=tp_group, seed=3, dtype=dtype)
    with torch.no_grad():  # logits of a few units, as a trained model's: truncation and rounding matter
        m.head_weight.mul_(scale)
    return m


def _prompts(B=6, P=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[1, :2] = 0
    mask[B - 1, :3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _kept(z: torch.Tensor, temperature, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """float64 [n, V] logits -> bool [n, V]: the support the filters keep, by sorting (not the sampler's
    radix select): top-k values, then nucleus over the top-k-renormalised distribution, and min-p."""
    zt = z / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k:
        keep &= z >= z.topk(top_k, -1).values[:, -1:]
    if top_p < 1.0:
        p = torch.softmax(zt.masked_fill(~keep, -math.inf), -1)
        above = torch.stack([(p[i] * (zt[i] > zt[i][:, None])).sum(-1) for i in range(z.shape[0])])
        keep &= above < top_p
    if min_p > 0.0:
        keep &= (zt - zt.max(-1, keepdim=True).values) >= math.log(min_p)
    return keep


def _reference(model, out, sample: dict):
    """float64 (log mu, log pi_T, final hidden) of every response token by a full forward, no cache."""
    P = out.prompt_len
    with torch.no_grad():
        h, w = model(out.sequences, attention_mask=out.attention_mask, head=lambda h, w: (h, w))
    h = h[:, P - 1:-1].double()
    z = (h @ w.double().T)[..., :V]
    B, N = out.response_mask.shape
    lmu, lpi = torch.zeros(B, N, dtype=torch.float64), torch.zeros(B, N, dtype=torch.float64)
    tok = out.sequences[:, P:]
    T = sample["temperature"]
    for t in range(N):
        keep = _kept(z[:, t], T, sample.get("top_k", 0), sample.get("top_p", 1.0), sample.get("min_p", 0.0))
        live = out.response_mask[:, t].bool()
        y = tok[:, t].clamp(max=V - 1)
        assert keep[live, y[live]].all(), "a token outside the kept support was drawn"
        zt = z[:, t] / T
        lpi[:, t] = torch.log_softmax(zt, -1).gather(1, y[:, None])[:, 0]
        lmu[:, t] = torch.log_softmax(zt.masked_fill(~keep, -math.inf), -1).gather(1, y[:, None])[:, 0]
    m = out.response_mask.bool()
    return lmu.masked_fill(~m, 0.0), lpi.masked_fill(~m, 0.0), h.masked_fill(~m[..., None], 0.0)


def _gen(model, ids, mask, sample, **kw):
    return generate(model, ids, mask, max_new_tokens=7, eos_id=2, pad_id=0, seed=4, step=1, record=True,
                    record_hidden=True, **sample, **kw)


@pytest.mark.parametrize("sample", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_recorded_logprobs_equal_float64_distribution(sample):
    model = _model()
    ids, mask = _prompts()
    out = _gen(model, ids, mask, sample)
    lmu, lpi, h = _reference(model, out, sample)
    assert out.response_mask.sum() > 10
    torch.testing.assert_close(out.logprobs.double(), lmu, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.tempered_logprobs.double(), lpi, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.hidden.double(), h, atol=1e-9, rtol=0)
    if len(sample) > 1:  # a truncation: mu puts more mass on every kept token than pi_T does
        m = out.response_mask.bool()
        assert (out.logprobs[m] >= out.tempered_logprobs[m] - 1e-6).all()
        assert (out.logprobs[m] - out.tempered_logprobs[m]).max() > 1e-3


def test_greedy_records_a_point_mass():
    model = _model()
    ids, mask = _prompts()
    out = _gen(model, ids, mask, dict(temperature=0.0))
    lmu, lpi, _ = _reference(model, out, dict(temperature=1.0))
    assert out.logprobs.abs().max() == 0.0
    torch.testing.assert_close(out.tempered_logprobs.double(), lpi, atol=2e-5, rtol=0)


def test_compaction_and_shared_prefill_keep_the_records():
    """Rows stop at different steps (many stop ids), so the batch compacts; prompts repeat (G=3), so
    the shared prefill copies their cache. The records equal those of the plain loop, row by row."""
    model = _model()
    ids, mask = _prompts(B=3)
    ids, mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    rows = torch.arange(9) + 100
    sample = dict(temperature=1.0, top_p=0.95)
    kw = dict(eos_ids=list(range(3, 40)), row_ids=rows)
    plain = _gen(model, ids, mask, sample, compact=False, share_prefill=False, **kw)
    fast = _gen(model, ids, mask, sample, compact=True, share_prefill=True, **kw)
    lens = plain.response_mask.sum(1)
    assert (lens <= 0.75 * lens.max()).sum() >= 3, "too few early stops to compact"
    assert torch.equal(plain.sequences, fast.sequences)
    for a, b in ((plain.logprobs, fast.logprobs), (plain.tempered_logprobs, fast.tempered_logprobs),
                 (plain.hidden, fast.hidden)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)
    lmu, lpi, _ = _reference(model, fast, sample)
    torch.testing.assert_close(fast.logprobs.double(), lmu, atol=2e-5, rtol=0)
    off = ~fast.response_mask.bool()
    assert fast.logprobs[off].abs().max() == 0 and fast.hidden[off].abs().max() == 0


def _layouts(sample):
    """tp=2: the sharded model's records; dp=2: this rank's half of the rows (global row ids)."""
    import torch.distributed as dist
    g, rank = dist.group.WORLD, dist.get_rank()
    ids, mask = _prompts(B=4)
    rows = torch.arange(4)
    tp = _gen(_model(tp_group=g), ids, mask, sample, tp_group=g, row_ids=rows)
    half = slice(2 * rank, 2 * rank + 2)
    dp = _gen(_model(), ids[half], mask[half], sample, dp_group=g, row_ids=rows[half])
    pack = lambda o: (o.sequences, o.logprobs, o.tempered_logprobs, o.hidden)
    return pack(tp), pack(dp)


def test_records_do_not_depend_on_tp_or_dp(dist_pools):
    sample = dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02)
    ids, mask = _prompts(B=4)
    single = _gen(_model(), ids, mask, sample, row_ids=torch.arange(4))
    res = dist_pools.run(2, _layouts, sample, timeout=120)
    ref = (single.sequences, single.logprobs, single.tempered_logprobs, single.hidden)
    for rank, (tp, dp) in enumerate(res):
        assert torch.equal(tp[0], ref[0])
        for a, b in zip(tp[1:], ref[1:]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        half = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(dp[0], ref[0][half])
        for a, b in zip(dp[1:], ref[1:]):
            torch.testing.assert_close(a, b[half], atol=1e-9, rtol=0)


def test_bf16_rollout_head_samples_the_trainers_distribution(monkeypatch):
    """Under mixed_precision=bf16 the logits the sampler draws from are the trainer's: float32 results
    of the bf16 hidden states and head weight, not bf16-rounded. Reference: float64 logits of the hidden
    states and head weight the rollout's head was given (the decode's own: a full forward's bf16 hidden
    states differ from a decode's by the matmuls' shapes); KL(sampler || float64) per token, against
    ~1e-4 for bf16-rounded logits."""
    cfg = ModelConfig(**{**CFG, "vocab_size": 256, "hidden_size": 64})
    model = build_model(cfg, seed=3).set_mixed_precision("bf16")
    with torch.no_grad():
        model.head_weight.mul_(40)  # logits of ~10: bf16 rounding of them is ~0.03
    seen, given = [], []
    sampler, head = gen_mod.sample_from_sharded_logits, gen_mod.head_logits

    def spy(logits, **kw):
        seen.append(logits.float().clone())
        return sampler(logits, **kw)

    def head_spy(hidden, weight, *args, **kw):
        given.append((hidden.detach().double(), weight.detach().double(), hidden.dtype))
        return head(hidden, weight, *args, **kw)
    monkeypatch.setattr(gen_mod, "sample_from_sharded_logits", spy)
    monkeypatch.setattr(gen_mod, "head_logits", head_spy)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (8, 6), generator=g)
    generate(model, ids, torch.ones_like(ids), max_new_tokens=8, eos_id=None, pad_id=0, temperature=1.0, seed=1,
             compact=False)
    assert len(seen) == len(given) == 8 and all(dt == torch.bfloat16 for _, _, dt in given)
    kl = torch.stack([(torch.softmax(z[:, :256].double(), -1) * (torch.log_softmax(z[:, :256].double(), -1)
                                                                  - torch.log_softmax((h @ w.T)[:, :256], -1))).sum(-1)
                      for z, (h, w, _) in zip(seen, given)], 1)
    rounded = torch.stack([(torch.softmax((h @ w.T)[:, :256], -1) * (torch.log_softmax((h @ w.T)[:, :256], -1)
                           - torch.log_softmax((h @ w.T).bfloat16().double()[:, :256], -1))).sum(-1)
                           for h, w, _ in given], 1)
    assert rounded.max() > 1e-6  # the failure this guards against is visible at this scale
    assert kl.max() < 1e-8, f"KL(sampler || trainer) up to {kl.max():.3g} per token"
