"""Sampling with a KV cache under tensor parallelism, without gathering logits.

Gumbel-max: token = argmax_v (z_v / T + g_v). The noise g_v is a pure function of
(seed, step, row id, position, global vocabulary index) -- a counter-based hash, not a stateful
generator -- so every TP layout, DP layout and batch order draws the same token for the same row.
Each rank takes the argmax over its vocabulary shard; one all-gather of (value, index) pairs, B*2
numbers per rank, picks the winner. Top-k: each rank's local top-k values are gathered (k*tp
numbers per row) to find the global k-th value, below which logits are excluded.

DP ranks run the same number of decode steps (an all-reduce of "anyone still generating" per
step), because under FSDP each forward is a collective over the DP group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from core.model import KVCache, Transformer
from parallel.comm import all_gather_along, all_reduce, group_rank, group_size

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 tensors holding values < 2**32.
    Products may wrap in int64; only their low 32 bits are kept, which wrapping preserves."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def gumbel_noise(seed: int, step: int, row_ids: torch.Tensor, position: int, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, Vl] for rows `row_ids` [B] at one `position`, for global vocabulary
    ids `vocab_ids` [Vl]; identical whichever rank or layout evaluates it."""
    h = _mix32(torch.tensor(seed, dtype=torch.int64, device=row_ids.device) ^ 0x9E3779B9)
    h = _mix32(h ^ step)
    h = _mix32(h.view(1) ^ row_ids.to(torch.int64))  # (B,)
    h = _mix32(h ^ position)
    h = _mix32(h[:, None] ^ vocab_ids.to(torch.int64)[None, :])  # (B, Vl)
    h2 = _mix32(h ^ 0x85EBCA6B)
    u = ((h >> 8).double() * 2.0**-24 + (h2 >> 8).double() * 2.0**-48 + 2.0**-50).clamp(max=1 - 2.0**-50)
    return -torch.log(-torch.log(u))


def sample_from_sharded_logits(logits_local: torch.Tensor, *, vocab_size: int, temperature: float, top_k: int,
                               seed: int, step: int, row_ids: torch.Tensor, position: int,
                               tp_group=None) -> torch.Tensor:
    """logits_local [B, Vp/tp] sharded on the vocabulary over tp_group -> sampled global ids [B].
    temperature 0 means greedy. Padded columns (global id >= vocab_size) are never drawn."""
    B, Vl = logits_local.shape
    start = group_rank(tp_group) * Vl
    vocab_ids = torch.arange(start, start + Vl, device=logits_local.device)
    z = logits_local.double()
    z = z.masked_fill(vocab_ids[None, :] >= vocab_size, float("-inf"))
    if temperature > 0:
        z = z / temperature
    if top_k and top_k > 0:
        k = min(top_k, Vl)
        local_top = z.topk(k, dim=-1).values  # (B, k)
        # every rank's k best candidates: the global k-th value is among these tp*k numbers
        cands = all_gather_along(local_top, -1, tp_group)
        kth = cands.topk(min(top_k, cands.shape[-1]), dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    score = z if temperature <= 0 else z + gumbel_noise(seed, step, row_ids, position, vocab_ids)
    best, idx = score.max(dim=-1)
    pair = torch.stack([best, (idx + start).double()], dim=-1)  # (B, 2)
    if group_size(tp_group) > 1:
        # each rank's best (score, global id); the winner is the largest score, lowest id on ties
        pairs = all_gather_along(pair.unsqueeze(1), 1, tp_group)  # (B, tp, 2)
        top = pairs[..., 0].max(dim=1, keepdim=True).values
        ids = pairs[..., 1].masked_fill(pairs[..., 0] != top, float("inf"))
        return ids.min(dim=1).values.long()
    return pair[:, 1].long()


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [B, P + N] left-padded prompt then response (pad after EOS)
    attention_mask: torch.Tensor  # [B, P + N] 1 on real tokens (prompt and response incl. EOS)
    response_mask: torch.Tensor  # [B, N] 1 on response tokens up to and including EOS
    prompt_len: int  # P


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


@torch.no_grad()
def generate(model: Transformer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
             eos_id: int | None, pad_id: int, temperature: float = 1.0, top_k: int = 0, seed: int = 0,
             step: int = 0, row_ids: torch.Tensor | None = None, tp_group=None, dp_group=None) -> GenerationOutput:
    """Sample up to `max_new_tokens` after left-padded prompts.

    prompt_ids, prompt_mask: [B, P], left-padded (mask 1 on real tokens). row_ids [B]: a global id
    per row (e.g. prompt index * group size + sample), keying the noise so results do not depend
    on how rows are spread over DP ranks. Returns tokens on every TP rank (identical).
    """
    cfg = model.cfg
    B, P = prompt_ids.shape
    dev = prompt_ids.device
    if row_ids is None:
        row_ids = torch.arange(B, device=dev)
    total = P + max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(f"prompt length {P} + max_new_tokens {max_new_tokens} exceeds model.max_seq_len "
                         f"{cfg.max_seq_len}")
    dtype = model.activation_dtype  # bf16 when the model computes in bf16
    cache = KVCache.empty(cfg, B, total, model.tp, dev, dtype)
    seqs = torch.full((B, total), pad_id, dtype=torch.long, device=dev)
    seqs[:, :P] = prompt_ids
    mask = torch.zeros((B, total), dtype=torch.long, device=dev)
    mask[:, :P] = prompt_mask.long()
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    was_training = model.training
    model.eval()
    with _keep_unsharded(model):
        logits = model(prompt_ids, attention_mask=mask[:, :P], kv_cache=cache)[:, -1]  # (B, Vp/tp)
        for t in range(max_new_tokens):
            tok = sample_from_sharded_logits(
                logits.float(), vocab_size=cfg.vocab_size, temperature=temperature, top_k=top_k, seed=seed,
                step=step, row_ids=row_ids, position=t, tp_group=tp_group)
            tok = torch.where(done, torch.full_like(tok, pad_id), tok)
            seqs[:, P + t] = tok
            mask[:, P + t] = (~done).long()
            if eos_id is not None:
                done = done | (tok == eos_id)
            # all DP ranks must take the same number of forward passes (FSDP collectives)
            active = all_reduce((~done).any().to(torch.float32).reshape(1), "max", dp_group)
            if active.item() == 0 or t == max_new_tokens - 1:
                break
            logits = model(seqs[:, P + t:P + t + 1], attention_mask=mask[:, :P + t + 1], kv_cache=cache)[:, -1]
    model.train(was_training)
    return GenerationOutput(seqs, mask, mask[:, P:].clone(), P)
