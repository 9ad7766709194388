"""Sampling with a KV cache under tensor parallelism, without gathering logits.

The sampler (core/generation/sampling.py) draws from vocabulary-sharded logits with noise keyed by (seed,
step, row id, position, global vocabulary index), so every TP layout, DP layout and batch order
draws the same token for the same row, with O(B) communication per position.

The decode loop:
  - prefill runs the left-padded prompts once and projects only the last position through the LM
    head ([B, 1, Vp/tp], not [B, P, Vp/tp]); with `share_prefill`, each distinct prompt (equal real
    token ids) is prefilled once and its KV cache and last logits copied to its rows (GRPO's G
    samples of a prompt): the noise is keyed by row id, so the same tokens are drawn;
  - the KV cache is preallocated for the batch and P + max_new_tokens positions;
  - with `min_new_tokens`, the stop ids' logits are -inf until a row has that many tokens (as
    transformers' MinNewTokensLengthLogitsProcessor), so no row ends earlier;
  - a row stops on any EOS id, on a stop token sequence, on `stop_check(response_ids)` (e.g. a
    decoded-text check for stop strings), or at max_new_tokens; the stop token is part of the
    response, nothing after it is;
  - finished rows leave the batch: when the live rows fall to 3/4 of the batch, the batch and its
    cache are compacted to the live rows, so they stop costing compute;
  - the LM head of the sampled positions computes its logits as the trainer's fused head does
    (parallel/fused.py's head_logits: float32 output from bf16 operands, rows padded in batch-invariant
    mode), so under bf16 compute the sampler draws from the distribution the trainer scores, not from
    bf16-rounded logits;
  - `record=True` keeps, per response token, log mu(y) (the distribution actually drawn from:
    tempered, truncated by top-k / top-p / min-p and renormalised) and log pi_T(y) (tempered, full
    vocabulary); `record_hidden=True` also the final hidden state [H] that produced the token's
    logits. They are written at the rows' places, so they follow compaction and the shared prefill;
  - DP ranks run the same number of decode steps (an all-reduce of "anyone still generating" per
    step), because under FSDP each forward is a collective over the DP group; a rank with no live
    rows keeps one finished row as a placeholder.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from core.generation.sampling import sample_from_sharded_logits, tempered_logprob
from core.model import KVCache, Transformer
from parallel.comm import all_reduce, copy_to_tp, group_rank
from parallel.fused import head_logits
from parallel.invariant import key_capacity

__all__ = ["GenerationOutput", "generate", "sample_from_sharded_logits"]

COMPACT_BELOW = 0.75  # compact the batch when live rows <= this fraction of it


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [B, P + N] left-padded prompt then response (pad after the stop)
    attention_mask: torch.Tensor  # [B, P + N] 1 on real tokens (prompt and response incl. the stop token)
    response_mask: torch.Tensor  # [B, N] 1 on response tokens up to and including the stop token
    prompt_len: int  # P
    n_tokens: int = 0  # response tokens generated on this rank
    seconds: float = 0.0  # wall time of the whole generation (prefill + decode) on this rank
    # `record`: [B, N] float32, 0 off the response mask: log mu(token) (the sampled distribution:
    # tempered, truncated, renormalised) and log pi_T(token) (tempered, full vocabulary)
    logprobs: torch.Tensor | None = None
    tempered_logprobs: torch.Tensor | None = None
    hidden: torch.Tensor | None = None  # `record_hidden`: [B, N, H] final hidden states (compute dtype), 0 off the mask

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0


@contextlib.contextmanager
def _keep_unsharded(model):
    """Under FSDP2, keep parameters gathered for the whole decode loop instead of re-gathering
    them for every token; reshard once at the end."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        yield
        return
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in mods:
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()


def _last_position_head(tp_group):
    """A forward `head` projecting only the last position: hidden [B, S, H] -> (logits [B, Vp/tp]
    float32, hidden [B, H]). The logits are those of the trainer's fused head (HeadMatmul with float32
    reductions): float32 output of the bf16 operands under bf16 compute, never rounded to bf16."""
    def head(hidden, weight_local):
        return head_logits(copy_to_tp(hidden[:, -1], tp_group), weight_local, tp_group), hidden[:, -1]
    return head


def _cat(outs: list[tuple]) -> tuple:
    """The blocks' (logits, hidden) pairs joined on rows."""
    return outs[0] if len(outs) == 1 else tuple(torch.cat(x) for x in zip(*outs))


class _Stopper:
    """Which freshly sampled tokens end their row: EOS ids, stop token sequences, stop_check."""

    def __init__(self, eos_ids, stop_sequences, stop_check, device):
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
        self.seqs = [list(s) for s in (stop_sequences or []) if len(s) > 0]
        self.check = stop_check
        self.host = bool(self.seqs) or stop_check is not None

    def __call__(self, tok: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """tok [b] just sampled; responses [b, t+1] the live rows' responses so far -> bool [b]."""
        fin = torch.isin(tok, self.eos) if self.eos.numel() else torch.zeros_like(tok, dtype=torch.bool)
        if not self.host:
            return fin
        flags = fin.tolist()
        for i, r in enumerate(responses.tolist()):
            if flags[i]:
                continue
            flags[i] = any(r[-len(s):] == s for s in self.seqs if len(s) <= len(r)) or \
                bool(self.check is not None and self.check(r))
        return torch.tensor(flags, dtype=torch.bool, device=tok.device)


def distinct_prompts(ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """Left-padded prompts ids, mask [B, P] -> (each row's prompt id [B], numbered in order of first
    appearance; the first row holding each prompt [U]). Rows hold the same prompt iff their real
    tokens are equal. By hashing host tuples: torch.unique(dim=0) compares rows one by one (~2 ms
    at [256, 12])."""
    key = torch.where(mask.bool(), ids, torch.full_like(ids, -1))  # padding never equals a token id
    ids_of: dict[tuple, int] = {}
    inv = [ids_of.setdefault(tuple(r), len(ids_of)) for r in key.tolist()]
    first = [0] * len(ids_of)
    for row in range(len(inv) - 1, -1, -1):
        first[inv[row]] = row
    return inv, first


def _prefill_blocks(model, ids, mask, cache: KVCache, head, rows_per_block: int, dp_group) -> torch.Tensor:
    """Prompts [n, P] into cache rows [:n], at most `rows_per_block` rows per forward -> last-position
    (logits [n, Vp/tp], hidden [n, H]). Each block writes its own slice of the cache (views), so the forward's
    transients (the MLP's [rows x P, I/tp] tensors, the attention mask) stay those of one block.
    Every DP rank runs the same number of forwards (FSDP keeps them in step): the count is agreed
    (a max over DP), and a rank with fewer blocks runs one-row fillers into a scratch cache."""
    n, P = ids.shape
    if n <= rows_per_block and dp_group is None:
        part = KVCache([k[:n] for k in cache.k], [v[:n] for v in cache.v])
        return model(ids, attention_mask=mask, kv_cache=part, head=head)
    local = -(-n // rows_per_block)
    # one max over DP: the number of prefill forwards every rank takes
    blocks = int(all_reduce(torch.tensor([float(local)], device=ids.device), "max", dp_group).item())
    per = -(-n // blocks) if n else 1  # as even as the agreed count allows
    out = []
    for s in range(0, n, per):
        part = KVCache([k[s:s + per] for k in cache.k], [v[s:s + per] for v in cache.v])
        out.append(model(ids[s:s + per], attention_mask=mask[s:s + per], kv_cache=part, head=head))
    for _ in range(blocks - len(out)):  # fillers: results dropped
        scratch = KVCache([k[:1].clone() for k in cache.k], [v[:1].clone() for v in cache.v])
        model(ids[:1], attention_mask=mask[:1], kv_cache=scratch, head=head)
    return _cat(out)


def _prefill(model, prompt_ids, prompt_mask, cache: KVCache, head, share: bool, prefill_tokens: int = 0,
             dp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompts [B, P] into `cache` -> last-position (logits [B, Vp/tp], hidden [B, H]). `share`: each distinct
    prompt once ([U, P]), its cache rows and logits then copied to the B rows that hold it.
    `prefill_tokens` > 0: at most that many prompt tokens (rows x P, at least one row) per forward."""
    B, P = prompt_ids.shape
    per = max(1, prefill_tokens // max(P, 1)) if prefill_tokens > 0 else max(B, 1)
    group = dp_group if prefill_tokens > 0 else None  # one forward everywhere: nothing to agree on
    if not share:
        logits = _prefill_blocks(model, prompt_ids, prompt_mask, cache, head, per, group)
        cache.length = P
        return logits
    inv_l, first_l = distinct_prompts(prompt_ids, prompt_mask)
    inv = torch.tensor(inv_l, dtype=torch.long, device=prompt_ids.device)
    first = torch.tensor(first_l, dtype=torch.long, device=prompt_ids.device)
    logits, hidden = _prefill_blocks(model, prompt_ids[first], prompt_mask[first], cache, head, per, group)
    for k in cache.k + cache.v:  # rows [:U] hold the distinct prompts; k[inv] is a copy, read before the write
        k[:, :, :P] = k[inv, :, :P]
    cache.length = P
    return logits[inv], hidden[inv]


def _no_stop_ids(logits: torch.Tensor, stop_ids: set[int], tp_group) -> torch.Tensor:
    """logits [b, Vp/tp] (this rank's vocabulary shard) with the stop ids' columns set to -inf."""
    start, Vl = group_rank(tp_group) * logits.shape[-1], logits.shape[-1]
    local = [i - start for i in sorted(stop_ids) if start <= i < start + Vl]
    if local:
        logits = logits.clone()
        logits[:, local] = float("-inf")
    return logits


def _check_lengths(cfg, P: int, max_new_tokens: int, vocab_limit: int | None) -> int:
    """Refuse a prompt plus response longer than the model's context, or a bad vocab_limit -> the
    number of ids that may be sampled."""
    if P + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt length {P} + max_new_tokens {max_new_tokens} exceeds model.max_seq_len "
                         f"{cfg.max_seq_len}")
    if vocab_limit is not None and vocab_limit < 1:
        raise ValueError(f"generate: vocab_limit must be >= 1, got {vocab_limit}")
    return cfg.vocab_size if vocab_limit is None else min(cfg.vocab_size, vocab_limit)


@torch.no_grad()
def generate(model: Transformer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
             eos_id: int | None, pad_id: int, temperature: float = 1.0, top_k: int = 0, seed: int = 0,
             step: int = 0, row_ids: torch.Tensor | None = None, tp_group=None, dp_group=None,
             eos_ids: Sequence[int] | None = None, stop_sequences: Sequence[Sequence[int]] | None = None,
             stop_check: Callable[[list[int]], bool] | None = None, top_p: float = 1.0, min_p: float = 0.0,
             vocab_limit: int | None = None, compact: bool = True, compile_sampler: bool = False,
             share_prefill: bool = False, prefill_tokens: int = 0, min_new_tokens: int = 0,
             record: bool = False, record_hidden: bool = False) -> GenerationOutput:
    """Sample up to `max_new_tokens` after left-padded prompts.

    prompt_ids, prompt_mask: [B, P], left-padded (mask 1 on real tokens). row_ids [B]: a global id
    per row (e.g. prompt index * group size + sample), keying the noise so results do not depend
    on how rows are spread over DP ranks. eos_id and eos_ids: every id that ends a row.
    vocab_limit: ids >= it (e.g. the tokenizer's vocabulary when the embedding is padded past it)
    are never sampled. `share_prefill`: prefill each distinct prompt once (see the module docstring).
    `prefill_tokens` > 0: the prefill runs in blocks of at most that many prompt tokens (whole rows),
    bounding its activations; 0: all rows in one forward. `min_new_tokens`: no stop id (EOS) is drawn
    before a row has that many tokens (stop sequences and stop_check still apply). `record`: the
    drawn tokens' log-probs (see GenerationOutput); `record_hidden`: their final hidden states too.
    Returns tokens (and what was recorded) on every TP rank (identical).
    """
    t0 = time.perf_counter()
    cfg = model.cfg
    B, P = prompt_ids.shape
    dev = prompt_ids.device
    if row_ids is None:
        row_ids = torch.arange(B, device=dev)
    total = P + max_new_tokens
    vocab = _check_lengths(cfg, P, max_new_tokens, vocab_limit)
    stops = set(eos_ids or []) | ({eos_id} if eos_id is not None else set())
    stopper = _Stopper(stops, stop_sequences, stop_check, dev)
    if min_new_tokens < 0:
        raise ValueError(f"generate: min_new_tokens must be >= 0, got {min_new_tokens}")
    sample_kw = dict(vocab_size=vocab, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                     step=step, tp_group=tp_group, compile=compile_sampler)
    cap = key_capacity(total) if model.batch_invariant else total  # invariant: whole key blocks (parallel/invariant.py)
    cache = KVCache.empty(cfg, B, cap, model.tp, dev, model.activation_dtype)  # bf16 when computing in bf16
    seqs = torch.full((B, total), pad_id, dtype=torch.long, device=dev)
    seqs[:, :P] = prompt_ids
    mask = torch.zeros((B, total), dtype=torch.long, device=dev)
    mask[:, :P] = prompt_mask.long()
    rows = torch.arange(B, device=dev)  # the batch's rows (indices into seqs); shrinks as rows finish
    live = torch.ones(B, dtype=torch.bool, device=dev)  # which of `rows` still generate
    head = _last_position_head(tp_group)
    was_training = model.training
    model.eval()
    rec = _Record(B, max_new_tokens, dev, record, record_hidden, temperature, vocab, tp_group)
    with _keep_unsharded(model):
        logits, hid = _prefill(model, prompt_ids, mask[:, :P], cache, head, share_prefill, prefill_tokens,
                               dp_group)  # (B, Vp/tp), (B, H)
        for t in range(max_new_tokens):
            raw = logits
            if t < min_new_tokens:
                logits = _no_stop_ids(logits, stops, tp_group)
            tok = sample_from_sharded_logits(logits, row_ids=row_ids[rows], position=t, return_logprobs=rec.on,
                                             **sample_kw)
            tok, lp = tok if rec.on else (tok, None)
            at = rows[live]
            rec.add(at, t, live, tok, lp, raw, hid)
            seqs[at, P + t] = tok[live]
            mask[at, P + t] = 1
            fin = stopper(tok[live], seqs[at, P:P + t + 1])
            live[live.clone()] = ~fin
            # all DP ranks must take the same number of forward passes (FSDP collectives)
            active = all_reduce(live.any().to(torch.float32).reshape(1), "max", dp_group)
            if active.item() == 0 or t == max_new_tokens - 1:
                break
            n_live = int(live.sum())
            if compact and n_live <= COMPACT_BELOW * len(rows):
                keep = live.nonzero()[:, 0] if n_live > 0 else live.new_zeros(1, dtype=torch.long)
                cache.keep_rows(keep)
                rows, live = rows[keep], live[keep]
            logits, hid = model(seqs[rows, P + t:P + t + 1], attention_mask=mask[rows, :P + t + 1], kv_cache=cache,
                                head=head)
    model.train(was_training)
    response_mask = mask[:, P:].clone()
    return GenerationOutput(seqs, mask, response_mask, P, int(response_mask.sum()), time.perf_counter() - t0,
                            rec.logprobs, rec.tempered, rec.hidden)


class _Record:
    """What `generate(record=..., record_hidden=...)` keeps per response token, at the rows' places."""

    def __init__(self, B: int, N: int, device, on: bool, hidden: bool, temperature: float, vocab: int, tp_group):
        self.on, self.keep_hidden = on or hidden, hidden
        self.kw = dict(vocab_size=vocab, temperature=temperature, tp_group=tp_group)
        z = (lambda: torch.zeros(B, N, dtype=torch.float32, device=device)) if self.on else (lambda: None)
        self.logprobs, self.tempered, self.hidden = z(), z(), None
        self.B, self.N = B, N

    def add(self, at, t: int, live, tok, lp, raw, hid) -> None:
        """Token t of the live rows `at` (seqs rows): tok, lp [b] of the batch rows; raw logits and hid of them."""
        if not self.on:
            return
        self.logprobs[at, t] = lp[live]
        self.tempered[at, t] = tempered_logprob(raw, tok, **self.kw)[live]
        if self.keep_hidden:
            if self.hidden is None:
                self.hidden = hid.new_zeros(self.B, self.N, hid.shape[-1])
            self.hidden[at, t] = hid[live]


# the pieces core/generation/multiturn.py resumes a batch with (prefill, the stop test, the sampled
# positions' head, FSDP's gathered parameters for a decode loop), under public names
keep_unsharded, last_position_head, prefill, Stopper = _keep_unsharded, _last_position_head, _prefill, _Stopper
