"""The batch-invariant attention's backward: standard attention's gradient, not autograd through the blocks.

The invariant forward (parallel/invariant.py's `inv_attention`: fixed key blocks, masked scores, a loop of
block sums) is the same function as standard causal attention; only its rounding is pinned. Autograd
through its every op (the masked scores, the exp, each block's matmul) costs far more than a fused
attention backward, and the gradient's rounding needs no pinning (the invariance is about the forward's
bits, which the rollout and the trainer compare). So the forward runs without a graph and the backward is
standard attention's:

  - the canonical layouts (the trainer's forward): `attention_backward` from the forward's own output and
    log-sum-exp, on CPU by ATen's flash-attention backward, which takes them as saved: the forward is not
    recomputed. On another device (no such entry point for a masked attention) it recomputes the attention
    with SDPA and differentiates that;
  - `exact_forward` (a KV cache's queries, which only the tests differentiate): recomputed with SDPA under
    the equivalent boolean mask.

tests/test_invariant_grad.py checks both against float64 math attention and the mode-off model's gradients.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F


def keys_seen(q_pos: torch.Tensor, k_valid: torch.Tensor | None, L: int, g: int = 1) -> torch.Tensor:
    """[B, g * S, L]: whether query row r sees key j (key j at position j): j <= the row's position and
    k_valid[:, j] (None: every key valid). q_pos [B, S]; the g query heads of a KV head are stacked as rows
    head-major (row i * S + s: head i, position q_pos[:, s])."""
    qp = q_pos.repeat(1, g) if g > 1 else q_pos
    see = torch.arange(L, device=q_pos.device)[None, None, :] <= qp[:, :, None]
    return see if k_valid is None else see & k_valid.bool()[:, None, :]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        k_valid: torch.Tensor) -> torch.Tensor:
    """What `grouped_attention(q, k, v, q_pos, k_valid)` computes, by SDPA: q [B, nh, S, hd] at positions
    q_pos [B, S] over k, v [B, nkv, L, hd] (key j at position j, `k_valid` [B, L]); a query at position p
    sees the valid keys at positions <= p, a query that sees none gives 0. In fp32 (float64 for float64
    inputs), the result in q's dtype. The g = nh / nkv query heads of a KV head are stacked as rows, as
    the forward does (no repeated keys; SDPA's fused kernel takes the mask)."""
    B, nh, S, hd = q.shape
    nkv, L = k.shape[1], k.shape[2]
    g = nh // nkv
    ct = torch.promote_types(q.dtype, torch.float32)
    rows = q.reshape(B, nkv, g * S, hd).to(ct)
    see = keys_seen(q_pos, k_valid, L, g)  # (B, g * S, L)
    empty = ~see.any(-1, keepdim=True)  # a query that sees nothing: any finite row, its output zeroed
    y = F.scaled_dot_product_attention(rows, k.to(ct), v.to(ct), attn_mask=(see | empty)[:, None])
    y = y.masked_fill(empty[:, None], 0.0)
    return y.reshape(B, nh, S, hd).to(q.dtype)


def attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor,
                       lse: torch.Tensor, q_pos: torch.Tensor, k_valid: torch.Tensor, recompute: bool | None = None):
    """Standard attention's gradient (dq, dk, dv) at the forward's own output y [B, nh, S, hd] and
    log-sum-exp lse [B, nh, S] (+inf for a query that sees nothing), for the attention
    `reference_attention` describes; grad, q, y [B, nh, S, hd], k, v [B, nkv, L, hd], all in one compute
    dtype. On CPU, ATen's flash-attention backward takes y and lse as saved (no recomputation of the
    forward); on another device the attention is recomputed by SDPA and differentiated. A query that sees
    nothing has output 0 and gives no gradient: its row sees every key in the mask (no NaN) and its lse is
    +inf (its weights exp(s - lse) are 0). `recompute`: force (True) or forbid (False) the recomputing
    path; by default it is taken off CPU."""
    if recompute if recompute is not None else q.device.type != "cpu":
        with torch.enable_grad():
            ins = [t.detach().requires_grad_() for t in (q, k, v)]
            out = reference_attention(*ins, q_pos, k_valid)
            return torch.autograd.grad(out, ins, grad)
    B, nh, S, hd = q.shape
    nkv, L = k.shape[1], k.shape[2]
    g = nh // nkv
    see = keys_seen(q_pos, k_valid, L, g)  # (B, g * S, L)
    see |= ~see.any(-1, keepdim=True)
    mask = torch.zeros(B, 1, g * S, L, dtype=q.dtype, device=q.device).masked_fill_(~see[:, None], float("-inf"))
    rows = [t.reshape(B, nkv, g * S, hd).contiguous() for t in (grad, q, y)]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        rows[0], rows[1], k.contiguous(), v.contiguous(), rows[2], lse.reshape(B, nkv, g * S).contiguous(),
        0.0, False, attn_mask=mask, scale=1.0 / math.sqrt(hd))
    return dq.reshape(B, nh, S, hd), dk, dv


class _ExactForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward_fn, reference_fn, q, k, v):  # autograd is off in here: no graph of the loop
        ctx.reference_fn = reference_fn
        ctx.save_for_backward(q, k, v)
        return forward_fn(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            ins = [t.detach().requires_grad_(n) for t, n in zip(saved, need)]
            y = ctx.reference_fn(*ins)
            wanted = [t for t in ins if t.requires_grad]
            got = iter(torch.autograd.grad(y, wanted, grad))
        return None, None, *(next(got) if n else None for n in need)


def exact_forward(forward_fn: Callable, reference_fn: Callable, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    """forward_fn(q, k, v) with reference_fn's gradient: forward_fn runs without autograd (its bits as
    they are) and backward differentiates reference_fn(q, k, v), the same function in standard ops.
    Without a gradient to take, forward_fn(q, k, v) itself."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _ExactForward.apply(forward_fn, reference_fn, q, k, v)
    return forward_fn(q, k, v)
