"""A distillation term computed inside the loss-inside head (parallel/fused_loss.py's `extra=`): per chunk of
tokens, from the student's logits that the head has just made, the term's per-token value and its gradient
with respect to those logits, which the head adds to the policy loss's own before its two gradient matmuls.
So the term shares the head's one weight-gradient accumulator [Vp/tp, H] (no second weight-gradient buffer
for autograd to sum with the first) and its student logits (no second student matmul).

| tensor          | shape          | layout                                                   |
|-----------------|----------------|----------------------------------------------------------|
| teacher_hidden  | [T, H_t]       | replicated; the head's flattened token order             |
| teacher_weight  | [Vp/tp, H_t]   | sharded like the student's head (same tokenizer and Vp)   |
| weights         | [T]            | replicated: the term is coef sum_t weights_t D_t         |
| topk            | ([T, k], [T, k]) | the teacher's top-k global ids and renormalised probs  |
| values          | [T]            | replicated, D_t (0 at masked tokens), filled per chunk   |

`kind` (S = the student's softmax at the head's temperature, P = the teacher's at its own, folded into
teacher_hidden by the caller: z_t / tau_t = (h_t tau_s / tau_t) W_t^T / tau_s):
  "reverse_kl"       KL(S || P);    d/dz_s = S (log S - log P - KL)
  "forward_kl"       KL(P || S);    d/dz_s = S - P
  "jsd"              JSD_beta = beta KL(P || M) + (1 - beta) KL(S || M), M = beta P + (1 - beta) S;
                     d/dz_s = (1 - beta) S (log S - log M - KL(S || M))   (parallel/distill_head.py)
  "topk_forward_kl"  -sum_k P_k(v_k) log S(v_k) (parallel/distill_topk.py); d/dz_s = S - sum_k P_k [v_k = v]
each times weights_t / temperature (z_s = h W^T / temperature).

Memory: the chunk's gradient X [c, nv] (one buffer, alive until the head has added it to the policy's),
and the term's temporaries, taken over sub-blocks of the chunk's rows so that together they hold about one
[c, nv] more: the JSD three per sub-block of c/3 rows (log S, the teacher's logits, log M), the KLs two of
c/2, the top-k none. The student's logits are read, never written (the head's own statistics need them
next). Collectives per sub-block (at tp > 1): the two normalisers (two all-reduces of [r, 2]) and the
shard's partial sums (one all-reduce of [r, 1|2]), O(rows) each, never O(V).
"""

from __future__ import annotations

import math

import torch

from parallel.comm import all_reduce
from parallel.distill_head import global_lse, local_lse
from parallel.fused import HeadMatmul, part
from parallel.vocab_stats import chunks, masked

KINDS = ("reverse_kl", "forward_kl", "jsd", "topk_forward_kl")
_TEMPS = {"reverse_kl": 2, "forward_kl": 2, "jsd": 3, "topk_forward_kl": 1}  # [rows, nv] temporaries


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[i, v] b[i, v] [r] without an [r, nv] product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class DistillChunkTerm:
    """The term handed to fused_head_loss as `extra=` (module docstring). Call `bind` (the head does) before
    the chunks; `values` [T] then holds D_t, and `total` the detached coef sum_t weights_t D_t."""

    def __init__(self, kind: str, weights: torch.Tensor, teacher_hidden: torch.Tensor | None = None,
                 teacher_weight: torch.Tensor | None = None, *, topk=None, beta: float = 0.5, coef: float = 1.0):
        if kind not in KINDS:
            raise ValueError(f"distill kind must be one of {KINDS}, got {kind!r}")
        if kind == "jsd" and not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs beta in (0, 1), got {beta}")
        if kind == "topk_forward_kl":
            if topk is None or topk[0].shape != topk[1].shape or topk[0].dim() != 2:
                raise ValueError("topk_forward_kl needs topk=(ids [T, k], probs [T, k])")
        elif teacher_hidden is None or teacher_weight is None or teacher_hidden.dim() != 2:
            raise ValueError(f"{kind} needs teacher_hidden [T, H_t] and teacher_weight [Vp/tp, H_t]")
        elif teacher_weight.dim() != 2 or teacher_weight.shape[1] != teacher_hidden.shape[1]:
            raise ValueError(f"teacher_weight {tuple(teacher_weight.shape)} does not match teacher_hidden "
                             f"{tuple(teacher_hidden.shape)}: expected [Vp/tp, {teacher_hidden.shape[1]}]")
        self.kind, self.beta, self.coef = kind, float(beta), float(coef)
        self.weights = weights.detach().reshape(-1)
        self.th = None if teacher_hidden is None else teacher_hidden.detach()
        self.tw = None if teacher_weight is None else teacher_weight.detach()
        self.topk = None if topk is None else (topk[0], topk[1].detach())
        self.values: torch.Tensor | None = None
        self.total: torch.Tensor | None = None

    def bind(self, sh, keep: torch.Tensor | None, T: int, width: int) -> None:
        """Check the shapes against the head's (T tokens, `width` = Vp/tp rows) and take its shard `sh`."""
        n = self.weights.numel()
        lead = self.topk[0].shape[0] if self.th is None else self.th.shape[0]
        if n != T or lead != T:
            raise ValueError(f"the distillation term has {n} weights and {lead} teacher rows, the head {T} tokens")
        if self.tw is not None and self.tw.shape[0] != width:
            raise ValueError(f"teacher head shard has {self.tw.shape[0]} vocabulary rows, the student's {width}: "
                             "teacher and student must share the tokenizer and padded vocabulary")
        self.sh, self.keep = sh, keep
        self.mm_t = None if self.tw is None else HeadMatmul(self.tw, sh)
        self.g = masked(self.weights.to(sh.dtype) * self.coef, keep)  # coef in the reduction dtype
        self.values = self.g.new_zeros(T)
        self.total = self.g.new_zeros(())
        if self.topk is not None:
            local = self.topk[0] - sh.start
            self.held = (local >= 0) & (local < sh.nv)
            self.local = local.clamp(0, max(sh.nv - 1, 0))
            self.p = torch.where(self.held, self.topk[1].to(sh.dtype), self.g.new_zeros(()))

    def chunk(self, zs: torch.Tensor, s: int, e: int, need: bool):
        """(sum over the chunk of weights_t D_t (0-d, detached), X = d of it / d (h W^T) [c, nv] or None)
        for the chunk's student logits zs [c, nv] (= h W^T / temperature, read only)."""
        c = e - s
        x = torch.empty_like(zs) if need else None
        step = max(1, -(-c // _TEMPS[self.kind]))
        for a, b in chunks(c, step):
            self._rows(zs[a:b], s + a, s + b, None if x is None else x[a:b])
        total = (self.g[s:e] * self.values[s:e]).sum()
        self.total += total
        return total, x

    def _rows(self, zs, s: int, e: int, x) -> None:
        kc = part(self.keep, s, e)
        if self.kind == "topk_forward_kl":
            return self._topk(zs, s, e, kc, x)
        zt = self.mm_t(self.th[s:e], kc)
        lse = global_lse(torch.stack([local_lse(zs), local_lse(zt)], 1), self.sh.group)
        ls = zs - lse[:, :1]
        lt = zt.sub_(lse[:, 1:])
        d = torch.empty_like(zs) if x is None else x
        if self.kind == "reverse_kl":  # d = log S - log P; S in ls's buffer
            torch.sub(ls, lt, out=d)
            del lt, zt
            S = ls.exp_()
            kl = all_reduce(_rowdot(S, d), "sum", self.sh.group)
            if x is not None:
                d.sub_(kl[:, None]).mul_(S)
            val = kl
        elif self.kind == "forward_kl":  # d = log P - log S; then S - P in d's buffer
            torch.sub(lt, ls, out=d)
            P = lt.exp_()
            kl = all_reduce(_rowdot(P, d), "sum", self.sh.group)
            if x is not None:
                torch.sub(ls.exp_(), P, out=d)
            val = kl
        else:  # jsd: log M = logaddexp(log b + log P, log(1 - b) + log S) = logaddexp(lt + log(b / (1 - b)), ls)
            log_1b = math.log1p(-self.beta)
            lm = torch.add(lt, math.log(self.beta) - log_1b)
            torch.logaddexp(lm, ls, out=lm).add_(log_1b)
            torch.sub(lt, lm, out=d)
            kl_pm = _rowdot(lt.exp_(), d)
            del lt, zt
            torch.sub(ls, lm, out=d)
            del lm
            S = ls.exp_()
            sums = all_reduce(torch.stack([kl_pm, _rowdot(S, d)], 1), "sum", self.sh.group)
            if x is not None:
                d.sub_(sums[:, 1:]).mul_(S).mul_(1.0 - self.beta)
            val = self.beta * sums[:, 0] + (1.0 - self.beta) * sums[:, 1]
        self.values[s:e] = masked(val, kc)
        if x is not None:
            self._scale(x, s, e, kc)

    def _topk(self, zs, s: int, e: int, kc, x) -> None:
        lse = global_lse(local_lse(zs)[:, None], self.sh.group)
        p, held = self.p[s:e], self.held[s:e]
        picked = zs.gather(1, self.local[s:e]) if zs.shape[1] else zs.new_zeros(p.shape)
        picked = all_reduce(torch.where(held, picked * p, p.new_zeros(())).sum(1), "sum", self.sh.group)
        self.values[s:e] = masked(lse[:, 0] - picked, kc)
        if x is not None:
            torch.sub(zs, lse, out=x).exp_()
            if zs.shape[1]:
                x.scatter_add_(1, self.local[s:e], -p)
            self._scale(x, s, e, kc)

    def _scale(self, x, s: int, e: int, kc) -> None:
        """x := x * weights_t / temperature, masked rows 0 (selected: a NaN there never survives)."""
        x.mul_((self.g[s:e] / self.sh.temperature)[:, None])
        if kc is not None:
            x.masked_fill_(~kc[:, None], 0.0)
