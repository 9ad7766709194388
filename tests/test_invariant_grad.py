"""The batch-invariant attention's gradient (parallel/invariant_grad.py): its forward runs the invariant
computation without a graph and its backward is standard attention's, recomputed with SDPA. The gradients
of q, k and v match plain math attention (float64 to ~1e-10, fp32 to fp32 rounding), through the canonical
layouts (left padding, packed documents, shared prompts), grouped heads and a KV cache, a query that sees
nothing gets a zero gradient, and a whole model's gradients in the mode match the mode-off model's in
float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from core.config import ModelConfig
from core.model import build_model
from parallel.invariant import CachePositions, batch_invariant, canonical_layout, grouped_attention, invariant_attend
from parallel.invariant_grad import attention_backward


def _math_attention(q, k, v, see):
    """Softmax attention by its definition: q [B, nh, S, hd], k, v [B, nkv, L, hd], see [B, nh, S, L]
    (a row that sees nothing gives 0)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~see, float("-inf"))
    w = torch.softmax(s.masked_fill(~see.any(-1, keepdim=True), 0.0), -1) * see.any(-1, keepdim=True)
    return w @ v


def _grads(fn, q, k, v, gy):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    y = fn(q, k, v)
    return (y, *torch.autograd.grad(y, (q, k, v), gy))


def _inputs(dtype, B, nh, nkv, S, hd, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, nh, hd, generator=g, dtype=torch.float64).transpose(1, 2)  # the model's strides
    k = torch.randn(B, S, nkv, hd, generator=g, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(B, S, nkv, hd, generator=g, dtype=torch.float64).transpose(1, 2)
    gy = torch.randn(B, nh, S, hd, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, gy)]


def _padded(B, S):
    """Left-padded rows of lengths S, S - 7, ... and their positions."""
    valid = torch.ones(B, S, dtype=torch.bool)
    for b in range(B):
        valid[b, :7 * b % S] = False
    return (valid.long().cumsum(-1) - 1).clamp(min=0), valid


def _layouts(B, S):
    """(name, layout, see [B, S, S]: query i sees key j) for a padded batch, packed documents and
    shared prompts (documents 1 and 2 of each row also see document 0)."""
    pos, valid = _padded(B, S)
    see_pad = valid[:, None, :] & valid[:, :, None] & (pos[:, None, :] <= pos[:, :, None])
    see_pad &= torch.ones(S, S, dtype=torch.bool).tril()
    doc = torch.arange(S).expand(B, S) * 3 // S  # three documents per row
    dpos = torch.stack([torch.cat([torch.arange(int((r == d).sum())) for d in range(3)]) for r in doc])
    same = doc[:, None, :] == doc[:, :, None]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    see_doc = same & causal
    first = int((doc[0] == 0).sum())
    pre = torch.zeros_like(doc)
    spos = torch.where(doc > 0, dpos + first, dpos)
    see_pre = (same & causal) | ((doc[:, :, None] > 0) & (doc[:, None, :] == 0))
    return [("padded", canonical_layout(pos, valid), see_pad),
            ("packed", canonical_layout(dpos, torch.ones(B, S, dtype=torch.bool), doc), see_doc),
            ("shared", canonical_layout(spos, torch.ones(B, S, dtype=torch.bool), doc, pre), see_pre)]


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 2e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("S", [19, 150])
def test_canonical_layout_gradients_match_math_attention(dtype, rtol, heads, S):
    nh, nkv = heads
    q, k, v, gy = _inputs(dtype, 3, nh, nkv, S, 16)
    for name, layout, see in _layouts(3, S):
        with batch_invariant(True):
            got = _grads(lambda q, k, v, lay=layout: invariant_attend(lay, q, k, v), q, k, v, gy)
        mask = see[:, None].expand(-1, nh, -1, -1)
        want = _grads(lambda q, k, v, m=mask: _math_attention(q, k, v, m), *(t.double() for t in (q, k, v, gy)))
        real = see.any(-1)[:, None, :, None]  # a padding query's output is not attention's (0 here)
        for what, a, b in zip("y q k v".split(), got, want):
            a, b = a.detach().double(), b.detach()
            if what in "yq":
                a, b = a * real, b * real
            scale = float(b.abs().max())
            assert float((a - b).abs().max()) <= rtol * scale, f"{name} d{what}"


def test_shared_prompt_rows_attend_once():
    """The update's layout: each row a prompt (document 0) and one response (document 1) that also sees the
    prompt. The prompt's tokens need no canonical row of their own (their keys are the response's first):
    B rows of attention, not 2B, and every token's output has the bits of the unshared rows' layout."""
    B, S, P, nh, hd = 3, 40, 9, 4, 16
    q, k, v, _ = _inputs(torch.float32, B, nh, nh, S, hd, seed=3)
    doc = (torch.arange(S) >= P).long().expand(B, S)
    pos = torch.arange(S).expand(B, S)
    ones = torch.ones(B, S, dtype=torch.bool)
    shared = canonical_layout(pos, ones, doc, torch.zeros_like(doc))
    assert shared.gather.shape[0] == B
    with batch_invariant(True):
        got = invariant_attend(shared, q, k, v)
        want = invariant_attend(canonical_layout(pos, ones), q, k, v)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 2e-5)], ids=["f64", "f32"])
def test_cache_positions_gradients_match_math_attention(dtype, rtol):
    """Queries against a KV cache larger than its filled length (the decode layout)."""
    B, nh, nkv, S, hd, cap = 2, 4, 2, 5, 8, 128
    q, _, _, gy = _inputs(dtype, B, nh, nkv, S, hd, seed=1)
    g = torch.Generator().manual_seed(2)
    k = torch.randn(B, nkv, cap, hd, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, nkv, cap, hd, generator=g, dtype=torch.float64).to(dtype)
    past = 70
    pos = torch.arange(past, past + S).expand(B, S)
    layout = CachePositions(pos, torch.ones(B, S, dtype=torch.bool), past + S)
    see = (torch.arange(cap)[None, None, :] <= pos[:, :, None])[:, None].expand(B, nh, S, cap)
    with batch_invariant(True):
        got = _grads(lambda q, k, v: invariant_attend(layout, q, k, v), q, k, v, gy)
    want = _grads(lambda q, k, v: _math_attention(q, k, v, see), *(t.double() for t in (q, k, v, gy)))
    for what, a, b in zip("y q k v".split(), got, want):
        a, b = a.detach().double(), b.detach()
        assert float((a - b).abs().max()) <= rtol * float(b.abs().max()), f"d{what}"
    assert float(got[2][:, :, past + S:].abs().max()) == 0.0  # keys no query sees: no gradient


def test_query_that_sees_nothing_gets_zero_gradient():
    """Canonical sequence columns with no token before the first key see nothing: the forward gives 0
    there and the backward (SDPA over a fully masked row would give NaN) stays finite."""
    B, S, nh, hd = 1, 6, 2, 8
    pos = torch.tensor([[2, 3, 4, 7, 8, 9]])  # positions 0, 1 (see no key), 5, 6: no token
    q, k, v, gy = _inputs(torch.float64, B, nh, nh, S, hd)
    layout = canonical_layout(pos, torch.ones(B, S, dtype=torch.bool))
    with batch_invariant(True):
        y, dq, dk, dv = _grads(lambda q, k, v: invariant_attend(layout, q, k, v), q, k, v, gy)
    assert all(bool(t.isfinite().all()) for t in (y, dq, dk, dv))


def test_forward_bits_unchanged_by_the_gradient():
    """With and without a gradient to take, the forward is the same invariant computation, bit for bit."""
    q, k, v, _ = _inputs(torch.float32, 3, 4, 2, 150, 16)
    pos, valid = _padded(3, 150)
    layout = canonical_layout(pos, valid)
    with batch_invariant(True):
        with torch.no_grad():
            a = invariant_attend(layout, q, k, v)
        b = invariant_attend(layout, q.requires_grad_(), k, v)
    assert b.requires_grad and torch.equal(a, b.detach())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_model_gradients_in_the_mode_match_mode_off_float64(packed):
    cfg = ModelConfig(vocab_size=131, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                      max_seq_len=160, tie_embeddings=False)
    g = torch.Generator().manual_seed(0)
    B, S = 3, 150
    ids = torch.randint(0, 131, (B, S), generator=g)
    kw, keep = {}, torch.ones(B, S, dtype=torch.bool)
    if packed:
        kw["document_ids"] = torch.arange(S).expand(B, S) * 3 // S
    else:
        _, keep = _padded(B, S)
        kw["attention_mask"] = keep.long()
    w = torch.randn(B, S, cfg.hidden_size, generator=g, dtype=torch.float64) * keep[..., None]
    grads = {}
    for on in (False, True):
        model = build_model(cfg, seed=3).cast_weights(torch.float64)
        model.batch_invariant = on
        hidden = model(ids, head=lambda h, _w: h, **kw)
        (hidden * w).sum().backward()
        grads[on] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 5
    for n, a in grads[True].items():
        b = grads[False][n]
        assert float((a - b).abs().max()) <= 1e-10 * float(b.abs().max()), n


@pytest.mark.parametrize("recompute", [False, True], ids=["saved_lse", "recomputed"])
def test_attention_backward_from_saved_output_matches_math_attention(recompute):
    """Both paths of `attention_backward` (CPU: ATen's flash backward from the forward's own output and
    log-sum-exp; elsewhere: SDPA recomputed and differentiated), float64, grouped heads, a gap in the keys
    and a query that sees nothing (zero gradient, no NaN)."""
    B, nh, nkv, S, hd = 2, 4, 2, 23, 8
    q, k, v, gy = _inputs(torch.float64, B, nh, nkv, S, hd, seed=5)
    pos = torch.arange(S).expand(B, S).clone()
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, :3] = False  # row 1's queries at positions 0..2 see nothing
    valid[0, 7:9] = False  # a gap in row 0's keys
    see = ((torch.arange(S)[None, None, :] <= pos[:, :, None]) & valid[:, None, :])[:, None].expand(B, nh, S, S)
    y, dq, dk, dv = _grads(lambda q, k, v: _math_attention(q, k, v, see), q, k, v, gy)
    y = y.detach()
    with torch.no_grad():
        got_y, lse = grouped_attention(q.contiguous(), k.contiguous(), v.contiguous(), pos, valid, lse=True)
    assert float((got_y - y).abs().max()) <= 1e-12 and bool(torch.isinf(lse[1, :, :3]).all())
    got = attention_backward(gy, q, k, v, got_y, lse, pos, valid, recompute=recompute)
    for what, a, b in zip("qkv", got, (dq, dk, dv)):
        assert bool(a.isfinite().all()), what
        assert float((a - b).abs().max()) <= 1e-10 * float(b.abs().max()), f"d{what}"
    assert float(got[0][1, :, :3].abs().max()) == 0.0  # the queries that see nothing: no gradient
