"""Fused head with the loss inside: hidden states and sharded head weights -> a scalar loss built from
per-token log-probs, entropy and exact KL, whose gradient is computed during the forward pass
(Liger-style), so no logits are ever recomputed.

| tensor             | shape          | layout                                                |
|--------------------|----------------|-------------------------------------------------------|
| hidden             | [..., H]       | replicated over tp_group                              |
| weight_local       | [Vp/tp, H]     | sharded on the vocabulary (rows = global ids of rank) |
| ref_hidden         | [..., H_ref]   | replicated (defaults to `hidden`, as a constant)      |
| ref_weight_local   | [Vp/tp, H_ref] | sharded like weight_local                             |
| targets            | [...]          | global token ids                                      |
| loss               | []             | replicated                                            |
| stats              | [...] each     | replicated, detached                                  |

Per chunk of `chunk_size` tokens (default "auto": see parallel/fused.py), in the forward pass: the
policy (and reference) logits [c, Vp/tp], the chunk's statistics reduced over tp_group, the
chunk's per-token values, then `token_loss` and its gradient with respect to those [c] values
(torch.autograd on [c] tensors only), then d loss / d logits locally, then grad_hidden[chunk] = dz @ W
and grad_weight += dz^T @ h; the logits are freed before the next chunk. The chunk's arithmetic
(parallel/fused_loss_stats.py) runs inside the two logits buffers: besides them, one [c, Vp/tp]
temporary and one bool mask, so the exact KL holds one [c, Vp/tp] tensor more than a
log-prob-only loss (the reference's logits), not more.
The autograd backward only scales the saved grad_hidden / grad_weight by the incoming scalar, in
place, and hands them over (no second weight-gradient-sized tensor: 1 GiB at Llama-3-8B's head in bf16).
A bf16/fp16 weight's gradient is summed over the chunks in fp32 and cast once after the last chunk
(parallel/fused.py's GradAccumulator), into the accumulator's own storage: the gradient kept from
forward to backward then holds the accumulator's bytes, 2x a bf16 gradient (2 GiB at Llama-3-8B's head).

Compared with parallel/fused.py (policy and reference logits computed twice: forward and the
recomputing backward, 6 head-sized matmuls), this does 4: two logit matmuls and two gradient matmuls.
The price: the statistics must be final before a chunk's gradient, so the two collectives (one
all-reduce MAX of [c, 1|2], one all-gather of [c, <=6]) run once per chunk instead of once per call;
each still moves O(chunk) floats, never O(V), and O(T) in total.

Tensor parallelism: as for fused_head, each rank's grad_hidden is its vocabulary shard's partial sum;
the caller passes `comm.copy_to_tp(hidden, tp_group)`, whose backward all-reduces the partials.

Precision and masks: as for fused_head (fp32 logits from bf16 weights; `mask` drops tokens
exactly). At a masked token token_loss sees 0 for every value, its output is replaced by 0 and
the gradient it returns is dropped before any arithmetic, so a NaN, an inf or a huge log-ratio
that the closure computes at a padded position reaches neither the loss nor a gradient.

The reference is frozen: no gradient reaches ref_hidden or ref_weight_local (they are read
detached), nor `hidden` through the reference side when ref_hidden is None.
The gradient is that of the loss at the moment of the call, handed over by the first backward;
a second backward through the same loss (retain_graph=True) raises a RuntimeError, and there is no
graph of higher order.
"""

from __future__ import annotations

import torch

from parallel.fused import FusedHeadOutput, GradAccumulator, HeadMatmul, part, prepare_head
from parallel.fused_loss_stats import grad_logits_kept, local_stats_kept, shifted_stats
from parallel.vocab_stats import chunks, masked, reduce_stats

_VALUES = ("logprobs", "entropy", "kl")  # what token_loss sees, in its argument order


class _FusedHeadLoss(torch.autograd.Function):
    """(hidden [T, H], weight [Vp/tp, H]) -> (loss [], *per-token stats [T]); the gradient is formed
    in forward and saved."""

    @staticmethod
    def forward(ctx, hidden, weight, ref_hidden, ref_weight, targets, keep, sh, spec, chunk_size, token_loss, extra):
        T = hidden.shape[0]
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], False, False)
        acc = GradAccumulator(hidden, weight, None, None, need, sh.nv)
        stats = {k: hidden.new_empty(T, dtype=sh.dtype) for k in spec.outputs}
        tl = sh.local_index(targets)
        mm_p = HeadMatmul(weight, sh)
        mm_q = HeadMatmul(ref_weight, sh) if spec.has_q else None
        loss = None
        for s, e in chunks(T, chunk_size):
            kc = part(keep, s, e)
            zp = mm_p(hidden[s:e], kc)  # [c, nv]
            zq = mm_q(ref_hidden[s:e], kc) if spec.has_q else None
            # a term beside the loss (parallel/distill_chunk.py) reads the student's logits before the statistics
            # take their buffer, and returns its gradient with respect to them
            xl, xdz = (None, None) if extra is None else extra.chunk(zp, s, e, need[0] or need[1])
            tsel = None if tl is None else (tl[0][s:e], tl[1][s:e])
            maxes, sums = spec.buffers(e - s, hidden, sh.dtype)
            local_stats_kept(zp, zq, tsel, spec, maxes, sums)  # zp: z_p - local max, zq: the cross term
            # this chunk's values must be final before its gradient: the max all-reduce and the
            # partial-sum all-gather run per chunk, each O(chunk) floats (see the module docstring)
            st = reduce_stats(maxes, sums, spec, sh.group)
            for k in spec.outputs:
                stats[k][s:e] = masked(st[k], kc)
            chunk_loss, g = _token_loss_and_grads(token_loss, st, kc, s, e, need[0] or need[1])
            if xl is not None:
                chunk_loss = chunk_loss + xl.to(chunk_loss.dtype)
            loss = chunk_loss if loss is None else loss + chunk_loss
            gp = xdz
            if any(v is not None for v in g.values()):
                g = {k: masked(v.to(sh.dtype), kc) for k, v in g.items() if v is not None}
                gp = grad_logits_kept(zp, zq, tsel, shifted_stats(st, maxes, spec), g, spec,
                                      sh.temperature)  # in zp's buffer: the logits' last use
                if xdz is not None:
                    gp.add_(xdz)
                zq = xdz = None  # freed before the gradient's matmuls (and its cast to the weight's dtype)
            if gp is not None:
                acc.add(s, e, kc, gp, None)
            del zp, zq, gp, xdz
        gh, gw, _, _ = acc.grads()
        ctx.save_for_backward(gh, gw)
        outs = tuple(stats[k] for k in spec.outputs)
        ctx.mark_non_differentiable(*outs)
        return (loss, *outs)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        # the saved gradients are scaled in place and handed over (no second weight-sized tensor);
        # so they can be handed out once only
        if getattr(ctx, "handed_out", False):
            raise RuntimeError("fused_head_loss: a second backward through the same loss (retain_graph=True). "
                               "Its gradient was formed in forward and handed over by the first backward; call "
                               "fused_head_loss again for another gradient")
        ctx.handed_out = True
        gh, gw = ctx.saved_tensors
        for g in (gh, gw):
            if g is not None:
                g.mul_(grad_loss)  # exact when grad_loss is 1; no device sync to test it
        return (gh, gw, None, None, None, None, None, None, None, None, None)


def _token_loss_and_grads(token_loss, st: dict, keep, s: int, e: int, need: bool):
    """token_loss on the chunk's values [c] (0 at masked tokens) -> (its detached sum, {name: d sum /
    d value [c] or None}). A masked token's output is selected away before the sum."""
    with torch.enable_grad():
        vals = [masked(st[k], keep).detach().requires_grad_(True) if k in st else None for k in _VALUES]
        out = token_loss(*vals, slice(s, e))
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (e - s,):
            raise ValueError(f"token_loss must return a [{e - s}] tensor (one value per token of the "
                             f"chunk), got {type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
        chunk_loss = masked(out, keep).sum()
        live = [v for v in vals if v is not None]
        grads = (torch.autograd.grad(chunk_loss, live, allow_unused=True)
                 if chunk_loss.requires_grad and need else [None] * len(live))
    it = iter(grads)
    return chunk_loss.detach(), {k: next(it) for k, v in zip(_VALUES, vals) if v is not None}


def fused_head_loss(hidden, weight_local, targets=None, tp_group=None, *, token_loss, vocab_size=None,
                    ref_hidden=None, ref_weight_local=None, temperature=1.0, chunk_size=None, kl=None,
                    entropy=True, fp32=True, mask=None, extra=None) -> tuple[torch.Tensor, FusedHeadOutput]:
    """loss = sum over chunks of token_loss(logprobs, entropy, kl, tokens).sum(), with the gradient
    to hidden and weight_local computed chunk by chunk in this call.

    hidden [..., H] replicated (wrap it in copy_to_tp at tp > 1), weight_local [Vp/tp, H] sharded
    on the vocabulary over tp_group, targets [...] global ids (or None), kl None / "forward" /
    "reverse" against the frozen reference ref_hidden @ ref_weight_local.T, mask [...] (optional):
    the tokens that exist (a masked token adds exactly nothing to the loss or the gradients).
    `chunk_size`: tokens per chunk, an int or None / "auto" (the default: chunk x Vp/tp <= 2^25
    elements and, above 2^21, chunk <= H/16 in bf16, H/8 in fp32; in [128, T]; parallel/vocab_stats.py's
    auto_chunk_size).

    token_loss(logprobs, entropy, kl, tokens) -> [c]: called once per chunk with that chunk's [c]
    values (None for those not requested) and `tokens`, the chunk's slice of the flattened leading
    dims, so that per-token data (old log-probs, advantages, masks) bound in a closure can be
    indexed as `old_logprobs.reshape(-1)[tokens]`. Any torch function of its inputs; it must be
    the same on every tp rank.

    `extra`: a term of the policy's logits beside token_loss (parallel/distill_chunk.py's DistillChunkTerm, over
    the flattened tokens): its value joins the loss and its gradient the policy's, chunk by chunk, before the
    gradient matmuls: one weight-gradient accumulator for both.

    Returns (loss: 0-d tensor with grad to hidden and weight_local, stats: FusedHeadOutput of the
    detached per-token values, shaped like targets, fields not requested None)."""
    if not callable(token_loss):
        raise TypeError(f"token_loss must be callable, got {type(token_loss).__name__}")
    ph = prepare_head(hidden, weight_local, targets, tp_group, vocab_size, ref_hidden, ref_weight_local,
                      temperature, entropy, kl, fp32, "fused_head_loss", mask, chunk_size)
    ref_hidden = None if ph.ref_hidden is None else ph.ref_hidden.detach()
    if extra is not None:
        extra.bind(ph.sh, ph.keep, ph.hidden.shape[0], weight_local.shape[0])
    ref_weight = None if ref_weight_local is None else ref_weight_local.detach()
    loss, *outs = _FusedHeadLoss.apply(ph.hidden, weight_local, ref_hidden, ref_weight, ph.targets, ph.keep,
                                       ph.sh, ph.spec, ph.chunk_size, token_loss, extra)
    got = {name: o.reshape(ph.lead) for name, o in zip(ph.spec.outputs, outs)}
    return loss, FusedHeadOutput(*(got.get(k) for k in FusedHeadOutput._fields))
