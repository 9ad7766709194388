"""Resumable generation for multi-turn episodes, token in / token out.

`Conversation` holds a batch's KV cache between turns. `start` prefills the prompts (as `generate`
does); `decode` samples a turn for the live rows and leaves the cache where it stopped; `append`
runs one forward over tokens appended to chosen rows (an environment's observation, rendered with
turn markers) and so continues from the cache: what came before is never re-tokenised nor
re-run. `finish` lays each row out as [left-padded prompt | its response region], the region holding
exactly the ids sampled and the ids appended, in order.

The cache is column-shared: each decode step takes one column for every row, an append takes as
many columns as its longest block (shorter blocks are left-padded with masked columns). A row's
columns therefore hold holes (masked columns) while other rows decode or append more; positions
come from the attention mask's cumulative sum (core/model.py), so every real token has the position
and sees the keys it has in the row's hole-free layout of `finish`: the trainer's forward over that
layout scores the distribution the sampler drew from.

The noise of a sampled token is keyed by (seed, step, row id, position in the row's response
region), so a row draws the same tokens whatever the batch beside it; every DP rank takes the same
number of forwards (FSDP collectives): decode steps agreed by an all-reduce per step, one append
forward per turn on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.generation.generate import Stopper as _Stopper
from core.generation.generate import keep_unsharded as _keep_unsharded
from core.generation.generate import last_position_head as _last_position_head
from core.generation.generate import prefill as _prefill
from core.generation.sampling import sample_from_sharded_logits, tempered_logprob
from core.model import KVCache
from parallel.comm import all_reduce
from parallel.invariant import key_capacity

MODEL, APPENDED = 1, 2  # `kind` of a column: sampled by the model, appended (observation, turn markers)


@dataclass
class Conversation:
    cache: KVCache
    seqs: torch.Tensor  # [B, C] ids per column (pad where masked)
    mask: torch.Tensor  # [B, C] long, 1 on real tokens
    kind: torch.Tensor  # [B, C] int8: MODEL, APPENDED, 0 (prompt or hole)
    logp: torch.Tensor  # [B, C] float32 log mu of sampled tokens (0 elsewhere)
    tlogp: torch.Tensor  # [B, C] float32 log pi_T of sampled tokens
    logits: torch.Tensor  # [B, Vp/tp] float32, the next-token logits of each row's last real token
    n_resp: torch.Tensor  # [B] long, tokens in each row's response region so far
    col: int  # next free column
    P: int
    pad_id: int


def start(model, prompt_ids, prompt_mask, *, columns: int, pad_id: int, tp_group=None, dp_group=None,
          share_prefill: bool = False, prefill_tokens: int = 0) -> Conversation:
    """Prefill the left-padded prompts [B, P]; the cache holds P + `columns` columns."""
    B, P = prompt_ids.shape
    dev = prompt_ids.device
    total = P + columns
    cap = key_capacity(total) if model.batch_invariant else total
    cache = KVCache.empty(model.cfg, B, cap, model.tp, dev, model.activation_dtype)
    seqs = torch.full((B, total), pad_id, dtype=torch.long, device=dev)
    seqs[:, :P] = prompt_ids
    mask = torch.zeros((B, total), dtype=torch.long, device=dev)
    mask[:, :P] = prompt_mask.long()
    with _keep_unsharded(model), torch.no_grad():
        was = model.training
        model.eval()
        logits, _ = _prefill(model, prompt_ids, mask[:, :P], cache, _last_position_head(tp_group), share_prefill,
                             prefill_tokens, dp_group)
        model.train(was)
    z = torch.zeros((B, total), dtype=torch.float32, device=dev)
    return Conversation(cache, seqs, mask, torch.zeros((B, total), dtype=torch.int8, device=dev), z, z.clone(),
                        logits, torch.zeros(B, dtype=torch.long, device=dev), 0, P, pad_id)


def _forward(model, conv: Conversation, block: torch.Tensor, bmask: torch.Tensor, tp_group):
    """Run block [B, S] (mask [B, S]) at the next columns -> last-column logits [B, Vp/tp]."""
    c0, S = conv.P + conv.col, block.shape[1]
    if c0 + S > conv.seqs.shape[1]:
        raise ValueError(f"multi-turn rollout: {conv.col + S} columns needed, {conv.seqs.shape[1] - conv.P} "
                         "reserved (rollout.max_turns x (max_new_tokens + max_obs_tokens))")
    conv.seqs[:, c0:c0 + S] = torch.where(bmask.bool(), block, torch.full_like(block, conv.pad_id))
    conv.mask[:, c0:c0 + S] = bmask
    logits, _ = model(conv.seqs[:, c0:c0 + S], attention_mask=conv.mask[:, :c0 + S], kv_cache=conv.cache,
                      head=_last_position_head(tp_group))
    conv.col += S
    return logits


def _stops(stopper: _Stopper, tok: torch.Tensor, outs: list[list[int]]) -> torch.Tensor:
    """`_Stopper` over rows of different lengths: EOS ids, stop sequences, stop_check."""
    fin = torch.isin(tok, stopper.eos) if stopper.eos.numel() else torch.zeros_like(tok, dtype=torch.bool)
    if not stopper.host:
        return fin
    flags = [f or any(r[-len(s):] == s for s in stopper.seqs if len(s) <= len(r)) or
             bool(stopper.check is not None and stopper.check(r)) for f, r in zip(fin.tolist(), outs)]
    return torch.tensor(flags, dtype=torch.bool, device=tok.device)


@torch.no_grad()
def decode(model, conv: Conversation, active: torch.Tensor, *, max_new_tokens: int, budget: torch.Tensor,
           stopper: _Stopper, sample_kw: dict, row_ids: torch.Tensor, tp_group=None, dp_group=None) -> list[list[int]]:
    """Sample one turn for the rows `active` [B] bool, each until a stop (kept), max_new_tokens or
    its `budget` [B] (response-region tokens) is spent -> each row's sampled ids ([] if inactive)."""
    B = active.shape[0]
    live = active.clone() & (conv.n_resp < budget)
    out: list[list[int]] = [[] for _ in range(B)]
    was = model.training
    model.eval()
    with _keep_unsharded(model):
        for _ in range(max_new_tokens):
            if not bool(all_reduce(live.any().to(torch.float32).reshape(1), "max", dp_group).item()):
                break
            tok, lp = sample_from_sharded_logits(conv.logits, row_ids=row_ids, position=conv.n_resp,
                                                 return_logprobs=True, **sample_kw)
            c = conv.P + conv.col
            at = live.nonzero()[:, 0]
            conv.kind[at, c] = MODEL
            conv.logp[at, c] = lp[at].float()
            conv.tlogp[at, c] = tempered_logprob(conv.logits, tok, vocab_size=sample_kw["vocab_size"],
                                                 temperature=sample_kw["temperature"] or 1.0,
                                                 tp_group=tp_group)[at]
            for r in at.tolist():
                out[r].append(int(tok[r]))
            conv.n_resp += live.long()
            fin = _stops(stopper, tok[at], [out[r] for r in at.tolist()]) if at.numel() else None
            new_logits = _forward(model, conv, tok[:, None], live.long()[:, None], tp_group)
            conv.logits = torch.where(live[:, None], new_logits, conv.logits)
            if fin is not None:
                live[at] = ~fin
            live &= conv.n_resp < budget
    model.train(was)
    return out


@torch.no_grad()
def append(model, conv: Conversation, blocks: list[list[int]], tp_group=None) -> None:
    """Append blocks[r] (ids, possibly []) to row r with one forward over every row (every DP rank
    calls this once per turn, appending or not). Blocks are right-aligned, so each row's last column
    is its last real token and the logits taken there continue it."""
    B, dev = len(blocks), conv.seqs.device
    S = max([len(b) for b in blocks] + [1])
    ids = torch.full((B, S), conv.pad_id, dtype=torch.long, device=dev)
    m = torch.zeros((B, S), dtype=torch.long, device=dev)
    for r, b in enumerate(blocks):
        if b:
            ids[r, S - len(b):] = torch.tensor(b, dtype=torch.long, device=dev)
            m[r, S - len(b):] = 1
    c = conv.P + conv.col
    conv.kind[:, c:c + S] = torch.where(m.bool(), torch.full_like(m, APPENDED), torch.zeros_like(m)).to(torch.int8)
    was = model.training
    model.eval()
    with _keep_unsharded(model):
        new_logits = _forward(model, conv, ids, m, tp_group)
    model.train(was)
    got = m[:, -1].bool()
    conv.logits = torch.where(got[:, None], new_logits, conv.logits)
    conv.n_resp += m.sum(1)


def finish(conv: Conversation) -> dict:
    """Each row as [prompt (left-padded, P) | its response region's real tokens, right-padded to N]:
    sequences, attention_mask [B, P + N]; response_mask [B, N] (1 on sampled tokens only: appended
    tokens condition the model but are never trained on); logprobs / tempered_logprobs [B, N]."""
    P, B = conv.P, conv.seqs.shape[0]
    real = conv.mask[:, P:].bool()
    N = max(int(real.sum(1).max()) if B else 0, 1)
    dev = conv.seqs.device
    seqs = torch.full((B, P + N), conv.pad_id, dtype=torch.long, device=dev)
    am = torch.zeros((B, P + N), dtype=torch.long, device=dev)
    seqs[:, :P], am[:, :P] = conv.seqs[:, :P], conv.mask[:, :P]
    rm = torch.zeros((B, N), dtype=torch.bool, device=dev)
    lp, tlp = (torch.zeros((B, N), dtype=torch.float32, device=dev) for _ in range(2))
    # each row's real columns in order -> its response slots 0..n-1 (a stable sort puts real columns first)
    order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices[:, :N]
    keep = torch.gather(real, 1, order)
    take = lambda t: torch.gather(t[:, P:], 1, order)  # noqa: E731
    seqs[:, P:] = torch.where(keep, take(conv.seqs), seqs[:, P:])
    am[:, P:] = keep.long()
    rm[:] = keep & (take(conv.kind) == MODEL)
    lp[:] = torch.where(rm, take(conv.logp), lp)
    tlp[:] = torch.where(rm, take(conv.tlogp), tlp)
    return dict(sequences=seqs, attention_mask=am, response_mask=rm, prompt_len=P, logprobs=lp,
                tempered_logprobs=tlp)
