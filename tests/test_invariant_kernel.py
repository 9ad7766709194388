"""The batch-invariant mode's fused CPU attention kernel (parallel/csrc/invariant_attention.cpp).

Against float64 attention (SDPA in float64 and a log-sum-exp of float64 scores) on grouped heads, key gaps,
a query that sees nothing, a cache view longer than its filled length, head sizes that are and are not
multiples of the kernel's 16- and 32-column blocks; and bit for bit, a query's output and log-sum-exp
whatever the other queries (alone, in tiles at any offset, beside other rows), the key tensor's length and
the filled length past its position: what lets a decode step and the trainer's full forward agree.
The model-level agreement (decode against every trainer path) is tests/test_batch_invariant.py, which runs
with the kernel and with the plain-PyTorch path."""

from __future__ import annotations

import math

import pytest
import torch

from parallel import invariant_kernel
from parallel.invariant import grouped_attention
from parallel.invariant_grad import keys_seen, reference_attention


@pytest.fixture(scope="module")
def op():
    k = invariant_kernel.kernel()
    if k is None:
        pytest.skip("the invariant attention kernel could not be built here (no C++ compiler or ninja)")
    return k


def _case(seed, B=2, nkv=2, g=2, S=23, L=40, hd=64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nkv * g, S, hd, generator=gen)
    k = torch.randn(B, nkv, L, hd, generator=gen)
    v = torch.randn(B, nkv, L, hd, generator=gen)
    pos = torch.randint(-1, L + 3, (B, S), generator=gen)
    pos[0, 0] = -1  # a query that sees nothing
    valid = torch.rand(B, L, generator=gen) > 0.25  # key gaps
    valid[1, :] = True
    return q, k, v, pos, valid


def _float64_lse(q, k, pos, valid):
    B, nh, S, hd = q.shape
    nkv, L = k.shape[1], k.shape[2]
    g = nh // nkv
    rows = q.double().reshape(B, nkv, g * S, hd)
    s = rows @ k.double().transpose(-1, -2) / math.sqrt(hd)
    s = s.masked_fill(~keys_seen(pos, valid, L, g)[:, None], float("-inf"))
    return torch.logsumexp(s, -1).reshape(B, nh, S)


@pytest.mark.parametrize("hd", [8, 40, 64, 128])
def test_kernel_matches_float64_attention(op, hd):
    q, k, v, pos, valid = _case(hd, hd=hd)
    n = 33  # the filled length: keys at 33.. are never seen
    seen = valid.clone()
    seen[:, n:] = False
    with invariant_kernel.use_kernel(True):
        y, lse = grouped_attention(q, k, v, pos, valid, n, lse=True)
    ref = reference_attention(q.double(), k.double(), v.double(), pos, seen)
    assert y.dtype == torch.float32
    assert float((y.double() - ref).abs().max()) < 1e-5
    lref = _float64_lse(q, k, pos, seen)
    fin = torch.isfinite(lref)
    assert not bool(fin.all()) and bool((lse[~fin] == float("inf")).all())  # sees nothing: lse +inf, y 0
    assert bool((y[~fin] == 0).all())
    assert float((lse.double()[fin] - lref[fin]).abs().max()) < 1e-5


def test_kernel_reads_a_cache_view_in_place(op):
    """k, v a view of a longer cache (the batch and head strides of the cache): the result of a contiguous copy."""
    q, k, v, pos, _ = _case(1, S=1, L=70)
    cap_k, cap_v = torch.randn(2, 2, 128, 64), torch.randn(2, 2, 128, 64)
    cap_k[:, :, :70], cap_v[:, :, :70] = k, v
    pos = torch.tensor([[50], [69]])
    a = op(q.reshape(2, 2, 2, 64), cap_k[:, :, :70], cap_v[:, :, :70], pos.repeat(1, 2), None, 70, 0.125)
    b = op(q.reshape(2, 2, 2, 64), k.contiguous(), v.contiguous(), pos.repeat(1, 2), None, 70, 0.125)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("hd", [40, 64])
def test_a_querys_bits_do_not_depend_on_the_batch(op, hd):
    """Each query alone, and behind 0..8 other queries (every place in the kernel's tiles of 8), against a
    longer key tensor and a larger filled length, beside a different other row: the same bits."""
    q, k, v, pos, valid = _case(7, B=2, nkv=1, g=1, S=19, L=48, hd=hd)
    pos = pos.clamp(0, 47)  # the keys appended below stand past every query
    full = op(q, k, v, pos, valid, 48, 1 / math.sqrt(hd))
    gen = torch.Generator().manual_seed(1)
    for s in range(q.shape[2]):
        for before in (0, 1, 5, 7, 8):
            qs = torch.cat([torch.randn(2, 1, before, hd, generator=gen), q[:, :, s:s + 1]], 2)
            ps = torch.cat([torch.randint(0, 48, (2, before), generator=gen), pos[:, s:s + 1]], 1)
            # more keys behind (a bigger cache), filled further than the query's position, another row 0
            kk = torch.cat([k, torch.randn(2, 1, 16, hd, generator=gen)], 2)
            vv = torch.cat([v, torch.randn(2, 1, 16, hd, generator=gen)], 2)
            kk[0], vv[0], qs[0] = torch.randn_like(kk[0]), torch.randn_like(vv[0]), torch.randn_like(qs[0])
            kv = torch.cat([valid, torch.ones(2, 16, dtype=torch.bool)], 1)
            y, lse = op(qs, kk, vv, ps, kv, 64, 1 / math.sqrt(hd))
            assert torch.equal(y[1, :, before], full[0][1, :, s]), (s, before)
            assert torch.equal(lse[1, :, before], full[1][1, :, s]), (s, before)


def test_plain_path_is_the_fallback():
    """use_kernel(False): inv_attention's plain-PyTorch blocks (what other devices run), same function."""
    q, k, v, pos, valid = _case(3)
    with invariant_kernel.use_kernel(False):
        assert invariant_kernel.kernel() is None and not invariant_kernel.applies(q)
        y = grouped_attention(q, k, v, pos, valid, 40)
    ref = reference_attention(q.double(), k.double(), v.double(), pos, valid)
    assert float((y.double() - ref).abs().max()) < 2e-6
