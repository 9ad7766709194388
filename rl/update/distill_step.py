"""What distillation adds to one step's experience (rl/update/step_data.py): the teacher's pass over
the sampled sequences (its hidden states and head weight, once per step, like the reference's), the
teacher's log-probs of the sampled tokens (the sampled reverse-KL estimate, a metric, and the
`sampled_reverse_kl` baseline's advantage), its top-k for `topk_forward_kl`.

The sampled baseline (Thinking Machines' on-policy distillation): each token's advantage is
-coef * (log s(x_t) - log t(x_t)) at the sampled token, discount 0, with the policy-gradient loss.
E_s[(log s - log t) grad log s] = grad KL(s || t) at the position with the prefix fixed, so its
expectation is the exact reverse-KL term's gradient; it is one sample of it (its variance is the
price), and it needs the old log-probs before the update (no deferred rows).
"""

from __future__ import annotations

import torch

from parallel.distill_topk import teacher_topk
from rl.objectives.kl import sanitize
from rl.update.logprobs import logprobs_from_hidden, reference_hidden


@torch.no_grad()
def teacher_pass(data, teacher, cfg, heads, shared=None, computed=None) -> None:
    """Fill data.teacher_hidden / teacher_weight / teacher_logp (and teacher_topk) for this step's rows.
    `computed`: the teacher's (hidden, weight) already at hand (it is the reference: no second forward)."""
    ro, mask, d = data.ro, data.mask, cfg.distill
    # the reference's pass, on the teacher: [B, N, H_t] and its local head weight [Vp/tp, H_t]
    th, tw = computed or reference_hidden(teacher, ro.sequences, ro.attention_mask, ro.prompt_len, packed=shared)
    data.teacher_hidden, data.teacher_weight = th, tw
    kw = dict(tp_group=heads.tp_group, vocab_size=heads.vocab_size, chunk_size=heads.chunk_size)
    data.teacher_logp = sanitize(logprobs_from_hidden(th, tw, ro.responses_ids, temperature=cfg.teacher.temperature,
                                                      mask=mask, **kw).float(), mask)
    if d.loss == "topk_forward_kl":
        data.teacher_topk = teacher_topk(th, tw, d.top_k, temperature=cfg.teacher.temperature, **kw)


def distill_advantages(data, d, step: int) -> torch.Tensor:
    """The per-token advantage distillation adds: the sampled baseline's -coef (log s - log t), else 0."""
    if d.loss != "sampled_reverse_kl":
        return torch.zeros_like(data.old_logp, dtype=torch.float32)
    adv = -(data.old_logp.float() - data.teacher_logp) * d.coef_at(step)
    return torch.where(data.mask, adv, adv.new_zeros(()))
