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

Forward, per chunk of `chunk_size` tokens (None or "auto", the default: chosen from this rank's
head shard [Vp/tp, H] by parallel/vocab_stats.py's auto_chunk_size: each [chunk, Vp/tp] fp32
temporary <= 128 MiB and <= 1/8 of the weight gradient's bytes (chunk <= H/16 for bf16 weights,
H/8 fp32) unless that is under 8 MiB, clamped to [128, T]; the results do not depend on it):
logits = hidden_c @ weight_local.T (no bias), reduced to local statistics (parallel/vocab.py's
core) and freed; after the last chunk the same two O(T) collectives as the unfused functions finish
the values. Backward recomputes each chunk's logits, forms d/dlogits locally and accumulates
grad_hidden and grad_weight; no collective. So the extra memory is O(chunk_size * Vp/tp),
independent of T.

Tensor parallelism: with tp > 1 each rank's grad_hidden is the partial sum over its vocabulary
shard. fused_head stays local and does NOT reduce it: the caller passes
`comm.copy_to_tp(hidden, tp_group)` (Megatron's "f"), whose backward all-reduces the partials,
exactly as for a column-parallel head. The same holds for ref_hidden if it requires grad.

Gradients flow to hidden and weight_local, and to ref_hidden / ref_weight_local only if they
require grad (normally the reference is frozen). When ref_hidden is None the reference logits use
`hidden` detached: no gradient reaches hidden through the reference side.

Precision: with fp32=True and bf16/fp16 weights, each chunk's logits come out of the matmul in
float32 (`torch.mm(..., out_dtype=torch.float32)` on CUDA; elsewhere a float32 matmul of upcast
operands, the weight shard upcast once per call), so they are never rounded to bf16 before the
float32 reductions. The gradient matmuls take d/dlogits in the weights' dtype, except where the
weight gradient is summed: a bf16/fp16 weight's gradient is accumulated over the chunks in fp32 and
cast once at the end (GradAccumulator; its memory price is there).

Masks: `mask` [...] (like hidden's leading dims) marks the tokens that exist. A masked token's
hidden rows (policy and reference) are read as 0, its target as "none", its outputs are 0 and its
upstream gradients are dropped before any arithmetic: NaN, inf or an out-of-range id at a padded
position reaches no value and no gradient, and the gradients equal those without the token.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from parallel import invariant
from parallel.comm import group_size
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
    resolve_chunk_size,
    vocab_shard,
)

_MM_OUT_DTYPE = ("cuda", "meta")  # devices whose torch.mm takes out_dtype= (bf16/fp16 -> fp32)


class FusedHeadOutput(NamedTuple):
    logprobs: torch.Tensor | None  # log p(target) at the temperature, [...]
    entropy: torch.Tensor | None  # H(p), [...]
    kl: torch.Tensor | None  # exact KL over the full vocabulary (direction as asked), [...]
    ref_logprobs: torch.Tensor | None  # log q(target), [...]


_UPCAST_BLOCK = 4096  # vocabulary rows of a low-precision weight upcast at a time where mm has no out_dtype
_FEW_ROWS, _FEW_ROWS_BLOCK = 64, 2048  # a CPU head matmul of at most this many rows: blocks of this many columns


class HeadMatmul:
    """logits of one chunk, [c, nv] = hidden_c [c, H] @ weight[:nv].T / temperature, in the
    reduction dtype and computed in it: an fp32 output from bf16 operands on CUDA; elsewhere the
    weight is upcast block by block (`_UPCAST_BLOCK` vocabulary rows at a time, transient), never as a
    whole fp32 copy of the shard. Masked rows (`keep` false) of hidden read as 0."""

    def __init__(self, weight: torch.Tensor, sh: VocabShard):
        self.sh = sh
        self.full, self.w = weight, weight[: sh.nv]
        low = weight.dtype in (torch.bfloat16, torch.float16)
        self.out_dtype = low and sh.dtype == torch.float32 and weight.device.type in _MM_OUT_DTYPE
        self.upcast = weight.dtype != sh.dtype and not self.out_dtype

    def __call__(self, h: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        h = rows(h, keep)
        n = h.shape[0]
        if invariant.enabled():  # a token's logits independent of the chunk's row count
            h = invariant.pad_rows(h)
        with no_autocast(h.device.type):  # under a caller's autocast the matmul would round to bf16
            if self.out_dtype:
                z = torch.mm(h, self.w.T, out_dtype=self.sh.dtype)
            elif self.upcast:
                z = _blocked_mm(h.to(self.sh.dtype), self.full, self.sh.nv, _UPCAST_BLOCK, self.sh.dtype)
            elif (n <= _FEW_ROWS or invariant.enabled()) and self.full.shape[0] > _FEW_ROWS_BLOCK \
                    and h.device.type == "cpu":
                # a decode step's few rows: blocked over the vocabulary (one [n, V] product leaves the CPU
                # BLAS at a fraction of its rate: 512 x 32000 at 8 rows measured 15.8 -> 11.2 ms on one
                # thread, at 32 rows 22 -> 17 ms on two). In batch-invariant mode every chunk is blocked
                # alike, so that the decode's rows and the trainer's go through the same [rows, H] @ [H, block]
                # products (a row's bits do not depend on the row count: the padding to ROW_BLOCK)
                z = _blocked_mm(h.to(self.w.dtype), self.full, self.sh.nv, _FEW_ROWS_BLOCK, self.w.dtype)
            else:
                z = h.to(self.w.dtype) @ self.w.T  # a fresh tensor: scaled in place
        z = z[:n]
        return z.div_(self.sh.temperature) if self.sh.temperature != 1.0 else z


def _blocked_mm(h: torch.Tensor, w: torch.Tensor, nv: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """h [n, H] @ w[:nv].T as a fresh [n, nv] tensor, in blocks of `block` rows of w counted from row 0 of
    the whole w (a last block running past nv is computed whole and cut: the blocks, and so each logit's
    bits, do not depend on nv; the decode's head reads the whole padded shard, the trainer's its first
    nv rows), each block cast to `dtype` (h's) just before its matmul."""
    z = h.new_empty((h.shape[0], nv))
    for a in range(0, nv, block):
        b = min(a + block, w.shape[0])
        if b <= nv:
            torch.mm(h, w[a:b].to(dtype).T, out=z[:, a:b])
        else:
            z[:, a:] = torch.mm(h, w[a:b].to(dtype).T)[:, : nv - a]
    return z  # (no name holds a cast block into the next one's cast: one transient block at a time)


def head_logits(hidden: torch.Tensor, weight_local: torch.Tensor, group=None) -> torch.Tensor:
    """hidden [*, H] -> this rank's logits [*, Vp/tp] computed as the fused heads compute them (in fp32
    for a bf16/fp16 weight; rows padded in batch-invariant mode): the batch-invariant decode head, so the
    sampler sees the trainer's logits bit for bit."""
    sh = vocab_shard(weight_local.shape[0], group, None, 1.0, weight_local.dtype, fp32=True)
    return HeadMatmul(weight_local, sh)(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1)


def no_autocast(device_type: str):
    """Autocast switched off on `device_type` (a no-op context where autocast does not exist)."""
    if device_type in ("cuda", "cpu"):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def rows(h: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """h [c, H] with the rows of masked tokens replaced by 0 (selected, never multiplied)."""
    return h if keep is None else torch.where(keep[:, None], h, h.new_zeros(()))


def part(x: torch.Tensor | None, s: int, e: int) -> torch.Tensor | None:
    return None if x is None else x[s:e]


class _FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ref_hidden, ref_weight, targets, keep, sh, spec: StatsSpec, chunk_size):
        T = hidden.shape[0]
        maxes, sums = spec.buffers(T, hidden, sh.dtype)
        tl = sh.local_index(targets)
        mm_p = HeadMatmul(weight, sh)
        mm_q = HeadMatmul(ref_weight, sh) if spec.has_q else None
        for s, e in chunks(T, chunk_size):
            kc = part(keep, s, e)
            zp = mm_p(hidden[s:e], kc)
            zq = mm_q(ref_hidden[s:e], kc) if spec.has_q else None
            tsel = None if tl is None else (tl[0][s:e], tl[1][s:e])
            local_stats(zp, zq, tsel, spec, maxes[s:e], sums[s:e], inplace=True)  # the logits die here
            del zp, zq
        st = reduce_stats(maxes, sums, spec, sh.group)
        ctx.sh, ctx.spec, ctx.chunk_size = sh, spec, chunk_size
        ctx.keys = [k for k in SAVED if k in st]
        ctx.save_for_backward(hidden, weight, ref_hidden, ref_weight, targets, keep, *[st[k] for k in ctx.keys])
        ctx.set_materialize_grads(False)
        return tuple(masked(st[k], keep) for k in spec.outputs)

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, ref_hidden, ref_weight, targets, keep, *saved = ctx.saved_tensors
        sh, spec = ctx.sh, ctx.spec
        st_all = dict(zip(ctx.keys, saved))
        g_all = dict(zip(spec.outputs, grads))
        need = ctx.needs_input_grad
        want_q = spec.has_q and (need[2] or need[3])
        acc = GradAccumulator(hidden, weight, ref_hidden, ref_weight, need, sh.nv)
        tl = sh.local_index(targets)
        mm_p = HeadMatmul(weight, sh)
        mm_q = HeadMatmul(ref_weight, sh) if spec.has_q else None
        for s, e in chunks(hidden.shape[0], ctx.chunk_size):
            kc = part(keep, s, e)
            zp = mm_p(hidden[s:e], kc)  # recomputed: the forward kept no logits
            zq = mm_q(ref_hidden[s:e], kc) if spec.has_q else None
            tsel = None if tl is None else (tl[0][s:e], tl[1][s:e])
            g = {k: masked(part(v, s, e), kc) for k, v in g_all.items()}
            gp, gq = grad_logits(zp, zq, tsel, {k: v[s:e] for k, v in st_all.items()}, g, spec, want_q,
                                 sh.temperature, inplace=True)  # gp, log q in the logits' buffers
            del zp, zq
            acc.add(s, e, kc, gp, gq if want_q else None)
            del gp, gq  # before the next chunk's logits exist
        return (*acc.grads(), None, None, None, None, None)


class GradAccumulator:
    """grad_hidden [T, H] (rows written per chunk), grad_weight [Vp/tp, H] (summed over chunks), and
    the same for the reference side, from each chunk's d/dlogits. grad_hidden is in hidden's dtype; a
    bf16/fp16 weight's gradient is summed over the chunks in an fp32 accumulator [Vp/tp, H] and cast
    to the weight's dtype once, by `grads` (summed in bf16, every chunk's addition rounded: the error
    grew with the number of chunks). The price for low-precision weights: the accumulator holds 2x the
    gradient's bytes, and the gradient handed out keeps them (it is cast into the accumulator's own
    storage, `cast_in_place`, so that no third copy exists at the cast) until autograd or FSDP frees it."""

    def __init__(self, hidden, weight, ref_hidden, ref_weight, need, nv: int):
        self.h, self.w, self.rh, self.rw, self.nv = hidden, weight, ref_hidden, ref_weight, nv
        params = (hidden, weight, ref_hidden, ref_weight)
        self.g = [None if not n else torch.zeros_like(x, dtype=_acc_dtype(x) if i % 2 else x.dtype)
                  for i, (x, n) in enumerate(zip(params, need))]

    def add(self, s: int, e: int, keep, gp: torch.Tensor, gq: torch.Tensor | None) -> None:
        for i, (dz, h, w) in enumerate(((gp, self.h, self.w), (gq, self.rh, self.rw))):
            if dz is None:
                continue
            gh, gw = self.g[2 * i], self.g[2 * i + 1]
            dz_w = dz.to(w.dtype)
            if gh is not None:
                torch.matmul(dz_w, w[: self.nv], out=gh[s:e])
            if gw is not None:  # masked rows of dz are 0 and of h read as 0: they add exactly nothing
                add_weight_grad(gw[: self.nv], dz, dz_w, rows(h[s:e], keep))

    def grads(self):
        """(grad_hidden, grad_weight, grad_ref_hidden, grad_ref_weight), each in its input's dtype;
        the accumulators are released."""
        params = (self.h, self.w, self.rh, self.rw)
        out = tuple(None if g is None else cast_in_place(g, x.dtype) for g, x in zip(self.g, params))
        self.g = [None] * 4
        return out


_CAST_FIRST_BLOCK = 1 << 16  # elements cast through a transient copy; the rest need none


def cast_in_place(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """acc (contiguous, fp32) as `dtype` (2-byte), written into the first half of acc's own storage and
    returned as a tensor of acc's shape viewing it (acc is consumed): no second [Vp/tp, H] tensor
    exists at the cast. Element i of the result occupies bytes [2i, 2i + 2), element j of acc
    [4j, 4j + 4): casting the elements [a, b) writes over acc's [a/2, b/2), all already read once
    b <= 2a. So the first block goes through a small transient copy and the next blocks double,
    [a, 2a), each a plain copy between disjoint bytes."""
    if acc.dtype == dtype:
        return acc
    if not (acc.is_contiguous() and acc.element_size() == 2 * dtype.itemsize):
        return acc.to(dtype)
    src = acc.view(-1)
    dst = src.view(dtype)[: src.numel()]  # the first half of the same bytes
    n = src.numel()
    b = min(n, _CAST_FIRST_BLOCK)
    dst[:b].copy_(src[:b].to(dtype))  # overlaps its source: via a transient of b elements
    a = b
    while a < n:
        b = min(2 * a, n)
        dst[a:b].copy_(src[a:b])  # bytes [2a, 2b) from [4a, 4b): disjoint since b <= 2a
        a = b
    return dst.view(acc.shape)


def _acc_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a weight's gradient is summed over chunks in: fp32 for bf16/fp16, else its own."""
    return torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype


def add_weight_grad(acc: torch.Tensor, dz: torch.Tensor, dz_w: torch.Tensor, h: torch.Tensor) -> None:
    """acc [nv, H] += dz^T [nv, c] @ h [c, H]. Same dtype: in place as is. A fp32 accumulator of a
    low-precision weight: on CUDA the matmul takes the weight-dtype operands (dz_w, h) and writes fp32
    (`out_dtype`, the tensor cores' fast path; dz rounded once to the weight's dtype, as the gradient
    matmuls always were); elsewhere an fp32 matmul of dz (fp32 from the reductions) and h upcast
    ([c, H], transient)."""
    if acc.dtype == dz_w.dtype:
        acc.addmm_(dz_w.T, h)
    elif acc.device.type in _MM_OUT_DTYPE:
        torch.addmm(acc, dz_w.T, h.to(dz_w.dtype), out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(dz.to(acc.dtype).T, h.to(acc.dtype))


class PreparedHead(NamedTuple):
    """The fused heads' validated, flattened inputs."""

    hidden: torch.Tensor  # [T, H]
    ref_hidden: torch.Tensor | None  # [T, H_ref]
    targets: torch.Tensor | None  # [T] int64, -1 at masked tokens
    keep: torch.Tensor | None  # [T] bool, False at masked tokens
    sh: VocabShard
    spec: StatsSpec
    lead: torch.Size  # hidden's leading dims, the outputs' shape
    chunk_size: int  # tokens per chunk, resolved ("auto" -> from T and the head [Vp/tp, H] and its dtype)


def _check_ref(hidden, weight_local, ref_hidden, ref_weight_local, kl):
    """ref_hidden [T, H_ref] (hidden detached when None) after the shape checks, or None."""
    if kl is not None and kl not in KL_DIRECTIONS:
        raise ValueError(f"kl must be None or one of {KL_DIRECTIONS}, got {kl!r}")
    if kl is not None and ref_weight_local is None:
        raise ValueError(f"kl={kl!r} needs ref_weight_local (the reference head)")
    if ref_hidden is not None and ref_weight_local is None:
        raise ValueError("ref_hidden was given without ref_weight_local")
    if hidden.dim() < 1 or weight_local.dim() != 2 or weight_local.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight_local has shape {tuple(weight_local.shape)}, expected [Vp/tp, "
                         f"{hidden.shape[-1]}] to match hidden {tuple(hidden.shape)}")
    if ref_weight_local is None:
        return None
    lead, width = hidden.shape[:-1], weight_local.shape[0]
    ref_hidden = hidden.detach() if ref_hidden is None else ref_hidden
    if tuple(ref_hidden.shape[:-1]) != tuple(lead):
        raise ValueError(f"ref_hidden has shape {tuple(ref_hidden.shape)}, expected leading dims "
                         f"{tuple(lead)} like hidden")
    if tuple(ref_weight_local.shape) != (width, ref_hidden.shape[-1]):
        raise ValueError(f"ref_weight_local has shape {tuple(ref_weight_local.shape)}, expected "
                         f"{(width, ref_hidden.shape[-1])}")
    return ref_hidden.reshape(-1, ref_hidden.shape[-1])


def prepare_head(hidden, weight_local, targets, tp_group, vocab_size, ref_hidden, ref_weight_local, temperature,
                 entropy, kl, fp32, who, mask=None, chunk_size=None) -> PreparedHead:
    """Validate the fused head's inputs (one clear error naming the culprit), flatten them and
    resolve the chunk size (None / "auto": auto_chunk_size of T and the head [Vp/tp, H] and its dtype).
    Shared by fused_head and parallel/fused_loss.py's fused_head_loss."""
    ref_hidden = _check_ref(hidden, weight_local, ref_hidden, ref_weight_local, kl)
    lead, width = hidden.shape[:-1], weight_local.shape[0]
    has_q = ref_hidden is not None
    sh = vocab_shard(width, tp_group, vocab_size, temperature, weight_local.dtype, fp32)
    vocab = width * group_size(tp_group) if vocab_size is None else vocab_size
    keep = check_mask(mask, lead)
    t = None if targets is None else check_targets(targets, lead, vocab, keep=keep)
    outputs = tuple(name for name, on in (("logprobs", t is not None), ("entropy", entropy),
                                          ("kl", kl is not None), ("ref_logprobs", t is not None and has_q))
                    if on)
    if not outputs:
        raise ValueError(f"{who} was asked for nothing: pass targets, entropy=True or kl=...")
    spec = StatsSpec(has_q, t is not None, bool(entropy), kl, outputs)
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = resolve_chunk_size(chunk_size, flat.shape[0], width, weight_local.shape[1], weight_local.element_size())
    return PreparedHead(flat, ref_hidden, t, keep, sh, spec, lead, chunk)


def fused_head(hidden, weight_local, targets=None, tp_group=None, *, vocab_size=None, ref_hidden=None,
               ref_weight_local=None, temperature=1.0, chunk_size=None, entropy=True, kl=None,
               fp32=True, mask=None) -> FusedHeadOutput:
    """Log-probs of `targets`, entropy and exact KL (kl="forward": KL(p||q), "reverse": KL(q||p)) of
    the head logits = hidden @ weight_local.T, sharded on the vocabulary over tp_group, against the
    reference logits = ref_hidden @ ref_weight_local.T. Fields not requested are None; ref_logprobs
    is filled when both targets and ref_weight_local are given. `mask` [...] (optional, like
    targets): tokens to drop, exactly (see the module docstring). `chunk_size`: tokens per chunk, an
    int or None / "auto" (chunk x Vp/tp <= 2^25 elements and, above 2^21, chunk <= H/16 in bf16,
    H/8 in fp32; in [128, T]; auto_chunk_size). See the module docstring for the copy_to_tp contract at tp > 1."""
    ph = prepare_head(hidden, weight_local, targets, tp_group, vocab_size, ref_hidden, ref_weight_local,
                      temperature, entropy, kl, fp32, "fused_head", mask, chunk_size)
    outs = _FusedHead.apply(ph.hidden, weight_local, ph.ref_hidden, ref_weight_local, ph.targets, ph.keep, ph.sh,
                            ph.spec, ph.chunk_size)
    got = {name: o.reshape(ph.lead) for name, o in zip(ph.spec.outputs, outs)}
    return FusedHeadOutput(*(got.get(k) for k in FusedHeadOutput._fields))
