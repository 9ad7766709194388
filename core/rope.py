"""Rotary position embeddings: the inverse frequencies (with Llama-3 / linear scaling), the cos / signed sin
tables for a batch of positions, and the rotation (rotate-half layout, as Hugging Face stores q and k)."""

from __future__ import annotations

import math

import torch

from core.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [hd/2], with optional llama3-style scaling of the long wavelengths."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device="cpu") / hd))
    sc = cfg.rope_scaling
    if not sc or sc.get("rope_type", sc.get("type", "default")) == "default":
        return inv.float()
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return (inv / sc["factor"]).float()
    if kind != "llama3":
        raise ValueError(f"model.rope_scaling: unsupported rope_type {kind!r} (default, linear, llama3)")
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)  # long wavelengths: slow down
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, blended, scaled).float()


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [B, S] -> cos, signed sin [B, 1, S, hd] (rotate-half layout, as Hugging Face
    stores): the sin's first half negated, so `apply_rope` needs no negation of x (bitwise the same
    result as x * cos + rotate_half(x) * sin: a negation is exact, either operand)."""
    ang = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq.to(position_ids.device)  # (B, S, hd/2)
    emb = torch.cat([ang, ang], dim=-1).unsqueeze(1)  # (B, 1, S, hd)
    sin = emb.sin()
    sin[..., : ang.shape[-1]].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x rotated: x * cos + [x2, x1] * signed_sin, i.e. [x1 cos - x2 sin, x2 cos + x1 sin] for x = [x1, x2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * signed_sin
