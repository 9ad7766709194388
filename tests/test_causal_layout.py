"""Padded rows and one-response shared rows run SDPA with is_causal=True (core/causal_layout.py): every
real token's logits and the weight gradients equal, in float64 at 1e-12, those of each row run alone
without padding (a forward that never saw a mask)."""

import torch
import torch.nn.functional as F

from core import model as model_mod
from core.causal_layout import left_pad_shift, roll_rows, single_piece_rows
from core.config import ModelConfig
from core.model import build_model

CFG = ModelConfig(vocab_size=97, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                  max_seq_len=64)


def _sdpa_calls(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((attn_mask is None, is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)
    monkeypatch.setattr(model_mod.F, "scaled_dot_product_attention", spy)
    return calls


def test_left_pad_shift_and_roll():
    m = torch.tensor([[0, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert left_pad_shift(m).tolist() == [2, 0, 1, 0]
    assert left_pad_shift(torch.tensor([[1, 0, 1]])) is None  # a hole: not causal after a roll
    x = torch.arange(10).view(2, 5)
    shift = torch.tensor([2, 0])
    assert roll_rows(x, shift).tolist() == [[2, 3, 4, 0, 1], [5, 6, 7, 8, 9]]
    assert torch.equal(roll_rows(roll_rows(x, shift), shift, inverse=True), x)


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    S, spans = 12, [(3, 10), (0, 12), (5, 12), (1, 6)]  # [first, end) of each row's real tokens
    ids = torch.randint(3, 97, (len(spans), S), generator=g)
    mask = torch.zeros(len(spans), S, dtype=torch.long)
    for b, (lo, hi) in enumerate(spans):
        mask[b, lo:hi] = 1
    return ids.masked_fill(mask == 0, 0), mask, spans


def test_padded_rows_run_causal_and_match_each_row_alone(monkeypatch):
    model = build_model(CFG, seed=1).double()
    ids, mask, spans = _rows()
    w = torch.randn(len(spans), ids.shape[1], CFG.vocab_size, dtype=torch.float64, generator=torch.Generator()
                    .manual_seed(2))
    calls = _sdpa_calls(monkeypatch)
    out = model(ids, attention_mask=mask)[..., :CFG.vocab_size]
    assert calls and all(none and causal for none, causal in calls)  # no dense mask was built
    (out * w * mask[..., None]).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0
    for b, (lo, hi) in enumerate(spans):
        alone = model(ids[b:b + 1, lo:hi])[..., :CFG.vocab_size]  # no padding, no mask
        torch.testing.assert_close(out[b, lo:hi], alone[0], rtol=0, atol=1e-12)
        total = total + (alone[0] * w[b, lo:hi]).sum()
    total.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=0, atol=1e-12, msg=n)


def test_one_response_shared_rows_run_causal(monkeypatch):
    """Shared-prompt rows [prompt | one response | padding]: causal; two responses in a row: the dense
    document mask (a response must not see the other)."""
    model = build_model(CFG, seed=1).double()
    ids, _, _ = _rows(3)
    doc = torch.tensor([[0] * 4 + [1] * 6 + [-1] * 2, [0] * 3 + [1] * 9])
    pre = torch.tensor([[0] * 10 + [-1] * 2, [0] * 12])
    pos = torch.arange(12).expand(2, 12)
    assert single_piece_rows(doc, pre)
    two = torch.tensor([[0] * 4 + [1] * 3 + [2] * 3 + [-1] * 2])
    assert not single_piece_rows(two, torch.tensor([[0] * 10 + [-1] * 2]))
    calls = _sdpa_calls(monkeypatch)
    out = model(ids[:2], document_ids=doc, prefix_ids=pre, position_ids=pos)
    assert calls and all(none and causal for none, causal in calls)
    torch.testing.assert_close(out[0, :10], model(ids[:1, :10])[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(out[1], model(ids[1:2])[0], rtol=0, atol=1e-12)
    calls.clear()
    model(ids[:1], document_ids=two, prefix_ids=torch.tensor([[0] * 10 + [-1] * 2]), position_ids=pos[:1])
    assert calls and not any(none for none, _ in calls)
