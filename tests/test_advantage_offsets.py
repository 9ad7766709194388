"""GRPO advantages when the rewards share a large offset, against the same formula evaluated exactly
(Python floats on the offset-free rewards, then rounded once to fp32): the baseline must not be lost
in an fp32 sum (8 rewards of 1e7 sum past 2^24; 64 of 1e6 too)."""

import math

import pytest
import torch

from rl.objectives.advantages import grpo_advantages


def _exact(rewards: list[float], G: int, scale: bool, eps: float = 1e-6) -> list[float]:
    out = []
    for i in range(0, len(rewards), G):
        g = rewards[i:i + G]
        mu = math.fsum(g) / G
        dev = [x - mu for x in g]
        if max(g) == min(g):
            out += [0.0] * G
            continue
        if scale and G > 1:
            sd = math.sqrt(math.fsum(d * d for d in dev) / (G - 1))
            dev = [d / (sd + eps) for d in dev]
        out += dev
    return out


@pytest.mark.parametrize("offset,G", [(1e6, 64), (1e7, 8), (1e7, 2), (3e6, 16)])
@pytest.mark.parametrize("scale", [True, False])
def test_grpo_with_a_large_common_offset(offset, G, scale):
    gen = torch.Generator().manual_seed(int(offset) % 1000 + G)
    bits = torch.randint(0, 2, (3 * G,), generator=gen).tolist()
    bits[0], bits[1] = 0, 1  # every group has two distinct rewards (the first two of group 0 at least)
    rewards32 = torch.tensor([offset + b for b in bits], dtype=torch.float32)  # offset + {0, 1}: exact in fp32
    want = torch.tensor(_exact([float(x) for x in rewards32.tolist()], G, scale), dtype=torch.float64)
    got = grpo_advantages(rewards32, G, scale_by_std=scale)
    assert got.dtype == torch.float32
    # one fp32 rounding of each advantage, nothing more
    torch.testing.assert_close(got.double(), want, rtol=2**-23, atol=1e-12)
    # and the same as without the offset
    torch.testing.assert_close(got, grpo_advantages(rewards32 - offset, G, scale_by_std=scale), rtol=0, atol=1e-6)


def test_grpo_fp64_rewards_keep_fp64():
    r = torch.tensor([1e12 + 0.25, 1e12 + 0.5, 1e12, 1e12 + 0.75], dtype=torch.float64)
    got = grpo_advantages(r, 4)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(_exact(r.tolist(), 4, True), dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)
