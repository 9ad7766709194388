"""Fused vocab-parallel head: hidden states and sharded head weights -> target log-probs, entropy and
the exact KL to a reference, chunked over tokens, never holding a [T, V] logits tensor.

| tensor             | shape          | layout                                                |
|--------------------|----------------|-------------------------------------------------------|
| hidden             | [..., H]       | replicated over tp_group                              |
| weight_local       | [Vp/tp, H]     | sharded on the vocabulary (rows = global ids of rank) |
| ref_hidden         | [..., H_ref]   | replicated (defaults to `hidden`, as a constant)      |
| ref_weight_local   | [Vp/tp, H_ref] | sharded like weight_local                             |
| targets            | [...]          | global token ids                                      |
| outputs            | [...] each     | replicated                                            |

Forward, per chunk of `chunk_size` tokens: logits = hidden_c @ weight_local.T (no bias), reduced
to local statistics (parallel/vocab.py's core) and freed; after the last chunk the same two O(T)
collectives as the unfused functions finish the values. Backward recomputes each chunk's logits,
forms d/dlogits locally and accumulates grad_hidden and grad_weight; no collective. So the extra
memory is O(chunk_size * Vp/tp), independent of T.

Tensor parallelism: with tp > 1 each rank's grad_hidden is the partial sum over its vocabulary
shard. fused_head stays local and does NOT reduce it: the caller passes
`comm.copy_to_tp(hidden, tp_group)` (Megatron's "f"), whose backward all-reduces the partials,
exactly as for a column-parallel head. The same holds for ref_hidden if it requires grad.

Gradients flow to hidden and weight_local, and to ref_hidden / ref_weight_local only if they
require grad (normally the reference is frozen). When ref_hidden is None the reference logits use
`hidden` detached: no gradient reaches hidden through the reference side.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from parallel.comm import group_size
from parallel.vocab import (
    KL_DIRECTIONS,
    StatsSpec,
    check_targets,
    chunks,
    grad_logits,
    local_stats,
    reduce_stats,
    vocab_shard,
)


class FusedHeadOutput(NamedTuple):
    logprobs: torch.Tensor | None  # log p(target) at the temperature, [...]
    entropy: torch.Tensor | None  # H(p), [...]
    kl: torch.Tensor | None  # exact KL over the full vocabulary (direction as asked), [...]
    ref_logprobs: torch.Tensor | None  # log q(target), [...]


def _logits(h: torch.Tensor, w: torch.Tensor, sh) -> torch.Tensor:
    """One chunk's valid logits / temperature, [c, nv], in the reduction dtype."""
    z = (h @ w[: sh.nv].T).to(sh.dtype)  # a fresh tensor: scaled in place
    return z.div_(sh.temperature) if sh.temperature != 1.0 else z


class _FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ref_hidden, ref_weight, targets, sh, spec: StatsSpec, chunk_size):
        T = hidden.shape[0]
        maxes = torch.empty(T, 1 + spec.has_q, dtype=sh.dtype)
        sums = torch.empty(T, len(spec.cols), dtype=sh.dtype)
        tl = sh.local_index(targets)
        for s, e in chunks(T, chunk_size):
            zp = _logits(hidden[s:e], weight, sh)
            zq = _logits(ref_hidden[s:e], ref_weight, sh) if spec.has_q else None
            tsel = None if tl is None else (tl[0][s:e], tl[1][s:e])
            local_stats(zp, zq, tsel, spec, maxes[s:e], sums[s:e])
            del zp, zq
        st = reduce_stats(maxes, sums, spec, sh.group)
        ctx.sh, ctx.spec, ctx.chunk_size = sh, spec, chunk_size
        ctx.keys = [k for k in ("lse", "lse_q", "dlse", "entropy", "kl") if k in st]
        ctx.save_for_backward(hidden, weight, ref_hidden, ref_weight, targets, *[st[k] for k in ctx.keys])
        ctx.set_materialize_grads(False)
        return tuple(st[k] for k in spec.outputs)

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, ref_hidden, ref_weight, targets, *saved = ctx.saved_tensors
        sh, spec = ctx.sh, ctx.spec
        st_all = dict(zip(ctx.keys, saved))
        g_all = dict(zip(spec.outputs, grads))
        need = ctx.needs_input_grad
        want_q = spec.has_q and (need[2] or need[3])
        gh = torch.zeros_like(hidden) if need[0] else None
        gw = torch.zeros_like(weight) if need[1] else None
        grh = torch.zeros_like(ref_hidden) if need[2] else None
        grw = torch.zeros_like(ref_weight) if need[3] else None
        tl = sh.local_index(targets)
        for s, e in chunks(hidden.shape[0], ctx.chunk_size):
            zp = _logits(hidden[s:e], weight, sh)  # recomputed: the forward kept no logits
            zq = _logits(ref_hidden[s:e], ref_weight, sh) if spec.has_q else None
            tsel = None if tl is None else (tl[0][s:e], tl[1][s:e])
            g = {k: (None if v is None else v[s:e]) for k, v in g_all.items()}
            gp, gq = grad_logits(zp, zq, tsel, {k: v[s:e] for k, v in st_all.items()}, g, spec, want_q,
                                 sh.temperature)
            del zp, zq
            gp = gp.to(weight.dtype)
            if gh is not None:
                torch.matmul(gp, weight[: sh.nv], out=gh[s:e])
            if gw is not None:
                gw[: sh.nv].addmm_(gp.T, hidden[s:e])
            if want_q:
                gq = gq.to(ref_weight.dtype)
                if grh is not None:
                    torch.matmul(gq, ref_weight[: sh.nv], out=grh[s:e])
                if grw is not None:
                    grw[: sh.nv].addmm_(gq.T, ref_hidden[s:e])
        return gh, gw, grh, grw, None, None, None, None


def prepare_head(hidden, weight_local, targets, tp_group, vocab_size, ref_hidden, ref_weight_local, temperature,
                 entropy, kl, fp32, who):
    """Validate the fused head's inputs (one clear error naming the culprit) and flatten them:
    (hidden [T, H], ref_hidden [T, H_ref] or None, targets [T] or None, VocabShard, StatsSpec, lead dims).
    Shared by fused_head and parallel/fused_loss.py's fused_head_loss."""
    if kl is not None and kl not in KL_DIRECTIONS:
        raise ValueError(f"kl must be None or one of {KL_DIRECTIONS}, got {kl!r}")
    if kl is not None and ref_weight_local is None:
        raise ValueError(f"kl={kl!r} needs ref_weight_local (the reference head)")
    if ref_hidden is not None and ref_weight_local is None:
        raise ValueError("ref_hidden was given without ref_weight_local")
    if hidden.dim() < 1 or weight_local.dim() != 2 or weight_local.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight_local has shape {tuple(weight_local.shape)}, expected [Vp/tp, "
                         f"{hidden.shape[-1]}] to match hidden {tuple(hidden.shape)}")
    lead, H = hidden.shape[:-1], hidden.shape[-1]
    width = weight_local.shape[0]
    has_q = ref_weight_local is not None
    if has_q:
        ref_hidden = hidden.detach() if ref_hidden is None else ref_hidden
        if tuple(ref_hidden.shape[:-1]) != tuple(lead):
            raise ValueError(f"ref_hidden has shape {tuple(ref_hidden.shape)}, expected leading dims "
                             f"{tuple(lead)} like hidden")
        if tuple(ref_weight_local.shape) != (width, ref_hidden.shape[-1]):
            raise ValueError(f"ref_weight_local has shape {tuple(ref_weight_local.shape)}, expected "
                             f"{(width, ref_hidden.shape[-1])}")
        ref_hidden = ref_hidden.reshape(-1, ref_hidden.shape[-1])
    sh = vocab_shard(width, tp_group, vocab_size, temperature, weight_local.dtype, fp32)
    vocab = width * group_size(tp_group) if vocab_size is None else vocab_size
    t = None if targets is None else check_targets(targets, lead, vocab)
    outputs = tuple(name for name, on in (("logprobs", t is not None), ("entropy", entropy),
                                          ("kl", kl is not None), ("ref_logprobs", t is not None and has_q))
                    if on)
    if not outputs:
        raise ValueError(f"{who} was asked for nothing: pass targets, entropy=True or kl=...")
    spec = StatsSpec(has_q, t is not None, bool(entropy), kl, outputs)
    return hidden.reshape(-1, H), ref_hidden, t, sh, spec, lead


def fused_head(hidden, weight_local, targets=None, tp_group=None, *, vocab_size=None, ref_hidden=None,
               ref_weight_local=None, temperature=1.0, chunk_size=1024, entropy=True, kl=None,
               fp32=True) -> FusedHeadOutput:
    """Log-probs of `targets`, entropy and exact KL (kl="forward": KL(p||q), "reverse": KL(q||p)) of
    the head logits = hidden @ weight_local.T, sharded on the vocabulary over tp_group, against the
    reference logits = ref_hidden @ ref_weight_local.T. Fields not requested are None; ref_logprobs
    is filled when both targets and ref_weight_local are given. See the module docstring for the
    copy_to_tp contract at tp > 1."""
    hidden2d, ref_hidden, t, sh, spec, lead = prepare_head(
        hidden, weight_local, targets, tp_group, vocab_size, ref_hidden, ref_weight_local, temperature, entropy,
        kl, fp32, "fused_head")
    outs = _FusedHead.apply(hidden2d, weight_local, ref_hidden, ref_weight_local, t, sh, spec,
                            chunk_size)
    got = {name: o.reshape(lead) for name, o in zip(spec.outputs, outs)}
    return FusedHeadOutput(*(got.get(k) for k in FusedHeadOutput._fields))
