"""The distillation paths of tools.kl_memory: the reference's side (Inputs.hr [T, H_t], Inputs.wr
[Vp/tp, H_t]) read as a teacher whose width may differ from the student's (`ref_hidden`). Each returns
((log p(target) [T], None, the divergence or its stand-in [T]), the scalar loss c0 log p + c2 term).

| name               | what it does (per TP rank)                                                        |
|---|---|
| distill_fused_loss | parallel/fused_loss.py with the teacher in the KL slot: exact KL(student || teacher)  |
|                    | inside the policy's one head pass (the trainer's path for reverse/forward KL)       |
| distill_jsd        | the policy's loss head (log p) with the JSD as its chunk term (parallel/distill_chunk.py:|
|                    | the trainer's path; one weight-gradient accumulator, the teacher's logits per chunk) |
| distill_topk       | the teacher's top-k (no grad; k values and ids per token all-gathered: what a teacher|
|                    | process would ship), then the student's loss head (log p) with the top-k cross-entropy |
|                    | as its chunk term (the trainer's path)                                             |
| distill_jsd_call   | the policy's loss head, then parallel/distill_head.py's JSD head on the same hidden |
|                    | states as a second call (its own weight-gradient buffer: the path without the loss- |
|                    | inside head, algo.fused_loss=false)                                                |

`gather` and `fused_exact` at ref_hidden != H are the "both models' gathered logits" and "kltron's fused
head between two widths" rows (tools/klcost/methods.py).
"""

from __future__ import annotations

from parallel.distill_chunk import DistillChunkTerm
from parallel.distill_head import distill_divergence
from parallel.distill_topk import teacher_topk
from parallel.fused_loss import fused_head_loss

TOP_K = 20  # tokens shipped per position by distill_topk


def distill_outputs(name, x, hp, group, chunk):
    c, kw = x.coef, dict(vocab_size=x.V, chunk_size=chunk)
    if name == "distill_fused_loss":
        loss, out = fused_head_loss(hp, x.w, x.t, group, ref_hidden=x.hr, ref_weight_local=x.wr, entropy=False,
                                    kl="forward", token_loss=lambda lp, ent, kl, s: lp.float() * c[0][s]
                                    + kl.float() * c[2][s], **kw)
        return (out.logprobs, None, out.kl), loss
    lp_loss = lambda lp, ent, kl, s: lp.float() * c[0][s]  # noqa: E731
    if name in ("distill_jsd", "distill_topk"):
        topk = teacher_topk(x.hr, x.wr, TOP_K, group, **kw) if name == "distill_topk" else None
        term = DistillChunkTerm("jsd" if topk is None else "topk_forward_kl", c[2], None if topk else x.hr,
                                None if topk else x.wr, topk=topk, beta=0.5)
        loss, out = fused_head_loss(hp, x.w, x.t, group, entropy=False, kl=None, token_loss=lp_loss, extra=term, **kw)
        return (out.logprobs, None, term.values), loss
    if name != "distill_jsd_call":
        raise ValueError(f"unknown distillation method {name!r}")
    loss, out = fused_head_loss(hp, x.w, x.t, group, entropy=False, kl=None, token_loss=lp_loss, **kw)
    term = distill_divergence(hp, x.w, x.hr, x.wr, group, kind="jsd", beta=0.5, **kw)
    return (out.logprobs, None, term), loss + (term.float() * c[2]).sum()
