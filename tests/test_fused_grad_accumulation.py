"""The fused heads' weight gradient for bf16 / fp16 weights, summed over many chunks, against float64
autograd on the same (upcast) inputs: it must be the float64 gradient rounded once to the weight's
dtype (within half an ulp, plus fp32 slack), whatever the number of chunks. Summed chunk by chunk in
the weight's dtype (before the fp32 accumulator), with d/dlogits rounded to it, the error was, at this
shape, 39 ulp in one chunk and 621 in 256 (bf16); 589 and 7118 (fp16). And the memory of the
accumulator: MemTracker sees it (2x a bf16 gradient) and no third copy at the final cast."""

import pytest
import torch

from parallel.fused import _UPCAST_BLOCK, cast_in_place, fused_head
from parallel.fused_loss import fused_head_loss
from tests.memory import peak_bytes

T, H, V = 4096, 16, 64


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / 4).to(dtype)
    wr = (torch.randn(V, H, generator=g) / 4).to(dtype)
    t = torch.randint(0, V, (T,), generator=g)
    return h, w, wr, t


def _float64_grad(h, w, wr, t):
    """d/dw of sum(log p(t)) + 0.5 sum(KL(p||q)), float64 autograd on the full logits."""
    w64 = w.double().requires_grad_(True)
    zp, zq = h.double() @ w64.T, h.double() @ wr.double().T
    lp, lq = torch.log_softmax(zp, -1), torch.log_softmax(zq, -1)
    loss = lp.gather(1, t[:, None]).sum() + 0.5 * (lp.exp() * (lp - lq)).sum()
    return torch.autograd.grad(loss, w64)[0]


def _ulps(got, want):
    """|got - want| in units of the weight dtype's ulp at |want| (the spacing one rounding is within)."""
    mant = {torch.bfloat16: 8, torch.float16: 11}[got.dtype]
    ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want.abs())[1] - mant)
    return ((got.double() - want).abs() / ulp).max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [T, 16])  # 1 chunk and 256
def test_weight_grad_is_the_float64_one_rounded_once(dtype, chunk):
    h, w, wr, t = _inputs(dtype)
    want = _float64_grad(h, w, wr, t)

    leaf = w.clone().requires_grad_(True)
    out = fused_head(h, leaf, t, ref_weight_local=wr, kl="forward", entropy=False, chunk_size=chunk)
    (g_head,) = torch.autograd.grad(out.logprobs.sum() + 0.5 * out.kl.sum(), [leaf])

    leaf = w.clone().requires_grad_(True)
    loss, _ = fused_head_loss(h, leaf, t, ref_weight_local=wr, kl="forward", entropy=False, chunk_size=chunk,
                              token_loss=lambda lp, ent, kl, tok: lp + 0.5 * kl)
    (g_loss,) = torch.autograd.grad(loss, [leaf])

    for name, g in (("fused_head", g_head), ("fused_head_loss", g_loss)):
        assert g.dtype == dtype and g.shape == w.shape, name
        # one rounding: <= 0.5 ulp, plus the fp32 sums before it: < 0.01 bf16 ulp here, up to ~0.5-0.6 of
        # fp16's 8x finer ulp where the gradient cancels (the sums' order follows the thread count: 1.05 ulp
        # in all at 4096 rows with one thread, under 1 with two)
        bound = 0.51 if dtype == torch.bfloat16 else 1.5
        assert _ulps(g, want) <= bound, (name, _ulps(g, want))


def test_cast_in_place_is_the_plain_cast():
    for n in (1, 3, 2**16, 2**16 + 1, 3 * 2**17 + 5):
        x = torch.randn(n, dtype=torch.float32) * 1e3
        for dtype in (torch.bfloat16, torch.float16):
            y = cast_in_place(x.clone(), dtype)
            assert y.dtype == dtype and torch.equal(y, x.to(dtype)), (n, dtype)
    x = torch.randn(300, 77)
    y = cast_in_place(x.clone(), torch.bfloat16)
    assert y.shape == x.shape and torch.equal(y, x.bfloat16())


def test_accumulator_memory_is_counted_and_never_tripled():
    """bf16 weights [V, H]: the backward's peak holds the fp32 accumulator (4 bytes per weight) but not
    a bf16 copy beside it (6 bytes): the cast writes into the accumulator's storage. (The old bf16 sum
    held 2 bytes per weight: the accumulator's price is 2 more.)"""
    Vb, Hb, Tb, chunk = 4 * _UPCAST_BLOCK, 256, 64, 16  # the weight dominates the chunk's temporaries
    g = torch.Generator().manual_seed(1)
    h = torch.randn(Tb, Hb, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(Vb, Hb, generator=g) / 8).bfloat16().requires_grad_(True)
    t = torch.randint(0, Vb, (Tb,), generator=g)
    n = Vb * Hb

    def step():
        out = fused_head(h, w, t, entropy=False, chunk_size=chunk)
        out.logprobs.sum().backward()

    peak = peak_bytes(step, h, w, t)
    # grad hidden, the chunk's temporaries (with slack), and on CPU the logits matmul's fp32 copy of
    # _UPCAST_BLOCK weight rows (n bytes here)
    small = 2 * Tb * Hb * 4 + 8 * chunk * Vb * 4 + _UPCAST_BLOCK * Hb * 4
    assert 4 * n <= peak <= 4 * n + small, peak
    assert peak < 6 * n, peak  # a plain cast at the end would hold 4n + 2n
