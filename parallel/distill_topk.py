"""Top-k distillation, the baseline that ships only the teacher's k largest logits per token: the
teacher's top-k ids and renormalised probabilities from its vocab-parallel head (`teacher_topk`, no
grad, chunked), then the student's cross-entropy against them (`topk_cross_entropy`, fused:
no [T, V] tensor, gradient to the student's hidden and head weight).

Loss per token: -sum_k P_k(v_k) log S(v_k) = lse_s - sum_k P_k(v_k) z_s[v_k], with P_k the teacher
renormalised over its top k and S the student's full softmax; up to the teacher's entropy over the
top k (a constant) this is KL(P_k || S). Its bias against the exact forward KL(P || S): the teacher's
tail (the mass outside its top k) is dropped and the rest inflated by 1 / (its top-k mass), so the
student is pulled to put no mass on any token outside the teacher's top k and too much on the k kept:
a sharper target than the teacher, the more so where the teacher's distribution is flat.
Gradient: d/dz_s[v] = (S[v] - sum_k P_k(v_k) [v_k = v]) / temperature, local to a vocabulary shard.
"""

from __future__ import annotations

import torch

from parallel.comm import all_gather_along, all_reduce
from parallel.distill_head import global_lse, local_lse
from parallel.fused import HeadMatmul, part
from parallel.vocab_stats import check_mask, chunks, masked, resolve_chunk_size, vocab_shard


@torch.no_grad()
def teacher_topk(hidden: torch.Tensor, weight_local: torch.Tensor, k: int, tp_group=None, *,
                 vocab_size: int | None = None, temperature: float = 1.0, chunk_size=None):
    """(ids [..., k] int64 global, probs [..., k]) of the teacher's k most likely tokens, renormalised
    over those k (the tokenizer's ids only), from hidden [..., H_t] and its head shard [Vp/tp, H_t]."""
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    sh = vocab_shard(weight_local.shape[0], tp_group, vocab_size, temperature, weight_local.dtype, True)
    if not 0 < k <= (vocab_size or weight_local.shape[0]):
        raise ValueError(f"top_k must be in [1, vocabulary size], got {k}")
    chunk = resolve_chunk_size(chunk_size, flat.shape[0], weight_local.shape[0], flat.shape[1],
                               weight_local.element_size())
    mm = HeadMatmul(weight_local, sh)
    T = flat.shape[0]
    vals = flat.new_full((T, k), float("-inf"), dtype=sh.dtype)
    ids = torch.full((T, k), -1, dtype=torch.long, device=flat.device)
    kk = min(k, sh.nv)
    for s, e in chunks(T, chunk):
        if kk > 0:
            v, i = mm(flat[s:e]).topk(kk, dim=1)
            vals[s:e, :kk], ids[s:e, :kk] = v, i + sh.start
    vals, ids = all_gather_along(vals, 1, sh.group), all_gather_along(ids, 1, sh.group)
    top, pos = vals.topk(k, dim=1)
    return ids.gather(1, pos).reshape(*lead, k), torch.softmax(top, 1).reshape(*lead, k)


def topk_cross_entropy(hidden: torch.Tensor, weight_local: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
                       tp_group=None, *, vocab_size: int | None = None, temperature: float = 1.0, chunk_size=None,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """-sum_k probs log S(ids) per token [...] (module docstring); 0 where `mask` is False. At tp > 1
    pass `copy_to_tp(hidden, tp_group)` (parallel/fused.py's contract)."""
    lead = hidden.shape[:-1]
    if tuple(ids.shape[:-1]) != tuple(lead) or ids.shape != probs.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and probs {tuple(probs.shape)} must be [{tuple(lead)}, k]")
    keep = check_mask(mask, lead)
    sh = vocab_shard(weight_local.shape[0], tp_group, vocab_size, temperature, weight_local.dtype, True)
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = resolve_chunk_size(chunk_size, flat.shape[0], weight_local.shape[0], flat.shape[1],
                               weight_local.element_size())
    k = ids.shape[-1]
    out = _TopkCE.apply(flat, weight_local, ids.reshape(-1, k), probs.reshape(-1, k).detach(), keep, sh, chunk)
    return out.reshape(lead)


class _TopkCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, probs, keep, sh, chunk):
        T = hidden.shape[0]
        mm = HeadMatmul(weight, sh)
        local = ids - sh.start
        held = (local >= 0) & (local < sh.nv)
        local = local.clamp(0, max(sh.nv - 1, 0))
        lse = hidden.new_empty((T, 1), dtype=sh.dtype)
        picked = hidden.new_zeros((T,), dtype=sh.dtype)  # sum_k P_k z_s[v_k] over the ids held here
        p = probs.to(sh.dtype)
        for s, e in chunks(T, chunk):
            z = mm(hidden[s:e], part(keep, s, e))
            lse[s:e, 0] = local_lse(z)
            if sh.nv > 0:
                zk = z.gather(1, local[s:e])
                picked[s:e] = torch.where(held[s:e], zk * p[s:e], zk.new_zeros(())).sum(1)
        lse = global_lse(lse, sh.group)[:, 0]
        picked = all_reduce(picked, "sum", sh.group)
        ctx.sh, ctx.chunk = sh, chunk
        ctx.save_for_backward(hidden, weight, local, held, p, keep, lse)
        return masked(lse - picked, keep).to(torch.promote_types(hidden.dtype, sh.dtype))

    @staticmethod
    def backward(ctx, g):
        hidden, weight, local, held, p, keep, lse = ctx.saved_tensors
        sh = ctx.sh
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = torch.zeros_like(hidden) if need_h else None
        low = weight.dtype in (torch.bfloat16, torch.float16)
        gw = torch.zeros_like(weight, dtype=torch.float32 if low else weight.dtype) if need_w else None
        if g is not None and sh.nv > 0:
            g = masked(g.to(sh.dtype), keep) / sh.temperature
            mm = HeadMatmul(weight, sh)
            w = weight[: sh.nv]
            for s, e in chunks(hidden.shape[0], ctx.chunk):
                kc = part(keep, s, e)
                dz = (mm(hidden[s:e], kc) - lse[s:e, None]).exp_()
                dz.scatter_add_(1, local[s:e], -torch.where(held[s:e], p[s:e], p.new_zeros(())))
                dz.mul_(g[s:e, None])
                if gh is not None:
                    gh[s:e] = (dz.to(w.dtype) @ w).to(gh.dtype)
                if gw is not None:
                    h = hidden[s:e] if kc is None else torch.where(kc[:, None], hidden[s:e], hidden.new_zeros(()))
                    gw[: sh.nv].addmm_(dz.to(gw.dtype).T, h.to(gw.dtype))
        return gh, None if gw is None else gw.to(weight.dtype), None, None, None, None, None
