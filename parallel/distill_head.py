"""Per-token divergences between a student's and a teacher's vocab-parallel heads over the full
vocabulary, chunked over tokens, never holding a [T, V] logits tensor: on-policy distillation's loss.

| tensor                 | shape          | layout                                               |
|------------------------|----------------|------------------------------------------------------|
| hidden (student)       | [..., H_s]     | replicated over tp_group (pass copy_to_tp(hidden))   |
| weight_local (student) | [Vp/tp, H_s]   | sharded on the vocabulary                            |
| teacher_hidden         | [..., H_t]     | replicated; H_t may differ from H_s                  |
| teacher_weight_local   | [Vp/tp, H_t]   | sharded like weight_local (same tokenizer, same Vp)  |
| result                 | [...]          | replicated, 0 at masked tokens                       |

Student logits z_s = hidden @ weight_local.T / temperature, teacher logits z_t = teacher_hidden @
teacher_weight_local.T / teacher_temperature, each chunk's product taken with its own width, so the
two models may differ in hidden size, layers and heads. Only the first `vocab_size` columns (the
tokenizer's ids) are read: padded columns of either head never reach a value. With S = softmax(z_s)
(student) and P = softmax(z_t) (teacher), `kind`:

  "reverse_kl": KL(S || P)  -- on-policy distillation's loss (GKD, Qwen3, Thinking Machines): mode seeking
  "forward_kl": KL(P || S)  -- the supervised KD direction, on the student's samples
  "jsd":        JSD_beta = beta KL(P || M) + (1 - beta) KL(S || M),  M = beta P + (1 - beta) S
                (generalised JSD of Agarwal et al., GKD, arXiv 2306.13649, with their P = the teacher,
                Q_theta = the student); beta in (0, 1). JSD_beta / beta -> KL(P || S) as beta -> 0 and
                JSD_beta / (1 - beta) -> KL(S || P) as beta -> 1: use the KL kinds for the end points.

Gradients reach the student's hidden and weight only; the teacher is a constant.

The two KL kinds are parallel/fused.py's fused_head with the teacher as its reference (one pass
forward, one in backward; the teacher's temperature folded into its hidden states, since the logits
are linear in them). The JSD needs the global normalisers of both sides before log M exists, so its
forward takes two passes over the chunks (log-sum-exp, then the sums) and its backward one:
  d JSD / d z_s[v] = (1 - beta) S[v] (log S[v] - log M[v] - KL(S || M)),
all local to a vocabulary shard once lse_s, lse_t and KL(S || M) are known. Collectives: the JSD's
forward two all-reduces of [T, 2] (max, then sums) and one of [T, 2]; the KLs' those of fused_head.
"""

from __future__ import annotations

import math

import torch

from parallel.comm import all_reduce, group_size
from parallel.fused import HeadMatmul, fused_head, part
from parallel.vocab_stats import check_mask, chunks, masked, resolve_chunk_size, vocab_shard

KINDS = ("reverse_kl", "forward_kl", "jsd")


def distill_divergence(hidden: torch.Tensor, weight_local: torch.Tensor, teacher_hidden: torch.Tensor,
                       teacher_weight_local: torch.Tensor, tp_group=None, *, kind: str = "reverse_kl",
                       beta: float = 0.5, vocab_size: int | None = None, temperature: float = 1.0,
                       teacher_temperature: float = 1.0, chunk_size=None, mask: torch.Tensor | None = None,
                       fp32: bool = True) -> torch.Tensor:
    """The per-token divergence [...] (module docstring) between the student head (hidden, weight_local)
    and the teacher head (teacher_hidden, teacher_weight_local), both sharded on the vocabulary over
    tp_group; 0 where `mask` [...] is False. At tp > 1 pass `copy_to_tp(hidden, tp_group)`: the
    gradient each rank forms is the partial sum over its shard (parallel/fused.py's contract)."""
    if kind not in KINDS:
        raise ValueError(f"distill kind must be one of {KINDS}, got {kind!r}")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"jsd needs beta in (0, 1), got {beta} (beta -> 0 is forward_kl's direction, "
                         "beta -> 1 reverse_kl's)")
    if not teacher_temperature > 0:
        raise ValueError(f"teacher_temperature must be > 0, got {teacher_temperature}")
    if teacher_weight_local.shape[0] != weight_local.shape[0]:
        raise ValueError(f"teacher head shard has {teacher_weight_local.shape[0]} vocabulary rows, the student's "
                         f"{weight_local.shape[0]}: teacher and student must share the tokenizer and padded vocab")
    if teacher_hidden.shape[:-1] != hidden.shape[:-1] or teacher_weight_local.shape[1] != teacher_hidden.shape[-1]:
        raise ValueError(f"teacher_hidden {tuple(teacher_hidden.shape)} / teacher head "
                         f"{tuple(teacher_weight_local.shape)} do not match the student's tokens "
                         f"{tuple(hidden.shape[:-1])}")
    th = teacher_hidden.detach()
    tw = teacher_weight_local.detach()
    if teacher_temperature != temperature:  # z_t / tau_t == (h_t * tau_s / tau_t) @ W_t.T / tau_s
        th = th * (temperature / teacher_temperature)
    if kind != "jsd":
        out = fused_head(hidden, weight_local, None, tp_group, vocab_size=vocab_size, ref_hidden=th,
                         ref_weight_local=tw, temperature=temperature, chunk_size=chunk_size, entropy=False,
                         kl="forward" if kind == "reverse_kl" else "reverse", fp32=fp32, mask=mask)
        return out.kl
    lead = hidden.shape[:-1]
    keep = check_mask(mask, lead)
    if hidden.dim() < 1 or weight_local.dim() != 2 or weight_local.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight_local has shape {tuple(weight_local.shape)}, expected [Vp/tp, {hidden.shape[-1]}]")
    sh = vocab_shard(weight_local.shape[0], tp_group, vocab_size, temperature, weight_local.dtype, fp32)
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = resolve_chunk_size(chunk_size, flat.shape[0], weight_local.shape[0], max(flat.shape[1], th.shape[-1]),
                               weight_local.element_size())
    out = _FusedJSD.apply(flat, weight_local, th.reshape(-1, th.shape[-1]), tw, keep, sh, float(beta), chunk)
    return out.reshape(lead)


def local_lse(z: torch.Tensor) -> torch.Tensor:
    """log-sum-exp over this shard's columns [c]; -inf for a shard holding only padding."""
    if z.shape[1] == 0:
        return z.new_full((z.shape[0],), float("-inf"))
    return torch.logsumexp(z, 1)


def global_lse(lse: torch.Tensor, group) -> torch.Tensor:
    """[T, k] per-rank log-sum-exps -> the global ones (max, then a sum of rescaled exps)."""
    if group_size(group) == 1:
        return lse
    m = all_reduce(lse.clone(), "max", group)
    shift = torch.where(torch.isfinite(m), m, m.new_zeros(()))
    s = all_reduce((lse - shift).exp(), "sum", group)
    return s.log() + shift


def _log_mixture(ls, lt, log_b: float, log_1b: float):
    """(log M, a scratch buffer), both [c, nv] and new: log M = logaddexp(log beta + log P, log(1-beta) + log S)."""
    lm = torch.add(lt, log_b)
    scratch = torch.add(ls, log_1b)
    torch.logaddexp(lm, scratch, out=lm)
    return lm, scratch


def _jsd_sums(zs, zt, lse_s, lse_t, log_b: float, log_1b: float):
    """(sum_v P (log P - log M), sum_v S (log S - log M)) [c] of one chunk, in the logits' own buffers (zs and
    zt are consumed) and two more [c, nv]: the working memory of a chunk is 4 [c, nv] tensors."""
    ls, lt = zs.sub_(lse_s[:, None]), zt.sub_(lse_t[:, None])
    lm, d = _log_mixture(ls, lt, log_b, log_1b)
    a = torch.sub(lt, lm, out=d).mul_(lt.exp_()).sum(1)
    b = torch.sub(ls, lm, out=d).mul_(ls.exp_()).sum(1)
    return a, b


class _FusedJSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, keep, sh, beta, chunk):
        T = hidden.shape[0]
        mm_s, mm_t = HeadMatmul(weight, sh), HeadMatmul(t_weight, sh)
        lse = hidden.new_empty((T, 2), dtype=sh.dtype)
        for s, e in chunks(T, chunk):  # pass 1: each side's normaliser
            kc = part(keep, s, e)
            lse[s:e, 0] = local_lse(mm_s(hidden[s:e], kc))
            lse[s:e, 1] = local_lse(mm_t(t_hidden[s:e], kc))
        lse = global_lse(lse, sh.group)
        log_b, log_1b = math.log(beta), math.log1p(-beta)
        sums = hidden.new_zeros((T, 2), dtype=sh.dtype)
        if sh.nv > 0:
            for s, e in chunks(T, chunk):  # pass 2: KL(P||M) and KL(S||M) over this shard
                kc = part(keep, s, e)
                a, b = _jsd_sums(mm_s(hidden[s:e], kc), mm_t(t_hidden[s:e], kc), lse[s:e, 0], lse[s:e, 1],
                                 log_b, log_1b)
                sums[s:e, 0], sums[s:e, 1] = a, b
                del a, b
        sums = all_reduce(sums, "sum", sh.group)
        ctx.sh, ctx.beta, ctx.chunk = sh, beta, chunk
        ctx.save_for_backward(hidden, weight, t_hidden, t_weight, keep, lse, sums[:, 1].clone())
        jsd = beta * sums[:, 0] + (1.0 - beta) * sums[:, 1]
        return masked(jsd, keep).to(torch.promote_types(hidden.dtype, sh.dtype))

    @staticmethod
    def backward(ctx, g):
        hidden, weight, t_hidden, t_weight, keep, lse, kl_sm = ctx.saved_tensors
        sh, beta = ctx.sh, ctx.beta
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = torch.zeros_like(hidden) if need_h else None
        gw = torch.zeros_like(weight, dtype=torch.float32 if weight.dtype in (torch.bfloat16, torch.float16)
                              else weight.dtype) if need_w else None
        if g is None or sh.nv == 0:
            return (gh, None if gw is None else gw.to(weight.dtype), None, None, None, None, None, None)
        g = masked(g.to(sh.dtype), keep)
        mm_s, mm_t = HeadMatmul(weight, sh), HeadMatmul(t_weight, sh)
        log_b, log_1b = math.log(beta), math.log1p(-beta)
        w = weight[: sh.nv]
        for s, e in chunks(hidden.shape[0], ctx.chunk):
            kc = part(keep, s, e)
            ls = mm_s(hidden[s:e], kc).sub_(lse[s:e, 0, None])
            lt = mm_t(t_hidden[s:e], kc).sub_(lse[s:e, 1, None])
            lm, dz = _log_mixture(ls, lt, log_b, log_1b)
            del lt
            coef = g[s:e] * ((1.0 - beta) / sh.temperature)
            # dz = (1 - beta) S (log S - log M - KL(S||M)) g / temperature, in the scratch buffer
            torch.sub(ls, lm, out=dz).sub_(kl_sm[s:e, None]).mul_(ls.exp_()).mul_(coef[:, None])
            del ls, lm
            if kc is not None:  # masked rows hold 0 already (g is 0 there); a NaN could not reach them anyway
                dz.masked_fill_(~kc[:, None], 0.0)
            if gh is not None:
                gh[s:e] = (dz.to(w.dtype) @ w).to(gh.dtype)
            if gw is not None:
                h = hidden[s:e] if kc is None else torch.where(kc[:, None], hidden[s:e], hidden.new_zeros(()))
                gw[: sh.nv].addmm_(dz.to(gw.dtype).T, h.to(gw.dtype))
        return (gh, None if gw is None else gw.to(weight.dtype), None, None, None, None, None, None)
