"""The fused heads' default chunk ("auto": chunk x Vp/tp <= 2^25 elements and chunk <= H/16 in bf16,
H/8 in fp32, a multiple of 64 in [128, T]) and the loss-inside head's backward, which hands its saved gradients over
without a second weight-sized tensor and refuses a second backward."""

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from parallel import vocab_stats
from parallel.fused import fused_head
from parallel.fused_loss import fused_head_loss


@pytest.mark.parametrize("T, width, H, itemsize, want", [
    (8192, 128256, 4096, 2, 256),  # Llama-3-8B bf16, tp 1: min(2^25 / 128256 = 261.6, 4096 * 2 / 32 = 256) -> 256
    (8192, 128256 // 8, 4096, 2, 256),  # tp 8: min(2^25 / 16032 = 2093, 256) (2048 by the element bound alone)
    (8192, 128256 // 8, 4096, 4, 512),  # the same head in fp32: min(2093, 4096 * 4 / 32 = 512)
    (8192, 128256 // 8, 8192, 2, 512),  # Llama-3-70B bf16, tp 8: min(2093, 512)
    (131072, 152064, 3584, 2, 192),  # Qwen2.5-7B bf16, tp 1: min(220.7, 224) -> 192 (a multiple of 64)
    (131072, 152064 // 8, 3584, 2, 192),  # tp 8: min(1765, 224) -> 192
    (2048, 32000, 1024, 4, 128),  # the CPU bar shape, fp32: min(1048, 128)
    (2048, 32000, 1024, 2, 128),  # the same in bf16: 7.8 MiB by the head bound, the 8 MiB floor: 64 -> 128 (min)
    (8192, 32000, 512, 4, 128),  # the 58M bench model, fp32: 64 by the bounds, clamped up to 128
    (8192, 151936, 896, 2, 128),  # Qwen2.5-0.5B bf16: 56 by the head bound, 13 by the floor -> 128
    (8192, 2**24, 4096, 2, 128),  # a huge shard: 2 tokens by the element bound, clamped up to 128
    (8192, 1000, 16, 8, 2048),  # a small float64 head: 4 tokens by the head bound, 2^21 / 1000 = 2097 by the floor
    (1536, 256, 64, 4, 1536),  # the tiny configs' head (fp32): 2^21 / 256 = 8192 by the floor, clamped to T
    (100, 1000, 4096, 2, 100),  # 256 tokens by both bounds, clamped down to T
    (0, 1000, 4096, 2, 1),
])
def test_auto_chunk_rule(T, width, H, itemsize, want):
    assert vocab_stats.auto_chunk_size(T, width, H, itemsize) == want
    assert vocab_stats.resolve_chunk_size(None, T, width, H, itemsize) == want
    assert vocab_stats.resolve_chunk_size("auto", T, width, H, itemsize) == want
    assert vocab_stats.resolve_chunk_size(7, T, width, H, itemsize) == 7


@pytest.mark.parametrize("width, H", [(128256, 4096), (128256 // 8, 4096), (152064 // 4, 3584), (16032, 8192),
                                      (32000, 1024), (1000, 640), (4000, 2**16), (256, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_chunk_temporary_is_a_fraction_of_the_head(width, H, dtype):
    """Unless clamped up to 128 tokens, one [chunk, Vp/tp] fp32 temporary is at most 128 MiB and at
    most 1/8 of the head's weight gradient [Vp/tp, H] in the weights' dtype (in bytes), or 8 MiB if
    that is more; and the chunk is the largest multiple of 64 that is so."""
    es = torch.empty((), dtype=dtype, device="cpu").element_size()
    c = vocab_stats.auto_chunk_size(10**6, width, H, es)
    limit = min(128 * 2**20, max(width * H * es / 8, 8 * 2**20))  # bytes
    assert c % 64 == 0 and c >= 128
    if c > 128:
        assert c * width * 4 <= limit < (c + 64) * width * 4


def test_auto_chunk_of_the_heads_follows_the_weights_shape_and_dtype(monkeypatch):
    """The fused heads resolve "auto" from weight_local's [Vp/tp, H] and dtype: 1000 tokens on a
    [1000, 2048] head (the 8 MiB floor off, so small a head is cut like a large one) are chunks of
    128 in bf16 (2048 * 2 / 32) and 256 in fp32."""
    monkeypatch.setattr(vocab_stats, "AUTO_CHUNK_SMALL_ELEMENTS", 0)
    calls = []
    real = vocab_stats.chunks
    monkeypatch.setattr("parallel.fused.chunks", lambda n, c: calls.append(c) or real(n, c))
    for dtype, want in ((torch.bfloat16, 128), (torch.float32, 256)):
        calls.clear()
        h, w = torch.randn(1000, 2048, dtype=dtype), torch.randn(1000, 2048, dtype=dtype)
        fused_head(h, w, torch.zeros(1000, dtype=torch.long), entropy=False)
        assert set(calls) == {want}, (dtype, calls)


@pytest.mark.parametrize("bad", [0, -3, "big", 2.5, True])
def test_bad_chunk_size(bad):
    h, w = torch.randn(4, 3), torch.randn(10, 3)
    with pytest.raises(ValueError, match="chunk_size must be a positive int, None or 'auto'"):
        fused_head(h, w, torch.tensor([1, 2, 3, 4]), chunk_size=bad)


def _inputs(T=200, H=16, V=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    hr = torch.randn(T, H, generator=g, dtype=torch.float64)
    wr = w + 0.1 * torch.randn(V, H, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (T,), generator=g)
    return h, w, hr, wr, t


def _fused_grads(chunk, loss_inside):
    h, w, hr, wr, t = _inputs()
    h.requires_grad_(True)
    w.requires_grad_(True)
    kw = dict(ref_hidden=hr, ref_weight_local=wr, kl="forward", entropy=True)
    if loss_inside:
        token_loss = lambda lp, ent, kl, s: lp - 0.3 * ent + 0.7 * kl  # noqa: E731
        loss, out = fused_head_loss(h, w, t, token_loss=token_loss, **kw) if chunk == "default" else \
            fused_head_loss(h, w, t, token_loss=token_loss, chunk_size=chunk, **kw)
    else:
        out = fused_head(h, w, t, **kw) if chunk == "default" else fused_head(h, w, t, chunk_size=chunk, **kw)
        loss = (out.logprobs - 0.3 * out.entropy + 0.7 * out.kl).sum()
    loss.backward()
    return [out.logprobs, out.entropy, out.kl, h.grad, w.grad]


@pytest.mark.parametrize("loss_inside", [False, True])
def test_auto_chunk_equals_the_explicit_chunk(monkeypatch, loss_inside):
    """With the 8 MiB floor off and the minimum at 64, the default chunk of 200 tokens on a
    [1000, 16] float64 head is 64 (16 * 8 / 32 = 4 tokens, clamped up to 64: 4 chunks, the last one
    short); the results are bitwise those of chunk_size=64, and within float64 rounding of one chunk
    of all 200 tokens."""
    monkeypatch.setattr(vocab_stats, "AUTO_CHUNK_SMALL_ELEMENTS", 0)
    monkeypatch.setattr(vocab_stats, "AUTO_CHUNK_MIN", 64)
    calls = []
    real = vocab_stats.chunks
    monkeypatch.setattr("parallel.fused.chunks" if not loss_inside else "parallel.fused_loss.chunks",
                        lambda n, c: calls.append(c) or real(n, c))
    auto = _fused_grads("default", loss_inside)
    assert set(calls) == {64}
    explicit = _fused_grads(64, loss_inside)
    whole = _fused_grads(200, loss_inside)
    for a, b, c in zip(auto, explicit, whole):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


def _loss_inside_backward_peak(T, H, V):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(T, H, generator=g).requires_grad_(True)
    w = torch.randn(V, H, generator=g).requires_grad_(True)
    t = torch.randint(0, V, (T,), generator=g)
    loss, _ = fused_head_loss(h, w, t, token_loss=lambda lp, ent, kl, s: -lp, entropy=False, chunk_size=16)
    total = lambda snap: sum(d["Total"] for d in snap.values())  # noqa: E731
    mt = MemTracker()
    mt.track_external(h, w, t, loss, *loss.grad_fn.saved_tensors)  # the gradients saved in forward exist already
    with mt:  # (no reference to them is kept here: backward may hand them over)
        base = total(mt.get_tracker_snapshot("current"))
        loss.backward()
    torch.testing.assert_close(w.grad, _plain_grad(h, w, t), rtol=1e-4, atol=1e-5)
    return total(mt.get_tracker_snapshot("peak")) - base


def _plain_grad(h, w, t):
    hh, ww = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(hh @ ww.T, t, reduction="sum").backward()
    return ww.grad


def test_loss_inside_backward_makes_no_second_weight_gradient():
    """The backward of the loss-inside head scales its saved gradients in place: no new tensor of
    the weight gradient's size [V, H] (nor of grad hidden's [T, H]). The old `gw * grad_loss`
    allocated both: the peak above the start was >= V x H x 4 bytes."""
    T, H, V = 64, 32, 4000
    peak = _loss_inside_backward_peak(T, H, V)
    assert peak < V * H * 4 // 4, peak  # old code: V*H*4 + T*H*4 = 520 KiB; now ~0


def test_loss_inside_scales_by_the_incoming_gradient_and_refuses_a_second_backward():
    h, w, hr, wr, t = _inputs(T=40, V=300)
    h.requires_grad_(True)
    w.requires_grad_(True)
    loss, _ = fused_head_loss(h, w, t, token_loss=lambda lp, ent, kl, s: -lp, entropy=False, chunk_size=16)
    (2.5 * loss).backward(retain_graph=True)
    torch.testing.assert_close(w.grad, 2.5 * _plain_grad(h, w, t), rtol=1e-10, atol=1e-10)
    with pytest.raises(RuntimeError, match="second backward through the same loss"):
        loss.backward()
