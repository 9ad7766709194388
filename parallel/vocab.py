"""Vocab-parallel softmax statistics without gathering logits: logsumexp, log-softmax, target
log-probs, cross entropy, entropy and the exact KL between two sharded logit tensors.

Shapes: `logits_local: [..., Vp/tp]`, sharded on the vocabulary over `tp_group`; rank r holds the
global ids [r*Vp/tp, (r+1)*Vp/tp). Leading dims are flattened to T tokens. Columns whose global id
is >= `vocab_size` (padding) are never read: every computation runs on the rank's valid prefix
`[:, :nv]` (nv may be 0 on a rank that holds only padding), so no -inf is ever multiplied.

Math, per token, with z = logits / temperature (p the policy, q the other side):
  m = max_v z,  S = sum_v exp(z - m),  lse = m + log S,  p = exp(z - lse)
  log p(y)   = z_y - lse                         d/dz = onehot(y) - p
  H(p)       = log S - sum p (z - m)             d/dz = -p (log p + H)
  KL(p||q)   = sum p (z_p - z_q) - (lse_p - lse_q)  d/dz_p = p (log p - log q - KL), d/dz_q = q - p
(lse_p - lse_q = m_p - m_q + log(S_p/S_q): identical inputs give sum p*0 = 0 minus 0: exactly 0.0.)

Communication per call, whatever the number of token chunks: one all-reduce(MAX) of the local
maxima [T, 1|2] and one all-gather of [T, <=6] partial sums (then summed in rank order), each
computed against the rank's own maximum and rescaled once the global maximum is known. Each rank
sends O(T) floats (receives O(T*tp)), never O(T*V).
Every backward is local, except log_softmax's, whose upstream gradient is an arbitrary sharded
[T, V/tp] tensor: it needs one all-reduce of sum_v grad ([T] floats).

Precision: with `fp32=True` (default) bf16/fp16 logits are reduced in float32 (float64 stays
float64) and the returned values are float32; `fp32=False` keeps the input dtype throughout
(for experiments). Gradients are returned in the logits' dtype. `chunk_size` processes tokens in
chunks so the working memory is O(chunk_size * V/tp) beyond the gradient itself.

Temperature: every function sees z = logits / temperature, so log-probs of sampled tokens are
those of the sampling distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.comm import all_gather_along, all_reduce, group_rank, group_size

KL_DIRECTIONS = ("forward", "reverse")


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's columns sit in the global vocabulary, and how to reduce them."""

    group: object
    start: int  # global id of local column 0
    width: int  # local columns, padding included (Vp/tp)
    nv: int  # valid local columns: global ids [start, start + nv) are < vocab_size
    temperature: float
    dtype: torch.dtype  # reduction dtype

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        """z = x[:, :nv] / temperature in the reduction dtype (a view when nothing changes)."""
        z = x[:, : self.nv].to(self.dtype)
        return z / self.temperature if self.temperature != 1.0 else z

    def local_index(self, targets: torch.Tensor | None):
        """(local column, held-here mask) of global target ids; ids off this rank are never picked."""
        if targets is None:
            return None
        idx = targets - self.start
        return idx.clamp(0, max(self.nv - 1, 0)), (idx >= 0) & (idx < self.nv)


def vocab_shard(width: int, group, vocab_size: int | None, temperature: float, in_dtype: torch.dtype,
                fp32: bool) -> VocabShard:
    tp, rank = group_size(group), group_rank(group)
    vp = width * tp
    vocab_size = vp if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= vp:
        raise ValueError(f"vocab_size={vocab_size} does not fit the logits: {width} local columns x "
                         f"tp={tp} = {vp} padded columns")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not in_dtype.is_floating_point:
        raise TypeError(f"logits must be floating point, got {in_dtype}")
    low = in_dtype in (torch.bfloat16, torch.float16)
    dtype = torch.float32 if (fp32 and low) else in_dtype
    start = rank * width
    return VocabShard(group, start, width, max(0, min(width, vocab_size - start)), float(temperature), dtype)


def check_targets(targets: torch.Tensor, shape, vocab: int, ignore_index: int | None = None) -> torch.Tensor:
    """Flattened int64 targets; one clear error for a wrong shape or an id outside [0, vocab)."""
    if tuple(targets.shape) != tuple(shape):
        raise ValueError(f"targets have shape {tuple(targets.shape)}, expected {tuple(shape)} "
                         "(the logits' leading dims)")
    if targets.dtype.is_floating_point:
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    t = targets.reshape(-1).long()
    keep = t != ignore_index if ignore_index is not None else torch.ones_like(t, dtype=torch.bool)
    bad = keep & ((t < 0) | (t >= vocab))
    if bool(bad.any()):
        raise ValueError(f"target id {int(t[bad][0])} at flat position {int(bad.nonzero()[0])} is "
                         f"outside the vocabulary [0, {vocab})")
    return t


# ---------------------------------------------------------------------------------------------
# the shared core: local statistics of one chunk, the two collectives, the finished values, and
# the gradient of one chunk's logits (used here and by parallel/fused.py)


@dataclass(frozen=True)
class StatsSpec:
    """What to compute: the q side, target picks, entropy, KL direction; `outputs` in return order."""

    has_q: bool
    targets: bool
    entropy: bool
    kl: str | None
    outputs: tuple

    @property
    def cols(self) -> dict:
        names = ["S_p"] + ["S_q"] * self.has_q + ["H"] * self.entropy + ["KL"] * (self.kl is not None)
        names += ["t_p"] * self.targets + ["t_q"] * (self.targets and self.has_q)
        return {n: i for i, n in enumerate(names)}


def local_stats(zp, zq, tsel, spec: StatsSpec, maxes: torch.Tensor, sums: torch.Tensor) -> None:
    """Fill one chunk's rows of `maxes` [c, 1|2] (local max, -inf if nv == 0) and `sums` [c, k]
    (sums of exp(z - local max), and of the entropy/KL integrands, and the picked target logits).
    Working memory: at most four [c, nv] temporaries besides zp and zq."""
    cols = spec.cols
    if zp.shape[1] == 0:  # this rank holds only padding: contributes nothing
        maxes.fill_(float("-inf"))
        sums.zero_()
        return
    mp = zp.amax(1, keepdim=True)
    maxes[:, 0] = mp[:, 0]
    shifted = zp - mp  # [c, nv]
    ep = torch.exp(shifted) if spec.entropy else shifted.exp_()
    sums[:, cols["S_p"]] = ep.sum(1)
    if spec.has_q:
        mq = zq.amax(1, keepdim=True)
        maxes[:, 1] = mq[:, 0]
        eq = (zq - mq).exp_()
        sums[:, cols["S_q"]] = eq.sum(1)
        if spec.kl == "forward":
            sums[:, cols["KL"]] = (zp - zq).mul_(ep).sum(1)
        elif spec.kl == "reverse":
            sums[:, cols["KL"]] = (zq - zp).mul_(eq).sum(1)
        del eq
    if spec.entropy:
        sums[:, cols["H"]] = shifted.mul_(ep).sum(1)
    del ep, shifted
    if spec.targets:
        idx, held = tsel
        sums[:, cols["t_p"]] = torch.where(held, zp.gather(1, idx[:, None])[:, 0], 0.0)
        if spec.has_q:
            sums[:, cols["t_q"]] = torch.where(held, zq.gather(1, idx[:, None])[:, 0], 0.0)


def reduce_stats(maxes: torch.Tensor, sums: torch.Tensor, spec: StatsSpec, group) -> dict:
    """Two collectives over the whole [T] batch, then the finished per-token values."""
    cols = spec.cols
    m = maxes.clone()
    # global max of each token's logits (p and q side by side): T or 2T floats
    all_reduce(m, "max", group)
    local = torch.where(torch.isfinite(maxes), maxes, m)  # a padding-only rank has S = 0 anyway
    shift = local - m  # <= 0; exactly 0 at tp=1
    f = torch.exp(shift)
    fp, fq = f[:, 0], f[:, -1]
    if spec.entropy:  # sum e^(z-m)(z-m) = f * (sum e^(z-l)(z-l) + (l-m) sum e^(z-l))
        sums[:, cols["H"]] = fp * (sums[:, cols["H"]] + shift[:, 0] * sums[:, cols["S_p"]])
    sums[:, cols["S_p"]] *= fp
    if spec.has_q:
        sums[:, cols["S_q"]] *= fq
    if spec.kl is not None:
        sums[:, cols["KL"]] *= fp if spec.kl == "forward" else fq
    # per token: sum-exp (p, q), entropy and KL partial sums, picked target logits: <= 6T floats.
    # Gathered and summed here in rank order (not all-reduced, whose ring may order the columns
    # differently): identical p and q then give bitwise-equal lse and an exact 0 KL at any tp.
    parts = all_gather_along(sums[None], 0, group)
    sums = parts[0].clone()
    for r in range(1, parts.shape[0]):
        sums += parts[r]

    out = {"lse": m[:, 0] + torch.log(sums[:, cols["S_p"]])}
    if spec.has_q:
        out["lse_q"] = m[:, 1] + torch.log(sums[:, cols["S_q"]])
    if spec.targets:
        out["logprobs"] = sums[:, cols["t_p"]] - out["lse"]
        if spec.has_q:
            out["ref_logprobs"] = sums[:, cols["t_q"]] - out["lse_q"]
    if spec.entropy:
        out["entropy"] = torch.log(sums[:, cols["S_p"]]) - sums[:, cols["H"]] / sums[:, cols["S_p"]]
    if spec.has_q:  # lse_p - lse_q without the cancellation of two large numbers; 0 when p == q
        out["dlse"] = (m[:, 0] - m[:, 1]) + torch.log(sums[:, cols["S_p"]] / sums[:, cols["S_q"]])
    if spec.kl == "forward":
        out["kl"] = sums[:, cols["KL"]] / sums[:, cols["S_p"]] - out["dlse"]
    elif spec.kl == "reverse":
        out["kl"] = sums[:, cols["KL"]] / sums[:, cols["S_q"]] + out["dlse"]
    return out


def grad_logits(zp, zq, tsel, st: dict, g: dict, spec: StatsSpec, want_q: bool, temperature: float):
    """d(sum_k g_k . out_k)/d(logits) for one chunk's valid columns: (grad_p [c, nv], grad_q or None).

    `st` holds the chunk's rows of the saved values (lse, lse_q, dlse, entropy, kl); `g` the
    upstream gradients by output name (absent or None where unused). Purely local: no collective.
    Built in place: at most four [c, nv] temporaries besides zp and zq."""
    def col(name):
        v = g.get(name)
        return None if v is None else v[:, None]

    g_lse, g_lp, g_h, g_kl, g_rlp = (col(k) for k in ("lse", "logprobs", "entropy", "kl", "ref_logprobs"))
    gp = zp - st["lse"][:, None]  # log p
    p = torch.exp(gp)
    # gp := the factor that multiplies p: g_lse - g_lp - g_H (log p + H) [+ g_kl (log p - log q - KL)]
    if g_h is not None:
        gp.add_(st["entropy"][:, None]).mul_(-g_h)
    else:
        gp.zero_()
    if g_lse is not None:
        gp.add_(g_lse)
    if g_lp is not None:
        gp.sub_(g_lp)
    if spec.kl == "forward" and g_kl is not None:  # log p - log q - KL, exactly 0 if p == q
        gp.add_((zp - zq).sub_((st["dlse"] + st["kl"])[:, None]).mul_(g_kl))
    gp.mul_(p)
    gq = None
    if spec.has_q and ((spec.kl == "reverse" and g_kl is not None) or want_q):
        q = (zq - st["lse_q"][:, None]).exp_()
        if spec.kl == "reverse" and g_kl is not None:  # g_kl (p - q)
            gp.addcmul_(p, g_kl).addcmul_(q, -g_kl)
        if want_q:
            if spec.kl == "reverse" and g_kl is not None:  # log q - log p - KL
                gq = (zq - zp).add_((st["dlse"] - st["kl"])[:, None]).mul_(g_kl)
            else:
                gq = torch.zeros_like(q)
            if g_rlp is not None:
                gq.sub_(g_rlp)
            gq.mul_(q)
            if spec.kl == "forward" and g_kl is not None:  # g_kl (q - p)
                gq.addcmul_(q, g_kl).addcmul_(p, -g_kl)
        del q
    del p
    if spec.targets and zp.shape[1] > 0:  # the onehot(target) terms; a padding-only rank holds none
        idx, held = tsel
        for gr, gt in ((gp, g_lp), (gq, g_rlp)):
            if gr is not None and gt is not None:
                gr.scatter_add_(1, idx[:, None], torch.where(held[:, None], gt, 0.0))
    if temperature != 1.0:  # z = logits / temperature
        gp.div_(temperature)
        if gq is not None:
            gq.div_(temperature)
    return gp, gq


def chunks(n: int, chunk_size: int | None):
    c = max(n, 1) if chunk_size is None else int(chunk_size)
    if c <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return [(s, min(s + c, n)) for s in range(0, n, c)] or [(0, 0)]


# ---------------------------------------------------------------------------------------------
# autograd over materialised (sharded) logits


class _VocabStats(torch.autograd.Function):
    """logits_p [T, Vp/tp] (and logits_q) -> the requested [T] values; backward is local."""

    @staticmethod
    def forward(ctx, logits_p, logits_q, targets, sh: VocabShard, spec: StatsSpec, chunk_size):
        T = logits_p.shape[0]
        maxes = torch.empty(T, 1 + spec.has_q, dtype=sh.dtype)
        sums = torch.empty(T, len(spec.cols), dtype=sh.dtype)
        tl = sh.local_index(targets)
        for s, e in chunks(T, chunk_size):
            zq = sh.scaled(logits_q[s:e]) if spec.has_q else None
            tsel = None if tl is None else (tl[0][s:e], tl[1][s:e])
            local_stats(sh.scaled(logits_p[s:e]), zq, tsel, spec, maxes[s:e], sums[s:e])
        st = reduce_stats(maxes, sums, spec, sh.group)
        ctx.sh, ctx.spec, ctx.chunk_size = sh, spec, chunk_size
        ctx.keys = [k for k in ("lse", "lse_q", "dlse", "entropy", "kl") if k in st]
        ctx.save_for_backward(logits_p, logits_q, targets, *[st[k] for k in ctx.keys])
        ctx.set_materialize_grads(False)
        return tuple(st[k] for k in spec.outputs)

    @staticmethod
    def backward(ctx, *grads):
        logits_p, logits_q, targets, *saved = ctx.saved_tensors
        sh, spec = ctx.sh, ctx.spec
        st_all = dict(zip(ctx.keys, saved))
        g_all = dict(zip(spec.outputs, grads))
        want_q = ctx.needs_input_grad[1]
        grad_p = torch.zeros_like(logits_p) if ctx.needs_input_grad[0] else None
        grad_q = torch.zeros_like(logits_q) if want_q else None
        tl = sh.local_index(targets)
        for s, e in chunks(logits_p.shape[0], ctx.chunk_size):
            zq = sh.scaled(logits_q[s:e]) if spec.has_q else None
            tsel = None if tl is None else (tl[0][s:e], tl[1][s:e])
            g = {k: (None if v is None else v[s:e]) for k, v in g_all.items()}
            gp, gq = grad_logits(sh.scaled(logits_p[s:e]), zq, tsel, {k: v[s:e] for k, v in st_all.items()},
                                 g, spec, want_q, sh.temperature)
            if grad_p is not None:
                grad_p[s:e, : sh.nv] = gp
            if want_q:
                grad_q[s:e, : sh.nv] = gq
        return grad_p, grad_q, None, None, None, None


def _run(logits_p, logits_q, targets, tp_group, spec, *, vocab_size, temperature, fp32, chunk_size,
         grad_q=False, ignore_index=None):
    if logits_p.dim() < 1:
        raise ValueError("logits must have a vocabulary dim, got a scalar")
    lead, width = logits_p.shape[:-1], logits_p.shape[-1]
    if logits_q is not None and logits_q.shape != logits_p.shape:
        raise ValueError(f"the two logit tensors differ in shape: {tuple(logits_p.shape)} vs "
                         f"{tuple(logits_q.shape)}")
    sh = vocab_shard(width, tp_group, vocab_size, temperature, logits_p.dtype, fp32)
    vocab = sh.width * group_size(tp_group) if vocab_size is None else vocab_size
    t = None if targets is None else check_targets(targets, lead, vocab, ignore_index)
    if t is not None and ignore_index is not None:
        t = torch.where(t == ignore_index, -1, t)  # id -1: held by no rank
    p = logits_p.reshape(-1, width)
    q = None if logits_q is None else logits_q.reshape(-1, width)
    if q is not None and not grad_q:
        q = q.detach()
    outs = _VocabStats.apply(p, q, t, sh, spec, chunk_size)
    return [o.reshape(lead) for o in outs]


def vocab_parallel_logsumexp(logits_local, tp_group=None, *, vocab_size=None, temperature=1.0, fp32=True,
                             chunk_size=None):
    """logsumexp over the full vocabulary of logits/temperature: [..., Vp/tp] sharded -> [...]."""
    spec = StatsSpec(False, False, False, None, ("lse",))
    return _run(logits_local, None, None, tp_group, spec, vocab_size=vocab_size, temperature=temperature,
                fp32=fp32, chunk_size=chunk_size)[0]


def vocab_parallel_logprobs(logits_local, targets, tp_group=None, *, vocab_size=None, temperature=1.0,
                            fp32=True, chunk_size=None):
    """log p(target) under softmax(logits/temperature): [..., Vp/tp] sharded, targets [...] global
    ids -> [...]. Two O(T) collectives (max; sum-exp with the target logit); local backward."""
    spec = StatsSpec(False, True, False, None, ("logprobs",))
    return _run(logits_local, None, targets, tp_group, spec, vocab_size=vocab_size, temperature=temperature,
                fp32=fp32, chunk_size=chunk_size)[0]


def vocab_parallel_cross_entropy(logits_local, targets, tp_group=None, *, vocab_size=None, ignore_index=-100,
                                 fp32=True, chunk_size=None):
    """Per-token -log p(target): [..., Vp/tp] sharded -> [...], exactly 0 (and zero gradient) where
    targets == ignore_index. Two O(T) collectives (max; sum-exp with the target logit), local backward."""
    spec = StatsSpec(False, True, False, None, ("logprobs",))
    lp = _run(logits_local, None, targets, tp_group, spec, vocab_size=vocab_size, temperature=1.0,
              fp32=fp32, chunk_size=chunk_size, ignore_index=ignore_index)[0]
    return torch.where(targets == ignore_index, torch.zeros_like(lp), -lp)


def vocab_parallel_entropy(logits_local, tp_group=None, *, vocab_size=None, temperature=1.0, fp32=True,
                           chunk_size=None):
    """Entropy of softmax(logits/temperature) over the full vocabulary: [..., Vp/tp] sharded -> [...]."""
    spec = StatsSpec(False, False, True, None, ("entropy",))
    return _run(logits_local, None, None, tp_group, spec, vocab_size=vocab_size, temperature=temperature,
                fp32=fp32, chunk_size=chunk_size)[0]


def vocab_parallel_kl(logits_p_local, logits_q_local, tp_group=None, *, vocab_size=None, direction="forward",
                      temperature=1.0, fp32=True, chunk_size=None, grad_q=False):
    """Exact KL over the full vocabulary between p = softmax(logits_p/T) (the policy) and
    q = softmax(logits_q/T): forward = KL(p||q), reverse = KL(q||p). Both [..., Vp/tp] sharded the same
    way -> [...]. Gradient flows to logits_p; to logits_q only with grad_q=True (else q is a constant)."""
    if direction not in KL_DIRECTIONS:
        raise ValueError(f"direction must be one of {KL_DIRECTIONS}, got {direction!r}")
    spec = StatsSpec(True, False, False, direction, ("kl",))
    return _run(logits_p_local, logits_q_local, None, tp_group, spec, vocab_size=vocab_size,
                temperature=temperature, fp32=fp32, chunk_size=chunk_size, grad_q=grad_q)[0]


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sh: VocabShard):
        spec = StatsSpec(False, False, False, None, ("lse",))
        maxes = torch.empty(x.shape[0], 1, dtype=sh.dtype)
        sums = torch.empty(x.shape[0], 1, dtype=sh.dtype)
        z = sh.scaled(x)
        local_stats(z, None, None, spec, maxes, sums)
        lse = reduce_stats(maxes, sums, spec, sh.group)["lse"]
        out = torch.full((x.shape[0], sh.width), float("-inf"), dtype=sh.dtype)
        out[:, : sh.nv] = z - lse[:, None]
        ctx.sh = sh
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        sh = ctx.sh
        g = grad[:, : sh.nv].to(sh.dtype)
        s = g.sum(1)
        # the upstream gradient is sharded over the vocabulary: sum_v grad_v over all ranks, T floats
        all_reduce(s, "sum", sh.group)
        gx = torch.zeros(out.shape, dtype=grad.dtype)
        gx[:, : sh.nv] = (g - torch.exp(out[:, : sh.nv]) * s[:, None]) / sh.temperature
        return gx, None


def vocab_parallel_log_softmax(logits_local, tp_group=None, *, vocab_size=None, temperature=1.0, fp32=True):
    """log softmax(logits/temperature) over the full vocabulary: [..., Vp/tp] sharded -> [..., Vp/tp]
    sharded the same way; padded columns hold -inf (probability 0). Backward: one all-reduce of T floats."""
    lead, width = logits_local.shape[:-1], logits_local.shape[-1]
    sh = vocab_shard(width, tp_group, vocab_size, temperature, logits_local.dtype, fp32)
    return _LogSoftmax.apply(logits_local.reshape(-1, width), sh).reshape(*lead, width)
