"""The RL passes' heads under context parallelism (`parallel.cp > 1`; parallel/context.py).

Every cp rank of a dp group holds the same rollout rows (they generated them together: docs/design.md
"Context parallelism"). A pass over rows [R, S] (padded rows, a packed sequence, shared-prompt rows)
becomes, on each cp rank, a forward over its own tokens of the load-balanced layout:

  1. The head tokens' predicting positions [M] (flattened over the rows): the causal label shift happens
     here, over the whole row: position P + t - 1 predicts response token t, even when the two sit on
     different ranks (a shared prompt's last position predicts the first token of every response).
  2. Padded rows ([left padding | real tokens | trailing padding]) are rolled left so that their real
     tokens start at 0 and plain causal attention is the mask (core/causal_layout.py); other padding
     becomes documents (a real token sees the real tokens, a padding token only itself). Packed and
     shared-prompt rows keep their document_ids / prefix_ids: both attentions mask by global index and
     document, so documents may cross chunk boundaries.
  3. ids, positions and documents are sharded (`ContextParallel.shard`, the tail padded to a multiple of
     2*cp); the model runs with `context=`; the head picks the head tokens whose predicting position is
     this rank's and hands them, with their targets, masks and reference hidden states, to the fused head.
  4. Per-token results [M_local] land at their flat indices in zeros [B * N] and one all-reduce (sum) over
     cp makes the full [B, N] on every cp rank (each token is computed on exactly one rank: x + 0 = x, bit
     for bit). The fused loss stays this rank's partial sum: its gradient is this rank's tokens', and the
     gradient reduction over dp x cp (FSDP2 over the flattened mesh) adds the ranks' parts. The per-token
     loss sees each token's flat index (its weights, advantages, old log-probs), so the loss normalisation
     is the cp=1 one (global token counts over dp: the cp ranks share the rows).

No [tokens, vocab] tensor, no logits and no hidden states cross the cp group, except the reference pass's
final hidden states of the response tokens ([B, N, H], summed over cp once per step), which the update's
exact KL reads at whatever rank its token lands on in the update's own micro-batch layout.
"""

from __future__ import annotations

import torch

from core.causal_layout import left_pad_shift, roll_rows
from parallel.comm import all_reduce, copy_to_tp


def context_of(model):
    """The model's `parallel.context.ContextParallel` (set by rl/train.py when parallel.cp > 1), or None."""
    cp = getattr(model, "context_parallel", None)
    return cp if cp is not None and cp.size > 1 else None


def padded_head_pos(B: int, S: int, prompt_len: int, N: int, device) -> torch.Tensor:
    """[B * N]: response token t of row b is predicted at position P-1+t -> flattened index b*S + P-1+t."""
    rows = torch.arange(B, device=device)[:, None] * S
    return (rows + prompt_len - 1 + torch.arange(N, device=device)[None]).reshape(-1)


def context_inputs(input_ids, head_pos, *, attention_mask=None, position_ids=None, document_ids=None,
                   prefix_ids=None) -> dict:
    """Rows [R, S] and the flattened positions [M] whose hidden states predict the head tokens (one position
    may predict several tokens: a shared prompt's last token) -> the whole-row inputs of the CP forward."""
    R, S = input_ids.shape
    dev = input_ids.device
    if attention_mask is not None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        shift = left_pad_shift(attention_mask)
        if shift is not None:  # causal in disguise: roll each row's real tokens to the front
            input_ids, position_ids = roll_rows(input_ids, shift), roll_rows(position_ids, shift)
            b, j = head_pos // S, head_pos % S
            head_pos = b * S + (j - shift[b]) % S
        else:  # padding inside rows: a document of its own per padding token
            ar = torch.arange(S, device=dev).expand(R, S)
            document_ids = torch.where(attention_mask.bool(), torch.zeros_like(ar), -1 - ar)
    elif position_ids is None:
        position_ids = torch.arange(S, device=dev).expand(R, S)
    return dict(input_ids=input_ids, position_ids=position_ids, document_ids=document_ids, prefix_ids=prefix_ids,
                head_pos=head_pos)


def run_context_head(model, cp, inputs: dict, targets, tp_group, ref_hidden, mask, fn, extra=None):
    """The CP forward of `inputs` (`context_inputs`) with fn(h [M_l, H], w, targets, ref_hidden, mask[, extra],
    tokens=flat indices [M_l]) on the head tokens whose predicting position is this rank's; targets, mask
    [B, N], ref_hidden / extra [B, N, H] or None (B * N = M). Returns (fn's result, flat indices [M_l])."""
    sh = lambda t, pad=0: None if t is None else cp.shard(t, 1, pad)
    ids = inputs["input_ids"]
    R, S = ids.shape
    mine = sh(torch.arange(R * S, device=ids.device).view(R, S), -1).reshape(-1)  # flattened positions held here
    local_of = torch.full((R * S,), -1, dtype=torch.long, device=ids.device)
    real = mine >= 0
    local_of[mine[real]] = torch.arange(mine.numel(), device=ids.device)[real]
    at = local_of[inputs["head_pos"]]  # (M,) this rank's row of each head token's hidden state, or -1
    idx = torch.nonzero(at >= 0).flatten()
    rows = at[idx]
    kw = dict(position_ids=sh(inputs["position_ids"]), document_ids=sh(inputs["document_ids"], -1),
              prefix_ids=sh(inputs["prefix_ids"], -1))
    flat = lambda t: None if t is None else t.reshape(targets.numel(), *t.shape[2:])[idx]

    def head(h, w):
        hr = copy_to_tp(h.reshape(-1, h.shape[-1])[rows], tp_group)  # (M_l, H)
        args = (hr, w, flat(targets), flat(ref_hidden), flat(mask))
        if extra is not None:
            args = args + (flat(extra),)
        return fn(*args, tokens=idx)

    return model(sh(ids), **kw, context=cp, head=head), idx


def spread(cp, values: torch.Tensor | None, idx: torch.Tensor, n: int) -> torch.Tensor | None:
    """This rank's per-token values [M_l, ...] -> [n, ...] on every cp rank (0 where no token: one all-reduce)."""
    if values is None:
        return None
    out = values.detach().new_zeros((n,) + tuple(values.shape[1:]))
    out[idx] = values.detach()
    return all_reduce(out, "sum", cp.group)


class LocalTokens:
    """A per-token loss (rl/objectives/losses.py's TokenPolicyLoss) seen through this rank's head tokens:
    the head's token positions 0..M_l-1 are mapped to their flat indices before the loss reads its
    per-token tensors (weights, advantages, old log-probs)."""

    def __init__(self, token_loss, idx: torch.Tensor):
        self.token_loss, self.idx = token_loss, idx

    def __call__(self, logp, entropy, kl, tokens):
        return self.token_loss(logp, entropy, kl, self.idx[tokens])

    def __getattr__(self, name):
        return getattr(self.token_loss, name)


def reduce_loss_records(token_loss, group) -> None:
    """Each cp rank's per-token loss (rl/objectives/losses.py's TokenPolicyLoss) recorded its own tokens' parts
    (0 elsewhere): sum them over `group`, and which values it saw, so that `stats()` covers every token on
    every rank."""
    for v in token_loss.rec.values():
        all_reduce(v, "sum", group)
    seen = torch.tensor([float(token_loss.seen[k]) for k in ("kl", "entropy")], device=token_loss.m.device)
    all_reduce(seen, "max", group)
    token_loss.seen = {"kl": bool(seen[0] > 0), "entropy": bool(seen[1] > 0)}
