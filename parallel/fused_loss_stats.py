"""The loss-inside head's chunk arithmetic (parallel/fused_loss.py): one chunk's local statistics and
then, once they are final, d loss / d policy logits, both inside the two logits buffers the head's
matmuls made, with one [c, nv] temporary (and a [c, nv] bool mask) besides them.

Shapes as in parallel/vocab_stats.py: a chunk's logits zp, zq [c, nv], this rank's valid columns
of the [c, Vp/tp] shard on the vocabulary; per-token values [c], replicated.

Unlike the recomputing head, the gradient needs the chunk's logits after the statistics, and only
what the policy's gradient reads survives them, each in place of a logits tensor:
  zp -> s_p = z_p - l_p (l: this rank's max), so log p = s_p - a with a = (m - l_p) + log S_p,
  zq -> forward KL: d = s_p - s_q;  reverse KL: X = exp(s_q), so q = exp(-b) X with
        b = (m_q - l_q) + log S_q;  without a KL nothing (zq is dead).
Then (forward | reverse)
  d loss / d z_p = p [g_lse - g_lp - g_H (log p + H) (+ g_KL (d + (b - a) - KL) | + g_KL)]
                   (| - g_KL exp(-b) X) + g_lp onehot(target).
The forward KL's factor d + (b - a) - KL is formed before multiplying by p, as grad_logits forms
log p - log q - KL (summing p d and p (b - a - KL) separately would lose the digits that cancel
when q is far from p); with entropy too, exp(s_p) is computed twice (one more pass, not one more
[c, nv] tensor). The statistics are bitwise those of parallel/vocab_stats.py's local_stats; the
gradient equals its grad_logits (which forms log q explicitly) to rounding. Identical p and q
still give exactly 0 for the KL's part (d = 0 and b - a - KL = 0).
"""

from __future__ import annotations

import torch

from parallel.vocab_stats import (
    StatsSpec,
    finite_at_zero,
    log_softmax_rows,
    shifted_logits,
    zero_where_unlikely,
)


def local_stats_kept(zp, zq, tsel, spec: StatsSpec, maxes: torch.Tensor, sums: torch.Tensor) -> None:
    """Fill one chunk's rows of `maxes` [c, 1|2] and `sums` [c, k] as local_stats does (bitwise),
    leaving zp [c, nv] = s_p and zq [c, nv] = d (forward KL) or X (reverse KL) (module docstring).
    Working memory besides zp and zq: one [c, nv] temporary (exp(s_p); exp(s_q)'s sum for the
    forward KL is taken before it exists)."""
    cols = spec.cols
    shifted = shifted_logits(zp, zq, tsel, spec, maxes, sums, inplace=True)
    if shifted is None:
        return
    sp, sq = shifted
    if spec.has_q:
        if spec.kl != "reverse":  # a transient for the forward KL (s_q is needed again), else in place
            sums[:, cols["S_q"]] = (sq.exp() if spec.kl == "forward" else sq.exp_()).sum(1)
    ep = sp.exp()  # s_p is kept for the gradient: exp(s_p) is the one temporary
    sums[:, cols["S_p"]] = ep.sum(1)
    if spec.kl == "forward":  # d = s_p - s_q kept in s_q's buffer; the integrand exp(s_p) d in ep's, where
        # the weight is 0 the term is 0 (never 0 * inf = NaN), +inf survives (p > 0, q = 0)
        d = torch.sub(sp, sq, out=sq)
        sums[:, cols["KL"]] = finite_at_zero(ep.mul_(d)).sum(1)
        if spec.entropy:  # exp(s_p) again: one more pass instead of a second temporary
            torch.exp(sp, out=ep)
    if spec.entropy:
        sums[:, cols["H"]] = finite_at_zero(ep.mul_(sp)).sum(1)
    if spec.kl == "reverse":  # X = exp(s_q) in s_q's buffer; the integrand exp(s_q) (s_q - s_p) in ep's
        d = torch.sub(sq, sp, out=ep)
        eq = sq.exp_()
        sums[:, cols["S_q"]] = eq.sum(1)
        sums[:, cols["KL"]] = finite_at_zero(d.mul_(eq)).sum(1)
    del ep, sp, sq


def shifted_stats(st: dict, maxes: torch.Tensor, spec: StatsSpec) -> dict:
    """`st` (reduce_stats' values) for logits left shifted by this rank's maxima `maxes` [c, 1|2]
    (local_stats_kept): s = z - l with l the local max (0 where it is not finite), so
    log p = s - (m - l) - log S: m and m_q minus l. At tp = 1, l = m."""
    shift = torch.where(torch.isfinite(maxes), maxes, maxes.new_zeros(()))
    out = dict(st, m=st["m"] - shift[:, 0])
    if spec.has_q:
        out["m_q"] = st["m_q"] - shift[:, 1]
    return out


def grad_logits_kept(zp, x, tsel, st: dict, g: dict, spec: StatsSpec, temperature: float) -> torch.Tensor:
    """d(sum_k g_k . out_k) / d z_p [c, nv] for one chunk, formed in zp's buffer (the policy's logits
    only: the reference is frozen). zp = s_p and x = d or X (zq's buffer, overwritten) as
    local_stats_kept left them; `st`: the chunk's shifted_stats; `g`: upstream gradients [c] by
    output name ("lse", "logprobs", "entropy", "kl"; None or absent where unused; the caller has
    zeroed masked tokens). Working memory: p and the bool mask of p == 0. Purely local."""
    def col(name):
        v = g.get(name)
        return None if v is None else v[:, None]

    g_lse, g_lp, g_h, g_kl = (col(k) for k in ("lse", "logprobs", "entropy", "kl"))
    kl_fwd = spec.kl == "forward" and g_kl is not None
    kl_rev = spec.kl == "reverse" and g_kl is not None
    gp = log_softmax_rows(zp, st["m"], st["logS"], inplace=True)  # log p
    p = torch.exp(gp)
    if g_h is not None:  # gp := the factor of p: - g_H (log p + H) + per-row constants
        gp.add_(st["entropy"][:, None]).mul_(-g_h)
    else:
        gp.zero_()
    a = (st["m"] + st["logS"])[:, None]  # log p = s_p - a, log q = s_q - b
    b = (st["m_q"] + st["logS_q"])[:, None] if spec.has_q else None
    const = [v for v in (g_lse, None if g_lp is None else -g_lp, g_kl if kl_rev else None) if v is not None]
    if const:
        gp.add_(sum(const[1:], const[0]))
    if kl_fwd:  # + g_KL (log p - log q - KL) = g_KL (d + (b - a) - KL), formed in d's buffer
        gp.add_(x.add_((b - a) - st["kl"][:, None]).mul_(g_kl))
    zero_where_unlikely(gp, p)
    del p
    if kl_rev:  # - g_KL q = - g_KL exp(-b) X
        gp.addcmul_(x, g_kl * torch.exp(-b), value=-1.0)
    if spec.targets and g_lp is not None and zp.shape[1] > 0:  # onehot(target); a padding-only rank holds none
        idx, held = tsel
        gp.scatter_add_(1, idx[:, None], torch.where(held[:, None], g_lp, g_lp.new_zeros(())))
    if temperature != 1.0:  # z = logits / temperature
        gp.div_(temperature)
    return gp
