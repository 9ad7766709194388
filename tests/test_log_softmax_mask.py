"""vocab_parallel_log_softmax with a mask, at tp 1 and 2 (gloo), vocabularies 131 (uneven: padding
on the last rank) and 128: NaN / inf planted in the masked rows' logits and in their upstream gradient
reach no value and no gradient; the kept rows equal float64 torch.log_softmax over the kept rows alone,
values and gradients; a masked row is 0 (like its siblings' values) with gradient exactly 0."""

import pytest
import torch

from core.config import ModelConfig
from parallel import comm
from parallel.vocab import vocab_parallel_log_softmax

T = 9
TAU = 0.8


def _masked_vs_torch(V: int, seed: int) -> bool:
    import torch.distributed as dist

    group = dist.group.WORLD if dist.is_initialized() else None
    tp, r = comm.group_size(group), comm.group_rank(group)
    Vp = ModelConfig(vocab_size=V).padded_vocab_size(tp)
    width = Vp // tp
    cols = slice(r * width, (r + 1) * width)
    nv = max(0, min(width, V - r * width))
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, Vp, generator=g, dtype=torch.float64) * 3
    W = torch.randn(T, Vp, generator=g, dtype=torch.float64)  # upstream gradient
    keep = torch.ones(T, dtype=torch.bool)
    keep[[1, 4, 8]] = False
    Xg, Wg = X.clone(), W.clone()  # garbage under the mask, in the logits and the upstream gradient
    Xg[1], Xg[4, 0], Xg[8, -1] = float("nan"), float("inf"), float("-inf")
    Wg[1, 0], Wg[4], Wg[8] = float("inf"), float("nan"), float("-inf")

    # reference: float64 torch on the kept rows only, padded columns dropped
    Xk = X[keep, :V].clone().requires_grad_(True)
    ref = torch.log_softmax(Xk / TAU, -1)
    (gref,) = torch.autograd.grad((ref * W[keep, :V]).sum(), [Xk])

    x = Xg[:, cols].clone().requires_grad_(True)
    out = vocab_parallel_log_softmax(x, group, vocab_size=V, temperature=TAU, mask=keep)
    up = Wg[:, cols].clone()
    up[:, nv:] = float("nan")  # the padded columns' upstream gradient is never read either
    (gx,) = torch.autograd.grad(out, [x], grad_outputs=up)

    lo, hi = r * width, r * width + nv  # this rank's valid global columns
    assert torch.equal(out[~keep], torch.zeros_like(out[~keep]))
    assert torch.equal(gx[~keep], torch.zeros_like(gx[~keep]))
    torch.testing.assert_close(out[keep, :nv], ref[:, lo:hi].detach(), atol=1e-12, rtol=1e-12)
    assert torch.all(out[keep, nv:] == float("-inf"))
    torch.testing.assert_close(gx[keep, :nv], gref[:, lo:hi], atol=1e-12, rtol=1e-12)
    assert torch.equal(gx[:, nv:], torch.zeros_like(gx[:, nv:]))
    return True


@pytest.mark.parametrize("V", [131, 128])
def test_log_softmax_mask_tp1(V):
    assert _masked_vs_torch(V, 0)


def test_log_softmax_mask_tp2(dist_pools):
    assert dist_pools.run(2, _masked_vs_torch, 131, 1) == [True, True]
    assert dist_pools.run(2, _masked_vs_torch, 128, 2) == [True, True]


def test_log_softmax_without_mask_is_unchanged_and_bad_mask_named():
    x = torch.randn(4, 131, dtype=torch.float64)
    torch.testing.assert_close(vocab_parallel_log_softmax(x), torch.log_softmax(x, -1), atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="mask has shape"):
        vocab_parallel_log_softmax(x, mask=torch.ones(3, dtype=torch.bool))
