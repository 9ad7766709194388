"""How many [chunk, V] fp32 temporaries the fused heads hold at their peak, counted by MemTracker on
real CPU tensors (tools/klcost/measure.py's tracked run: deterministic, the inputs not counted).

The peak of forward+backward is the weight gradient [V, H] and grad hidden [T, H] (the same for
every method) plus the chunk's temporaries; the count below is what is left, in units of one
[chunk, V] fp32 tensor (the bool mask of p == 0 is a quarter of one). The exact paths hold both
models' logits (2), one temporary and the mask: 3.25; the sampled path (policy logits only) 2.25.
Before the in-place chunk arithmetic of parallel/fused_loss_stats.py the exact loss-inside head
held 4.0 and the recomputing exact head 5.0 (its previous chunk's gradient outlived the chunk)."""

import pytest
import torch

from tools.klcost.measure import measure

T, H, V, CHUNK = 256, 16, 8192, 64  # 4 chunks; V is a multiple of 128: no padding at tp 1
UNIT = CHUNK * V * 4  # one [chunk, V] fp32 tensor, bytes


def _temporaries(name: str, pass_: str) -> float:
    peak = measure(name, pass_, T, H, V, "fp32", CHUNK, warmup=0, repeats=0)["peak_bytes"]
    grads = (V * H + T * H) * 4 if pass_ == "forward+backward" else 0  # grad weight and grad hidden, fp32
    return (peak - grads) / UNIT


@pytest.mark.parametrize("name,pass_,want", [
    ("fused_exact_loss", "forward+backward", 3.25),  # was 4.0
    ("fused_exact", "forward+backward", 3.25),  # was 5.0
    ("fused_exact", "forward", 3.0),  # was 4.0
    ("fused_k3_loss", "forward+backward", 2.25),  # unchanged
])
def test_fused_head_temporaries(name, pass_, want):
    got = _temporaries(name, pass_)
    # the rest: per-token [T] values and [chunk, k] statistics, < 2% of a unit at this shape
    assert want <= got < want + 0.02, f"{name} {pass_}: {got:.4f} [chunk, V] fp32 temporaries, expected {want}"


def test_exact_over_sampled_loss_inside():
    """The exact path's extra over the sampled one is the reference's logits: one unit, not two."""
    extra = _temporaries("fused_exact_loss", "forward+backward") - _temporaries("fused_k3_loss", "forward+backward")
    assert extra == pytest.approx(1.0, abs=0.02)
    assert torch.float32.itemsize == 4
