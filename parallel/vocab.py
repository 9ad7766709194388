"""Vocab-parallel softmax statistics over materialised, sharded logits without gathering them:
logsumexp, log-softmax, target log-probs, cross entropy, entropy and the exact KL between two
sharded logit tensors. The per-chunk statistics, the collectives and the local gradient live in
parallel/vocab_stats.py (shared with the fused heads); this file holds the autograd functions and
the public entry points.

Shapes: `logits_local: [..., Vp/tp]`, sharded on the vocabulary over `tp_group`; rank r holds the
global ids [r*Vp/tp, (r+1)*Vp/tp). Leading dims are flattened to T tokens. Columns whose global id
is >= `vocab_size` (padding) are never read: every computation runs on the rank's valid prefix
`[:, :nv]` (nv may be 0 on a rank that holds only padding), so no -inf is ever multiplied.

Math, per token, with z = logits / temperature (p the policy, q the other side), m = max z,
s = z - m, S = sum exp(s) (see parallel/vocab_stats.py for why everything is built from s):
  log p(y)   = s_y - log S                         d/dz = onehot(y) - p
  H(p)       = log S - sum p s                     d/dz = -p (log p + H)
  KL(p||q)   = sum p (s_p - s_q) - log(S_p/S_q)    d/dz_p = p (log p - log q - KL), d/dz_q = q - p
Identical inputs give exactly 0.0 KL and gradient; a -inf logit is an exact p = 0.

Communication per call, whatever the number of token chunks: one all-reduce(MAX) of the local
maxima [T, 1|2] and one all-gather of [T, <=6] partial sums (then summed in rank order), each
computed against the rank's own maximum and rescaled once the global maximum is known. Each rank
sends O(T) floats (receives O(T*tp)), never O(T*V).
Every backward is local, except log_softmax's, whose upstream gradient is an arbitrary sharded
[T, V/tp] tensor: it needs one all-reduce of sum_v grad ([T] floats).

Precision: with `fp32=True` (default) bf16/fp16 logits are reduced in float32 (float64 stays
float64) and the returned values are float32; `fp32=False` keeps the input dtype throughout
(for experiments). The logits themselves are what the caller made: to avoid rounding them to bf16
first, produce them in fp32 (the fused heads of parallel/fused.py do). Gradients are returned in
the logits' dtype. `chunk_size` processes tokens in chunks so the working memory is
O(chunk_size * V/tp) beyond the gradient itself.

Masks: `mask` [...] (bool, like the leading dims) marks the tokens that exist; at a masked token
the logits, the target and the upstream gradient are replaced before any arithmetic, the value is
0 and the gradient exactly 0, whatever the padding holds (NaN, inf, an out-of-range id).

Temperature: every function sees z = logits / temperature, so log-probs of sampled tokens are
those of the sampling distribution.
"""

from __future__ import annotations

import torch

from parallel.comm import all_reduce, group_size
from parallel.vocab_stats import (
    KL_DIRECTIONS,
    SAVED,
    StatsSpec,
    VocabShard,
    check_mask,
    check_targets,
    chunks,
    grad_logits,
    local_stats,
    masked,
    reduce_stats,
    vocab_shard,
)

__all__ = [
    "KL_DIRECTIONS",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_kl",
    "vocab_parallel_log_softmax",
    "vocab_parallel_logprobs",
    "vocab_parallel_logsumexp",
]


class _VocabStats(torch.autograd.Function):
    """logits_p [T, Vp/tp] (and logits_q) -> the requested [T] values; backward is local."""

    @staticmethod
    def forward(ctx, logits_p, logits_q, targets, keep, sh: VocabShard, spec: StatsSpec, chunk_size):
        T = logits_p.shape[0]
        maxes, sums = spec.buffers(T, logits_p, sh.dtype)
        for s, e in chunks(T, chunk_size):
            zp, zq, tsel = _chunk(logits_p, logits_q, targets, keep, sh, s, e)
            local_stats(zp, zq, tsel, spec, maxes[s:e], sums[s:e])
        st = reduce_stats(maxes, sums, spec, sh.group)
        ctx.sh, ctx.spec, ctx.chunk_size = sh, spec, chunk_size
        ctx.keys = [k for k in SAVED if k in st]
        ctx.save_for_backward(logits_p, logits_q, targets, keep, *[st[k] for k in ctx.keys])
        ctx.set_materialize_grads(False)
        return tuple(masked(st[k], keep) for k in spec.outputs)

    @staticmethod
    def backward(ctx, *grads):
        logits_p, logits_q, targets, keep, *saved = ctx.saved_tensors
        sh, spec = ctx.sh, ctx.spec
        st_all = dict(zip(ctx.keys, saved))
        g_all = dict(zip(spec.outputs, grads))
        want_q = ctx.needs_input_grad[1]
        grad_p = torch.zeros_like(logits_p) if ctx.needs_input_grad[0] else None
        grad_q = torch.zeros_like(logits_q) if want_q else None
        for s, e in chunks(logits_p.shape[0], ctx.chunk_size):
            zp, zq, tsel = _chunk(logits_p, logits_q, targets, keep, sh, s, e)
            kc = None if keep is None else keep[s:e]
            g = {k: masked(None if v is None else v[s:e], kc) for k, v in g_all.items()}
            gp, gq = grad_logits(zp, zq, tsel, {k: v[s:e] for k, v in st_all.items()}, g, spec, want_q,
                                 sh.temperature)
            if grad_p is not None:
                grad_p[s:e, : sh.nv] = gp
            if want_q:
                grad_q[s:e, : sh.nv] = gq
        return grad_p, grad_q, None, None, None, None, None


def _chunk(logits_p, logits_q, targets, keep, sh: VocabShard, s: int, e: int):
    """Tokens [s, e): (z_p [c, nv], z_q or None, (local target column, held here) or None)."""
    kc = None if keep is None else keep[s:e]
    zq = None if logits_q is None else sh.scaled(logits_q[s:e], kc)
    tl = sh.local_index(None if targets is None else targets[s:e])
    return sh.scaled(logits_p[s:e], kc), zq, tl


def _run(logits_p, logits_q, targets, tp_group, spec, *, vocab_size, temperature, fp32, chunk_size,
         grad_q=False, ignore_index=None, mask=None):
    if logits_p.dim() < 1:
        raise ValueError("logits must have a vocabulary dim, got a scalar")
    lead, width = logits_p.shape[:-1], logits_p.shape[-1]
    if logits_q is not None and logits_q.shape != logits_p.shape:
        raise ValueError(f"the two logit tensors differ in shape: {tuple(logits_p.shape)} vs "
                         f"{tuple(logits_q.shape)}")
    sh = vocab_shard(width, tp_group, vocab_size, temperature, logits_p.dtype, fp32)
    vocab = sh.width * group_size(tp_group) if vocab_size is None else vocab_size
    keep = check_mask(mask, lead)
    t = None if targets is None else check_targets(targets, lead, vocab, ignore_index, keep)
    p = logits_p.reshape(-1, width)
    q = None if logits_q is None else logits_q.reshape(-1, width)
    if q is not None and not grad_q:
        q = q.detach()
    outs = _VocabStats.apply(p, q, t, keep, sh, spec, chunk_size)
    return [o.reshape(lead) for o in outs]


def vocab_parallel_logsumexp(logits_local, tp_group=None, *, vocab_size=None, temperature=1.0, fp32=True,
                             chunk_size=None, mask=None):
    """logsumexp over the full vocabulary of logits/temperature: [..., Vp/tp] sharded -> [...]."""
    spec = StatsSpec(False, False, False, None, ("lse",))
    return _run(logits_local, None, None, tp_group, spec, vocab_size=vocab_size, temperature=temperature,
                fp32=fp32, chunk_size=chunk_size, mask=mask)[0]


def vocab_parallel_logprobs(logits_local, targets, tp_group=None, *, vocab_size=None, temperature=1.0,
                            fp32=True, chunk_size=None, mask=None):
    """log p(target) under softmax(logits/temperature): [..., Vp/tp] sharded, targets [...] global
    ids -> [...]. Two O(T) collectives (max; sum-exp with the target logit); local backward."""
    spec = StatsSpec(False, True, False, None, ("logprobs",))
    return _run(logits_local, None, targets, tp_group, spec, vocab_size=vocab_size, temperature=temperature,
                fp32=fp32, chunk_size=chunk_size, mask=mask)[0]


def vocab_parallel_cross_entropy(logits_local, targets, tp_group=None, *, vocab_size=None, ignore_index=-100,
                                 fp32=True, chunk_size=None, mask=None):
    """Per-token -log p(target): [..., Vp/tp] sharded -> [...], exactly 0 (and zero gradient) where
    targets == ignore_index or mask is false. Two O(T) collectives (max; sum-exp with the target
    logit), local backward."""
    ignored = targets == ignore_index
    keep = ~ignored if mask is None else (mask.bool() & ~ignored)
    spec = StatsSpec(False, True, False, None, ("logprobs",))
    lp = _run(logits_local, None, targets, tp_group, spec, vocab_size=vocab_size, temperature=1.0,
              fp32=fp32, chunk_size=chunk_size, ignore_index=ignore_index, mask=keep)[0]
    return torch.where(keep, -lp, lp.new_zeros(()))  # +0.0, not -0.0, where ignored


def vocab_parallel_entropy(logits_local, tp_group=None, *, vocab_size=None, temperature=1.0, fp32=True,
                           chunk_size=None, mask=None):
    """Entropy of softmax(logits/temperature) over the full vocabulary: [..., Vp/tp] sharded -> [...]."""
    spec = StatsSpec(False, False, True, None, ("entropy",))
    return _run(logits_local, None, None, tp_group, spec, vocab_size=vocab_size, temperature=temperature,
                fp32=fp32, chunk_size=chunk_size, mask=mask)[0]


def vocab_parallel_kl(logits_p_local, logits_q_local, tp_group=None, *, vocab_size=None, direction="forward",
                      temperature=1.0, fp32=True, chunk_size=None, grad_q=False, mask=None):
    """Exact KL over the full vocabulary between p = softmax(logits_p/T) (the policy) and
    q = softmax(logits_q/T): forward = KL(p||q), reverse = KL(q||p). Both [..., Vp/tp] sharded the same
    way -> [...]. Gradient flows to logits_p; to logits_q only with grad_q=True (else q is a constant).
    +inf where the first argument's distribution puts mass on a -inf logit of the second."""
    if direction not in KL_DIRECTIONS:
        raise ValueError(f"direction must be one of {KL_DIRECTIONS}, got {direction!r}")
    spec = StatsSpec(True, False, False, direction, ("kl",))
    return _run(logits_p_local, logits_q_local, None, tp_group, spec, vocab_size=vocab_size,
                temperature=temperature, fp32=fp32, chunk_size=chunk_size, grad_q=grad_q, mask=mask)[0]


class _LogSoftmax(torch.autograd.Function):
    """x [T, Vp/tp] -> log softmax [T, Vp/tp]; a masked row (`keep` false) reads as 0 and returns 0
    everywhere, its upstream gradient is dropped before any arithmetic (and before the all-reduce)."""

    @staticmethod
    def forward(ctx, x, keep, sh: VocabShard):
        spec = StatsSpec(False, False, False, None, ("lse",))
        maxes, sums = spec.buffers(x.shape[0], x, sh.dtype)
        z = sh.scaled(x, keep)
        local_stats(z, None, None, spec, maxes, sums)
        st = reduce_stats(maxes, sums, spec, sh.group)
        out = x.new_full((x.shape[0], sh.width), float("-inf"), dtype=sh.dtype)
        out[:, : sh.nv] = (z - st["m"][:, None]) - st["logS"][:, None]  # no large lse subtracted
        if keep is not None:  # a masked row is 0, padded columns included (its siblings' value 0)
            out = torch.where(keep[:, None], out, out.new_zeros(()))
        ctx.sh = sh
        ctx.save_for_backward(out, keep)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, keep = ctx.saved_tensors
        sh = ctx.sh
        g = grad[:, : sh.nv].to(sh.dtype)
        if keep is not None:  # selected, never multiplied: NaN or inf upstream at a masked row vanishes
            g = torch.where(keep[:, None], g, g.new_zeros(()))
        s = g.sum(1)
        # the upstream gradient is sharded over the vocabulary: sum_v grad_v over all ranks, T floats
        all_reduce(s, "sum", sh.group)
        gx = grad.new_zeros(out.shape)
        gx[:, : sh.nv] = (g - torch.exp(out[:, : sh.nv]) * s[:, None]) / sh.temperature  # 0 at masked rows
        return gx, None, None


def vocab_parallel_log_softmax(logits_local, tp_group=None, *, vocab_size=None, temperature=1.0, fp32=True,
                               mask=None):
    """log softmax(logits/temperature) over the full vocabulary: [..., Vp/tp] sharded -> [..., Vp/tp]
    sharded the same way; padded columns hold -inf (probability 0). `mask` [...] (optional, the leading
    dims): at a masked token the output row is 0 and its gradient exactly 0, whatever the logits or the
    upstream gradient hold there (NaN, inf). Backward: one all-reduce of T floats."""
    lead, width = logits_local.shape[:-1], logits_local.shape[-1]
    sh = vocab_shard(width, tp_group, vocab_size, temperature, logits_local.dtype, fp32)
    keep = check_mask(mask, lead)
    return _LogSoftmax.apply(logits_local.reshape(-1, width), keep, sh).reshape(*lead, width)
