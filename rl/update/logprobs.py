"""Per-response-token quantities from the policy, the reference and the critic.

All go through the model's `head=` callback so that, under FSDP2, the head weight is gathered
around the call; the vocab-parallel ones go through the fused head, so no [tokens, vocab] logits
tensor exists and no logits cross the wire.

Positions: the response token at index t (0-based, sequence position P + t) is predicted by the
hidden state at position P + t - 1, so a response of N tokens uses hidden[:, P-1 : P+N-1].
Packed sequences (`packed_token_stats`, `packed_fused_loss`; rl/update/micro_batches.py's PackedRows):
several rows in one [1, T] sequence, block-diagonal causal attention, each row's own positions;
the head reads the M hidden states at `head_pos` and returns [1, M]. The shared-prompt layout
(rl/update/shared_layout.py) is a PackedRows of R rows with `prefix_ids`: the same heads read it
(head_pos indexes the flattened [R * T] positions). `policy_token_stats` and `reference_hidden`
take it as `packed=` and return the padded [B, N] shapes (0 where no head token).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch

from parallel.comm import copy_to_tp
from parallel.fused import fused_head
from parallel.fused_loss import fused_head_loss
from parallel.invariant import batch_invariant
from rl.update.context_heads import (
    LocalTokens,
    context_inputs,
    context_of,
    padded_head_pos,
    reduce_loss_records,
    run_context_head,
    spread,
)
from rl.update.micro_batches import gather_tokens, scatter_tokens


class TokenStats(NamedTuple):
    logprobs: torch.Tensor  # [B, N] log pi(response token) at the sampling temperature
    entropy: torch.Tensor | None  # [B, N]
    kl: torch.Tensor | None  # [B, N] exact full-vocabulary KL to the reference (direction as asked)
    # [B, N] exact full-vocabulary KL(rollout || this forward) of the tempered distributions, from the
    # rollout's recorded hidden states (`rollout_hidden=`): the rollout-vs-training mismatch
    rollout_kl: torch.Tensor | None = None


def _response_hidden(h: torch.Tensor, prompt_len: int) -> torch.Tensor:
    return h[:, prompt_len - 1:-1]  # (B, N, H)


def _through_head(model, sequences, attention_mask, prompt_len: int, tp_group, ref_hidden, mask, fn, extra=None):
    """Run `model` with a head that hands the response positions, flattened, to
    fn(hidden [B*N, H] (copied to tp), weight_local, targets [B*N], ref_hidden [B*N, H] or None,
    mask [B*N] or None). `mask` [B, N] (the response mask) tells the fused heads which positions are
    padding: those never reach a value or a gradient, whatever they hold. Under context parallelism
    (rl/update/context_heads.py) each cp rank runs its own tokens and the results are the same."""
    cp = context_of(model)
    if cp is not None:
        B, S = sequences.shape
        pos = padded_head_pos(B, S, prompt_len, S - prompt_len, sequences.device)
        return _context_head(model, cp, context_inputs(sequences, pos, attention_mask=attention_mask),
                             sequences[:, prompt_len:], tp_group, ref_hidden, mask, fn, extra)
    return _run_head(model, sequences, dict(attention_mask=attention_mask), lambda h: _response_hidden(h, prompt_len),
                     sequences[:, prompt_len:], tp_group, ref_hidden, mask, fn, extra)


def _through_head_packed(model, packed, tp_group, ref_hidden, mask, fn, extra=None):
    """`_through_head` over one packed sequence (rl/update/micro_batches.py's PackedRows): the head reads the
    hidden states at `packed.head_pos` [M] of the flattened [R * T] positions (R = 1 packed, R prompt
    groups shared); ref_hidden and mask are [1, M, H] and [1, M]."""
    cp = context_of(model)
    if cp is not None:
        inputs = context_inputs(packed.input_ids, packed.head_pos, position_ids=packed.position_ids,
                                document_ids=packed.document_ids, prefix_ids=packed.prefix_ids)
        return _context_head(model, cp, inputs, packed.targets[None], tp_group, ref_hidden, mask, fn, extra)
    kw = dict(position_ids=packed.position_ids, document_ids=packed.document_ids)
    if packed.prefix_ids is not None:
        kw["prefix_ids"] = packed.prefix_ids
    return _run_head(model, packed.input_ids, kw, lambda h: h.reshape(1, -1, h.shape[-1])[:, packed.head_pos],
                     packed.targets[None], tp_group, ref_hidden, mask, fn, extra)


def _run_head(model, input_ids, model_kw: dict, select, targets, tp_group, ref_hidden, mask, fn, extra=None):
    """`extra` [B, N, H] (the rollout's hidden states) reaches fn as a sixth argument, flattened."""
    B, N = targets.shape
    flat_mask = None if mask is None else mask.reshape(B * N)

    def head(h, w):
        hr = copy_to_tp(select(h), tp_group).reshape(B * N, -1)
        rh = None if ref_hidden is None else ref_hidden.reshape(B * N, -1)
        if extra is not None:
            return fn(hr, w, targets.reshape(-1), rh, flat_mask, extra.reshape(B * N, -1))
        return fn(hr, w, targets.reshape(-1), rh, flat_mask)

    return model(input_ids, **model_kw, head=head), (B, N)


def _context_head(model, cp, inputs, targets, tp_group, ref_hidden, mask, fn, extra):
    """`_run_head` under context parallelism: fn on this rank's head tokens, the per-token values made whole
    over cp ([B * N] on every cp rank); a loss stays this rank's part (its gradient: this rank's tokens)."""
    B, N = targets.shape
    res, idx = run_context_head(model, cp, inputs, targets, tp_group, ref_hidden, mask, fn, extra)
    loss, out = (None, res) if hasattr(res, "logprobs") else res  # stats, or (loss, stats)
    whole = TokenStats(*(spread(cp, getattr(out, k, None), idx, B * N) for k in TokenStats._fields))
    if loss is None:
        return whole, (B, N)
    token_loss = getattr(fn, "token_loss", None)
    if token_loss is not None and hasattr(token_loss, "rec"):
        reduce_loss_records(token_loss, cp.group)  # its statistics over every cp rank's tokens
    return (loss, whole), (B, N)


def _stats(out, shape) -> TokenStats:
    view = lambda t: None if t is None else t.view(shape)
    return TokenStats(view(out.logprobs), view(out.entropy), view(out.kl), view(getattr(out, "rollout_kl", None)))


def policy_token_stats(model, sequences, attention_mask, prompt_len: int, *, tp_group=None, vocab_size: int,
                       temperature: float = 1.0, chunk_size: int | None = None, entropy: bool = True,
                       kl: str | None = None, ref_hidden: torch.Tensor | None = None,
                       ref_weight: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                       packed=None, rollout_hidden: torch.Tensor | None = None, tap=None) -> TokenStats:
    """Log-probs (and entropy, exact KL against the given reference hidden states and head
    weight) of the response tokens of `sequences` [B, P + N] under `model`; 0 where `mask` [B, N]
    is False. `packed`: the shared-prompt layout of these rows (rl/update/shared_layout.py) to run instead;
    the results are the same [B, N] (0 outside its head tokens). `rollout_hidden` [B, N, H]: the
    rollout's final hidden states of these tokens; adds `rollout_kl`, the exact KL(rollout || model)
    through the same head weight (the head's reference side where no reference KL takes it, else a second
    pass of the fused head; no [T, V] tensor either way)."""
    fn = _stats_head(tp_group, vocab_size, temperature, chunk_size, entropy, kl, ref_weight, tap)
    if packed is None:
        return _stats(*_through_head(model, sequences, attention_mask, prompt_len, tp_group, ref_hidden, mask, fn,
                                     rollout_hidden))
    B, N = sequences.shape[0], sequences.shape[1] - prompt_len
    out = _stats(*_through_head_packed(model, packed, tp_group, gather_tokens(packed, ref_hidden),
                                       gather_tokens(packed, mask), fn, gather_tokens(packed, rollout_hidden)))
    return TokenStats(*(scatter_tokens(packed, t, B, N) for t in out))


def packed_token_stats(model, packed, *, tp_group=None, vocab_size: int, temperature: float = 1.0,
                       chunk_size: int | None = None, entropy: bool = True, kl: str | None = None,
                       ref_hidden: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None, rollout_hidden: torch.Tensor | None = None,
                       tap=None) -> TokenStats:
    """`policy_token_stats` of the M response tokens of a packed sequence (rl/update/micro_batches.py's
    PackedRows: several rows in one, block-diagonal causal attention, per-row positions): [1, M]
    each; ref_hidden and rollout_hidden [1, M, H], mask [1, M]."""
    fn = _stats_head(tp_group, vocab_size, temperature, chunk_size, entropy, kl, ref_weight, tap)
    return _stats(*_through_head_packed(model, packed, tp_group, ref_hidden, mask, fn, rollout_hidden))


def _stats_head(tp_group, vocab_size, temperature, chunk_size, entropy, kl, ref_weight, tap=None):
    """The head of the no-loss passes: log-probs, entropy, the exact KL to the reference when `kl` names a
    direction (the reference's hidden states and head read only then: without it they would be a second
    head matmul whose log-probs nobody reads) and the rollout-vs-training KL. With no reference KL and no
    gradient, the rollout's hidden states take the fused head's reference side: one pass of the head gives
    the log-probs, the entropy and KL(rollout || model), the policy's logits computed once, not twice."""
    def fn(h, w, t, rh, m, rollout_h=None, tokens=None):
        if tap is not None:  # a term on the same hidden states (rl/distill/term.py): the model runs once
            tap(h, w, m)
        if kl is None and rollout_h is not None and not torch.is_grad_enabled():
            out = fused_head(h, w, t, tp_group, vocab_size=vocab_size, ref_hidden=rollout_h, ref_weight_local=w,
                             temperature=temperature, chunk_size=chunk_size, entropy=entropy, kl="reverse", mask=m)
            return TokenStats(out.logprobs, out.entropy, None, out.kl)
        rw = ref_weight if kl is not None else None
        out = fused_head(h, w, t, tp_group, vocab_size=vocab_size, ref_hidden=rh if kl is not None else None,
                         ref_weight_local=rw, temperature=temperature, chunk_size=chunk_size, entropy=entropy,
                         kl=kl, mask=m)
        if rollout_h is None:
            return out
        return TokenStats(out.logprobs, out.entropy, out.kl, _rollout_kl(h, w, rollout_h, m, tp_group, vocab_size,
                                                                         temperature, chunk_size))
    return fn


@torch.no_grad()
def _rollout_kl(h, w, rollout_h, m, tp_group, vocab_size, temperature, chunk_size) -> torch.Tensor:
    """KL(q || p) per token, q the rollout's logits (its hidden states through this same head weight), p
    this forward's: a metric, no gradient."""
    return fused_head(h.detach(), w.detach(), None, tp_group, vocab_size=vocab_size, ref_hidden=rollout_h,
                      ref_weight_local=w.detach(), temperature=temperature, chunk_size=chunk_size, entropy=False,
                      kl="reverse", mask=m).kl


@contextlib.contextmanager
def _root_gathered(model):
    """Under FSDP2, the root's parameters (embedding, final norm, LM head) gathered for a head-only
    computation outside forward, resharded after; otherwise nothing to do."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


@torch.no_grad()
def stats_from_hidden(model, hidden: torch.Tensor, targets: torch.Tensor, *, tp_group=None, vocab_size: int,
                      temperature: float = 1.0, chunk_size: int | None = None, entropy: bool = True,
                      kl: str | None = None, ref_hidden: torch.Tensor | None = None,
                      ref_weight: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> TokenStats:
    """`policy_token_stats` from final hidden states [B, N, H] already computed (the rollout's, recorded by
    `generate(record_hidden=True)`): the policy's head alone, its weight as forward hands it to the head
    (in the compute dtype), in the model's batch-invariant mode. With the mode on and the weights that
    sampled, these are the bits a full forward would give (parallel/invariant.py): no trunk forward."""
    B, N = targets.shape
    fn = _stats_head(tp_group, vocab_size, temperature, chunk_size, entropy, kl, ref_weight)
    with _root_gathered(model), batch_invariant(getattr(model, "batch_invariant", False)):
        w = model.head_weight
        if model.compute_dtype is not None:
            w, hidden = w.to(model.compute_dtype), hidden.to(model.compute_dtype)
        out = fn(hidden.reshape(B * N, -1), w, targets.reshape(-1),
                 None if ref_hidden is None else ref_hidden.reshape(B * N, -1),
                 None if mask is None else mask.reshape(B * N))
    return _stats(out, (B, N))


@torch.no_grad()
def logprobs_from_hidden(hidden: torch.Tensor, weight_local: torch.Tensor, targets: torch.Tensor, *, tp_group=None,
                         vocab_size: int, temperature: float = 1.0, chunk_size: int | None = None,
                         mask: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    """Log-probs [B, N] of `targets` [B, N] from final hidden states [B, N, H] and a local head
    weight [Vp/tp, H] (e.g. what `reference_hidden` returned): no second forward of the model.
    0 where `mask` [B, N] is False. `invariant`: the head in batch-invariant mode (as the model's
    forward runs it with `batch_invariant` on: the same bits as the policy's head for the same weights)."""
    B, N = targets.shape
    with batch_invariant(invariant):
        out = fused_head(hidden.reshape(B * N, -1), weight_local, targets.reshape(-1), tp_group, vocab_size=vocab_size,
                         temperature=temperature, chunk_size=chunk_size, entropy=False,
                         mask=None if mask is None else mask.reshape(B * N))
    return out.logprobs.view(B, N)


@torch.no_grad()
def reference_hidden(ref, sequences, attention_mask, prompt_len: int, packed=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's final hidden states at the response positions [B, N, H] and its local head
    weight [Vp/tp, H] (copied: under FSDP the gathered weight is freed after forward). `packed`: the
    shared-prompt layout of these rows to run instead (hidden states 0 outside its head tokens)."""
    cp = context_of(ref)
    if cp is not None:  # this rank's tokens' hidden states, made whole over cp: [B, N, H] on every cp rank
        B, N = sequences.shape[0], sequences.shape[1] - prompt_len
        if packed is None:
            inputs = context_inputs(sequences, padded_head_pos(B, sequences.shape[1], prompt_len, N, sequences.device),
                                    attention_mask=attention_mask)
            shape = (B, N)
        else:
            inputs = context_inputs(packed.input_ids, packed.head_pos, position_ids=packed.position_ids,
                                    document_ids=packed.document_ids, prefix_ids=packed.prefix_ids)
            shape = (1, packed.head_pos.numel())
        (h, w), idx = run_context_head(ref, cp, inputs, torch.zeros(shape, dtype=torch.long, device=sequences.device),
                                       None, None, None, lambda h, w, *a, tokens: (h, w.detach().clone()))
        h = spread(cp, h, idx, shape[0] * shape[1]).view(*shape, -1)
        return (h, w) if packed is None else (scatter_tokens(packed, h, B, N), w)
    if packed is None:
        return ref(sequences, attention_mask=attention_mask,
                   head=lambda h, w: (_response_hidden(h, prompt_len).clone(), w.detach().clone()))
    kw = dict(position_ids=packed.position_ids, document_ids=packed.document_ids, prefix_ids=packed.prefix_ids)
    h, w = ref(packed.input_ids, **kw,
               head=lambda h, w: (h.reshape(1, -1, h.shape[-1])[:, packed.head_pos], w.detach().clone()))
    return scatter_tokens(packed, h, sequences.shape[0], sequences.shape[1] - prompt_len), w


def critic_values(critic, sequences, attention_mask, prompt_len: int) -> torch.Tensor:
    """V(state before each response token) [B, N]."""
    return critic(sequences, attention_mask=attention_mask)[:, prompt_len - 1:-1]


def policy_fused_loss(model, sequences, attention_mask, prompt_len: int, token_loss, *, tp_group=None,
                      vocab_size: int, temperature: float = 1.0, chunk_size: int | None = None, entropy: bool = False,
                      kl: str | None = None, ref_hidden: torch.Tensor | None = None,
                      ref_weight: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                      rollout_hidden: torch.Tensor | None = None, tap=None,
                      extra=None) -> tuple[torch.Tensor, TokenStats]:
    """The policy loss over the response tokens through `parallel.fused_loss.fused_head_loss`
    (gradient formed in forward, no logits recomputed in backward). Returns (loss, detached
    per-token stats [B, N]). Positions where `mask` [B, N] is False are dropped inside the head.
    `rollout_hidden` [B, N, H]: also the exact KL(rollout || model) per token (no gradient). `tap(h, w, mask)`:
    called on the head's flat hidden states and weight too (a distillation term, rl/distill/term.py). `extra`: a
    term inside the head (fused_head_loss's `extra`, parallel/distill_chunk.py)."""
    fn = _loss_head(token_loss, tp_group, vocab_size, temperature, chunk_size, entropy, kl, ref_weight, tap, extra)
    (loss, out), shape = _through_head(model, sequences, attention_mask, prompt_len, tp_group, ref_hidden, mask, fn,
                                       rollout_hidden)
    return loss, _stats(out, shape)


def packed_fused_loss(model, packed, token_loss, *, tp_group=None, vocab_size: int, temperature: float = 1.0,
                      chunk_size: int | None = None, entropy: bool = False, kl: str | None = None,
                      ref_hidden: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None,
                      rollout_hidden: torch.Tensor | None = None, tap=None,
                      extra=None) -> tuple[torch.Tensor, TokenStats]:
    """`policy_fused_loss` over the M response tokens of a packed sequence (see `packed_token_stats`):
    (loss, detached per-token stats [1, M]); `token_loss` is bound to [1, M] tensors."""
    fn = _loss_head(token_loss, tp_group, vocab_size, temperature, chunk_size, entropy, kl, ref_weight, tap, extra)
    (loss, out), shape = _through_head_packed(model, packed, tp_group, ref_hidden, mask, fn, rollout_hidden)
    return loss, _stats(out, shape)


class _WithoutKL:
    """A token loss called with the head's KL column withheld (that column is the rollout-vs-training KL,
    a metric): the loss and its gradient are those of the wrapped loss without a reference KL."""

    def __init__(self, token_loss):
        self.inner = token_loss

    def __call__(self, logprobs, entropy, kl, tokens):
        return self.inner(logprobs, entropy, None, tokens)


def _loss_head(token_loss, tp_group, vocab_size, temperature, chunk_size, entropy, kl, ref_weight, tap=None,
               extra=None):
    def fn(h, w, t, rh, m, rollout_h=None, tokens=None):
        """`tokens` (context parallel): the flat indices of these head tokens in the pass's [B * N]."""
        tl = token_loss if tokens is None else LocalTokens(token_loss, tokens)
        if tap is not None:
            tap(h, w, m)
        if getattr(token_loss, "needs_logprobs", False):
            # a sequence-level ratio (GSPO, rl/objectives/policy_objectives.py) reads every token of a response
            # before any token's loss: the head once more without a gradient, on the same hidden states
            with torch.no_grad():
                tl.prepare(fused_head(h.detach(), w.detach(), t, tp_group, vocab_size=vocab_size,
                                              temperature=temperature, chunk_size=chunk_size, entropy=False,
                                              mask=m).logprobs)
        if kl is None and rollout_h is not None and extra is None:
            # the rollout's hidden states take the head's reference side (read detached, no gradient): the
            # rollout-vs-training KL from the loss's own logits, not from a second pass that recomputes them;
            # the loss never sees that KL. Not beside an in-head term (distillation): its teacher logits
            # would be a third [chunk, V] buffer at the loss head's peak
            loss, out = fused_head_loss(h, w, t, tp_group, token_loss=_WithoutKL(tl), vocab_size=vocab_size,
                                        ref_hidden=rollout_h, ref_weight_local=w, temperature=temperature,
                                        chunk_size=chunk_size, entropy=entropy, kl="reverse", mask=m, extra=extra)
            return loss, TokenStats(out.logprobs, out.entropy, None, out.kl)
        loss, out = fused_head_loss(h, w, t, tp_group, token_loss=tl, vocab_size=vocab_size, ref_hidden=rh,
                                    ref_weight_local=ref_weight, temperature=temperature, chunk_size=chunk_size,
                                    entropy=entropy, kl=kl, mask=m, extra=extra)
        if rollout_h is None:
            return loss, out
        return loss, TokenStats(out.logprobs, out.entropy, out.kl, _rollout_kl(h, w, rollout_h, m, tp_group,
                                                                               vocab_size, temperature, chunk_size))
    fn.token_loss = token_loss
    return fn


@dataclass
class PolicyHeads:
    """The fused heads' settings fixed for a run, applied to a rollout's rows (`ro`: rl.experience.rollout.Rollout,
    [B, P + N]): the vocabulary the log-probs, entropy and exact KL are taken over (the tokenizer's ids,
    the ones the sampler draws from), the sampling temperature, the chunk, and the TP group the head's
    weight is sharded over."""

    tp_group: object
    vocab_size: int
    temperature: float
    chunk_size: int | str | None

    def settings(self) -> dict:
        return dict(tp_group=self.tp_group, vocab_size=self.vocab_size, temperature=self.temperature,
                    chunk_size=self.chunk_size)

    def token_stats(self, model, ro, **kw) -> TokenStats:
        """`policy_token_stats` of `ro`'s response tokens under `model`: TokenStats [B, N]."""
        return policy_token_stats(model, ro.sequences, ro.attention_mask, ro.prompt_len, **self.settings(),
                                  mask=ro.response_mask, **kw)

    def fused_loss(self, model, ro, token_loss, **kw) -> tuple[torch.Tensor, TokenStats]:
        """`policy_fused_loss` of `ro`'s response tokens under `model`: (loss, TokenStats [B, N])."""
        return policy_fused_loss(model, ro.sequences, ro.attention_mask, ro.prompt_len, token_loss,
                                 **self.settings(), mask=ro.response_mask, **kw)
