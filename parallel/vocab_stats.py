"""The shared core of every vocab-parallel head: one chunk's softmax statistics over this rank's
vocabulary shard, the two collectives that finish them, and the local gradient of one chunk's
logits. parallel/vocab.py (materialised logits), parallel/fused.py and parallel/fused_loss.py
(logits recomputed from hidden states) are thin loops around these functions.

Shapes: a chunk's logits `z: [c, nv]`, the valid prefix of this rank's [c, Vp/tp] shard on the
vocabulary over `group` (global ids [start, start + nv)); per-token values `[c]`, replicated.

Numerics, per token, with z the logits / temperature, m = max_v z over the whole vocabulary,
s = z - m (the max-shifted logits, <= 0) and S = sum_v exp(s):
  lse = m + log S;  log p = s_p - log S_p  (never z - lse: no cancellation of two large numbers)
  H(p)      = log S_p - sum p s_p
  KL(p||q)  = sum p (s_p - s_q) - log(S_p / S_q)
The large constants m_p, m_q cancel analytically, so KL stays exact when the two sides differ by a
large offset (logits of 1e4 and more), and identical inputs give bitwise 0.
Edge values: a -inf logit has p = 0 and contributes exactly 0 to every sum (0 * log 0 := 0), so
entropy and KL are finite; KL(p||q) is +inf where some p > 0 meets q = 0 (a -inf logit on the q
side only); the KL is not differentiable there and what its gradient holds is unspecified
(non-finite in general). A row whose logits are all -inf is not a distribution: NaN.

Masked tokens (`keep` false): their logits are replaced by 0, their targets by -1 (held by no
rank), their values by 0 and their upstream gradients by 0 before any arithmetic, so whatever
the caller left at a padded position (NaN, -inf, a huge log-ratio) never reaches a value or a
gradient.
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

    def scaled(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """z = x[:, :nv] / temperature in the reduction dtype (a view when nothing changes); rows
        where `keep` [c] is false are 0 (masked tokens never reach the arithmetic)."""
        z = x[:, : self.nv].to(self.dtype)
        if keep is not None:
            z = torch.where(keep[:, None], z, z.new_zeros(()))
        return z / self.temperature if self.temperature != 1.0 else z

    def local_index(self, targets: torch.Tensor | None):
        """(local column, held-here mask) of global target ids; ids off this rank are never picked."""
        if targets is None:
            return None
        idx = targets - self.start
        return idx.clamp(0, max(self.nv - 1, 0)), (idx >= 0) & (idx < self.nv)


def vocab_shard(width: int, group, vocab_size: int | None, temperature: float, in_dtype: torch.dtype,
                fp32: bool) -> VocabShard:
    """The `VocabShard` of this rank for [T, width] logits sharded on the vocabulary over `group`."""
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


def check_mask(mask: torch.Tensor | None, shape) -> torch.Tensor | None:
    """Flattened bool `keep` [T] from a per-token mask shaped like the logits' leading dims."""
    if mask is None:
        return None
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(shape)} (the logits' leading dims)")
    return mask.reshape(-1).bool()


def check_targets(targets: torch.Tensor, shape, vocab: int, ignore_index: int | None = None,
                  keep: torch.Tensor | None = None) -> torch.Tensor:
    """Flattened int64 targets; one clear error for a wrong shape or an id outside [0, vocab).
    Ids equal to `ignore_index` or where `keep` [T] is false become -1 (held by no rank) unchecked.
    On the meta device the values cannot be read and are not checked."""
    if tuple(targets.shape) != tuple(shape):
        raise ValueError(f"targets have shape {tuple(targets.shape)}, expected {tuple(shape)} "
                         "(the logits' leading dims)")
    if targets.dtype.is_floating_point:
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    t = targets.reshape(-1).long()
    if ignore_index is not None:
        t = torch.where(t == ignore_index, -1, t)
    if keep is not None:
        t = torch.where(keep, t, -1)
    if t.device.type != "meta":
        bad = (t != -1) & ((t < 0) | (t >= vocab))
        if bool(bad.any()):
            raise ValueError(f"target id {int(t[bad][0])} at flat position {int(bad.nonzero()[0])} is "
                             f"outside the vocabulary [0, {vocab})")
    return t


AUTO_CHUNK_ELEMENTS = 2**25  # one [chunk, Vp/tp] fp32 temporary: at most 128 MiB
AUTO_CHUNK_HEAD_FRACTION = 8  # ... and at most 1/8 of the head's weight-gradient shard [Vp/tp, H]
AUTO_CHUNK_SMALL_ELEMENTS = 2**21  # ... unless that is under 8 MiB: small heads are not cut finer
AUTO_CHUNK_STEP = 64  # chunks are multiples of this many tokens
AUTO_CHUNK_MIN = 128  # tokens: below this the head's matmuls get thin (a 58M model's GRPO step, fp32 CPU:
# chunk 64 took 12.7 s, 128 11.7 s, 256 11.3 s, 1024 11.3 s per step, docs/benchmarks.md)


def auto_chunk_size(tokens: int, width: int, hidden: int, itemsize: int) -> int:
    """The fused heads' default tokens per chunk for a head [width, hidden] (width = Vp/tp, this
    rank's vocabulary shard; weights of `itemsize` bytes): E / width rounded down to a multiple of 64,
    in [AUTO_CHUNK_MIN = 128, T], where one [chunk, Vp/tp] fp32 temporary gets
      E = min(2^25, max(2^21, width x hidden x itemsize / 32)) elements:
    at most 128 MiB and at most 1/8 (AUTO_CHUNK_HEAD_FRACTION) of the weight-gradient shard, but not
    under 8 MiB. Where the middle term decides, chunk = hidden x itemsize / 32 (H/16 tokens for bf16
    weights, H/8 for fp32) at any tp. Why: the exact KL holds one [chunk, Vp/tp] temporary more than a
    sampled-token estimator (the reference's logits); with the 128 MiB bound alone that extra stayed while
    tp shrank the gradient shard: exact / k3, loss inside, projected at Llama-3-8B bf16, T = 8k, went from
    1.09x at tp 1 to 1.27x at tp 8 (now 1.07x). The floor spares small heads thin chunks. Chunks:
      Llama-3-8B  bf16 (H 4096, Vp 128256): tp 1: 2^25 / 128256 = 261 -> 256; tp 8: H / 16 = 256 (not 2048)
      Qwen2.5-7B  bf16 (H 3584, Vp 152064): tp 1: 220 -> 192; tp 8: 224 -> 192
      Llama-3-70B bf16 (H 8192, Vp 128256): tp 1: 261 -> 256; tp 2-8: H / 16 = 512
      the CPU bar shape, fp32 (H 1024, V 32000, tp 1): H / 8 = 128 (1024 by the 128 MiB bound alone)
      the tiny configs' head, fp32 (H 64, V 256): 2^21 / 256 = 8192 tokens, i.e. T
      small heads where E / width < 128: 128 (a 58M model, H 512 fp32, V 32000: 64 -> 128; Qwen2.5-0.5B
      bf16: 56 -> 128), where a thinner matmul costs more time than the temporary saves memory."""
    width = max(int(width), 1)
    by_head = width * int(hidden) * int(itemsize) // (4 * AUTO_CHUNK_HEAD_FRACTION)
    elements = min(AUTO_CHUNK_ELEMENTS, max(AUTO_CHUNK_SMALL_ELEMENTS, by_head))
    c = elements // width // AUTO_CHUNK_STEP * AUTO_CHUNK_STEP
    return max(1, min(max(c, AUTO_CHUNK_MIN), int(tokens)))


def resolve_chunk_size(chunk_size, tokens: int, width: int, hidden: int, itemsize: int) -> int:
    """A fused head's chunk: None or "auto" -> auto_chunk_size(tokens, width, hidden, itemsize) for a head
    [width = Vp/tp, hidden] of `itemsize`-byte weights; a positive int as given; else one clear error."""
    if chunk_size is None or chunk_size == "auto":
        return auto_chunk_size(tokens, width, hidden, itemsize)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, None or 'auto', got {chunk_size!r}")
    return chunk_size


def chunks(n: int, chunk_size: int | None):
    """[(start, end)] token ranges of `chunk_size` (all of them at once for None: parallel/vocab.py's
    materialised functions; the fused heads resolve None to `auto_chunk_size` before calling this)."""
    c = max(n, 1) if chunk_size is None else int(chunk_size)
    if c <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return [(s, min(s + c, n)) for s in range(0, n, c)] or [(0, 0)]


def masked(v: torch.Tensor | None, keep: torch.Tensor | None) -> torch.Tensor | None:
    """v [c] with 0 where keep [c] is false (selected, never multiplied: NaN and inf vanish too)."""
    if v is None or keep is None:
        return v
    return torch.where(keep, v, v.new_zeros(()))


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

    def buffers(self, n: int, like: torch.Tensor, dtype: torch.dtype):
        """Empty (maxes [n, 1|2], sums [n, k]) on `like`'s device, in the reduction dtype."""
        return (like.new_empty((n, 1 + self.has_q), dtype=dtype),
                like.new_empty((n, len(self.cols)), dtype=dtype))


def shift_by_local_max(z: torch.Tensor, inplace: bool = False):
    """(local max [c, 1], z - max [c, nv], in z's buffer with `inplace`); a row of -inf (all p = 0
    here) shifts by 0, not NaN."""
    m = z.amax(1, keepdim=True)
    shift = torch.where(torch.isfinite(m), m, m.new_zeros(()))
    return m, (z.sub_(shift) if inplace else z - shift)


def pick_targets(zp, zq, tsel, spec: StatsSpec, sums: torch.Tensor) -> None:
    """The chunk's target logits [c] (raw, before any shift) into `sums`; 0 where not held here."""
    if not spec.targets:
        return
    cols, (idx, held) = spec.cols, tsel
    zero = zp.new_zeros(())
    sums[:, cols["t_p"]] = torch.where(held, zp.gather(1, idx[:, None])[:, 0], zero)
    if spec.has_q:
        sums[:, cols["t_q"]] = torch.where(held, zq.gather(1, idx[:, None])[:, 0], zero)


def shifted_logits(zp, zq, tsel, spec: StatsSpec, maxes: torch.Tensor, sums: torch.Tensor, inplace: bool):
    """The common start of a chunk's local statistics: None when this rank holds only padding (`maxes`
    -inf, `sums` 0: it contributes nothing); else the target logits picked into `sums` from the raw
    logits, then (s_p, s_q or None) = the logits shifted by their local maxima, written to maxes[:, 0|1]."""
    if zp.shape[1] == 0:
        maxes.fill_(float("-inf"))
        sums.zero_()
        return None
    pick_targets(zp, zq, tsel, spec, sums)  # the raw logits, before any shift
    mp, sp = shift_by_local_max(zp, inplace)
    maxes[:, 0] = mp[:, 0]
    sq = None
    if spec.has_q:
        mq, sq = shift_by_local_max(zq, inplace)
        maxes[:, 1] = mq[:, 0]
    return sp, sq


def local_stats(zp, zq, tsel, spec: StatsSpec, maxes: torch.Tensor, sums: torch.Tensor,
                inplace: bool = False) -> None:
    """Fill one chunk's rows of `maxes` [c, 1|2] (local max, -inf if nv == 0) and `sums` [c, k]
    (sums of exp(s) with s = z - local max, of the entropy/KL integrands in s, and the picked
    target logits). Working memory besides zp and zq: at most three [c, nv] temporaries, one with
    `inplace` (the caller's zp and zq are then overwritten: the fused head's forward, whose
    logits die here): the q side's sum-exp is taken before exp(s_p) exists. (The loss-inside head
    keeps its logits for the gradient: parallel/fused_loss_stats.py.)"""
    cols = spec.cols
    shifted = shifted_logits(zp, zq, tsel, spec, maxes, sums, inplace)
    if shifted is None:
        return
    sp, sq = shifted
    if spec.has_q:
        if spec.kl == "reverse":  # weight q: exp(s_q), then the integrand in s_q's buffer
            eq = sq.exp()
            sums[:, cols["S_q"]] = eq.sum(1)
            sums[:, cols["KL"]] = finite_at_zero(sq.sub_(sp).mul_(eq)).sum(1)
            del eq
        else:  # a transient when s_q is needed again (forward KL), else in s_q's own buffer
            sums[:, cols["S_q"]] = (sq.exp() if spec.kl == "forward" else sq.exp_()).sum(1)
    ep = sp.exp() if (spec.entropy or spec.kl == "forward") else sp.exp_()
    sums[:, cols["S_p"]] = ep.sum(1)
    if spec.kl == "forward":  # the integrand in s_q's buffer (s_p - s_q = -(s_q - s_p), exactly); where
        # the weight is 0 the term is 0 (never 0 * inf = NaN), +inf survives (p > 0, q = 0)
        sums[:, cols["KL"]] = finite_at_zero(sq.sub_(sp).neg_().mul_(ep)).sum(1)
    del sq
    if spec.entropy:
        sums[:, cols["H"]] = finite_at_zero(sp.mul_(ep)).sum(1)
    del ep, sp


def finite_at_zero(x: torch.Tensor) -> torch.Tensor:
    """In place: NaN -> 0, infinities kept. A product s * exp(s) is NaN only as -inf * 0 (or
    inf - inf = NaN times a zero weight), i.e. where the probability is 0 and the term is 0."""
    return x.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))


def _rescale(sums: torch.Tensor, shift: torch.Tensor, spec: StatsSpec) -> None:
    """Rescale one rank's partial sums from its local maxima to the global ones, in place:
    sum e^(z-M)(.) = e^(l-M) * (sum e^(z-l)(.) + correction), with shift = l - M <= 0 [T, 1|2]."""
    cols = spec.cols
    f = torch.exp(shift)
    fp, fq = f[:, 0], f[:, -1]
    dp, dq = shift[:, 0], shift[:, -1]
    if spec.entropy:  # sum e^(z-m)(z-m) = f * (sum e^(z-l)(z-l) + (l-m) sum e^(z-l))
        sums[:, cols["H"]] = fp * (sums[:, cols["H"]] + dp * sums[:, cols["S_p"]])
    if spec.kl == "forward":  # s_p - s_q at the global maxima = local one + (dp - dq)
        sums[:, cols["KL"]] = fp * (sums[:, cols["KL"]] + (dp - dq) * sums[:, cols["S_p"]])
    elif spec.kl == "reverse":
        sums[:, cols["KL"]] = fq * (sums[:, cols["KL"]] + (dq - dp) * sums[:, cols["S_q"]])
    sums[:, cols["S_p"]] *= fp
    if spec.has_q:
        sums[:, cols["S_q"]] *= fq


def reduce_stats(maxes: torch.Tensor, sums: torch.Tensor, spec: StatsSpec, group) -> dict:
    """Two collectives over the whole [T] batch, then the finished per-token values [T]:
    m/m_q (global maxima), logS/logS_q, lse/lse_q, logprobs/ref_logprobs, entropy, dlogS, kl."""
    cols = spec.cols
    m = maxes.clone()
    # global max of each token's logits (p and q side by side): T or 2T floats
    all_reduce(m, "max", group)
    local = torch.where(torch.isfinite(maxes), maxes, m)  # a padding-only rank has S = 0 anyway
    _rescale(sums, local - m, spec)  # shift exactly 0 at tp=1
    # per token: sum-exp (p, q), entropy and KL partial sums, picked target logits: <= 6T floats.
    # Gathered and summed here in rank order (not all-reduced, whose ring may order the columns
    # differently): identical p and q then give bitwise-equal sums and an exact 0 KL at any tp.
    parts = all_gather_along(sums[None], 0, group)
    sums = parts[0].clone()
    for r in range(1, parts.shape[0]):
        sums += parts[r]

    out = {"m": m[:, 0], "logS": torch.log(sums[:, cols["S_p"]])}
    out["lse"] = out["m"] + out["logS"]
    if spec.has_q:
        out["m_q"], out["logS_q"] = m[:, 1], torch.log(sums[:, cols["S_q"]])
        out["lse_q"] = out["m_q"] + out["logS_q"]
        out["dlogS"] = torch.log(sums[:, cols["S_p"]] / sums[:, cols["S_q"]])  # exactly 0 when p == q
    if spec.targets:  # (z_y - m) - log S: z_y - m is exact, no large lse subtracted
        out["logprobs"] = (sums[:, cols["t_p"]] - out["m"]) - out["logS"]
        if spec.has_q:
            out["ref_logprobs"] = (sums[:, cols["t_q"]] - out["m_q"]) - out["logS_q"]
    if spec.entropy:
        out["entropy"] = out["logS"] - sums[:, cols["H"]] / sums[:, cols["S_p"]]
    if spec.kl == "forward":
        out["kl"] = sums[:, cols["KL"]] / sums[:, cols["S_p"]] - out["dlogS"]
    elif spec.kl == "reverse":
        out["kl"] = sums[:, cols["KL"]] / sums[:, cols["S_q"]] + out["dlogS"]
    return out


SAVED = ("m", "logS", "m_q", "logS_q", "entropy", "kl")  # what grad_logits reads from reduce_stats


def log_softmax_rows(z: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """log p = (z - m) - log S for one chunk [c, nv] (a fresh tensor, or z's buffer with `inplace`)."""
    return (z.sub_(m[:, None]) if inplace else z - m[:, None]).sub_(log_s[:, None])


def zero_where_unlikely(g: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """g * prob where prob > 0, exactly 0 where prob == 0 (a -inf logit: its log is -inf)."""
    return g.mul_(prob).masked_fill_(prob == 0, 0.0)


def grad_logits(zp, zq, tsel, st: dict, g: dict, spec: StatsSpec, want_q: bool, temperature: float,
                inplace: bool = False):
    """d(sum_k g_k . out_k)/d(logits) for one chunk's valid columns: (grad_p [c, nv], grad_q or None).

    `st` holds the chunk's rows of the saved values (SAVED); `g` the upstream gradients [c] by
    output name (absent or None where unused; the caller has zeroed masked tokens). Purely local:
    no collective. At most five [c, nv] temporaries besides zp and zq; with `inplace` grad_p is
    formed in zp's buffer and log q in zq's (the caller's logits are overwritten), and without a
    gradient for q one temporary (p) and one [c, nv] bool mask: the forward KL's factor of p is
    formed in log q's buffer."""
    def col(name):
        v = g.get(name)
        return None if v is None else v[:, None]

    g_lse, g_lp, g_h, g_kl, g_rlp = (col(k) for k in ("lse", "logprobs", "entropy", "kl", "ref_logprobs"))
    kl_fwd = spec.kl == "forward" and g_kl is not None
    kl_rev = spec.kl == "reverse" and g_kl is not None
    gp = log_softmax_rows(zp, st["m"], st["logS"], inplace)
    p = torch.exp(gp)
    lq = (log_softmax_rows(zq, st["m_q"], st["logS_q"], inplace) if spec.has_q and (kl_fwd or kl_rev or want_q)
          else None)
    kterm = gq = None
    if kl_fwd:  # g_kl (log p - log q - KL): exactly 0 when p == q; in log q's buffer when q is not needed again
        kterm = torch.sub(gp, lq, out=None if want_q else lq).sub_(st["kl"][:, None]).mul_(g_kl)
    if want_q:  # the factor of q: g_kl (log q - log p - KL) for the reverse KL, - g_rlp
        gq = torch.sub(lq, gp).sub_(st["kl"][:, None]).mul_(g_kl) if kl_rev else torch.zeros_like(lq)
        if g_rlp is not None:
            gq.sub_(g_rlp)
    # gp := the factor of p: g_lse - g_lp - g_H (log p + H) [+ kterm]
    if g_h is not None:
        gp.add_(st["entropy"][:, None]).mul_(-g_h)
    else:
        gp.zero_()
    if g_lse is not None:
        gp.add_(g_lse)
    if g_lp is not None:
        gp.sub_(g_lp)
    if kterm is not None:
        gp.add_(kterm)
        del kterm
    zero_where_unlikely(gp, p)
    if kl_rev or gq is not None:  # the terms that need q itself
        _add_cross_terms(gp, gq, p, lq.exp_(), g_kl, kl_fwd, kl_rev)
    del p, lq
    if spec.targets and zp.shape[1] > 0:  # the onehot(target) terms; a padding-only rank holds none
        idx, held = tsel
        for gr, gt in ((gp, g_lp), (gq, g_rlp)):
            if gr is not None and gt is not None:
                gr.scatter_add_(1, idx[:, None], torch.where(held[:, None], gt, gt.new_zeros(())))
    if temperature != 1.0:  # z = logits / temperature
        gp.div_(temperature)
        if gq is not None:
            gq.div_(temperature)
    return gp, gq


def _add_cross_terms(gp, gq, p, q, g_kl, kl_fwd, kl_rev) -> None:
    """In place: gq *= q (where q > 0), then the terms that cross sides: d KL(q||p) / d z_p =
    g_kl (p - q) and d KL(p||q) / d z_q = g_kl (q - p)."""
    if kl_rev:
        gp.addcmul_(p, g_kl).addcmul_(q, -g_kl)
    if gq is not None:
        zero_where_unlikely(gq, q)
        if kl_fwd:
            gq.addcmul_(q, g_kl).addcmul_(p, -g_kl)
