"""Rollouts: this DP rank's share of a step's prompts, G sampled responses each, and their scores.

Prompts are drawn from a generator keyed by (seed, step) -- the same global list on every rank,
each DP rank taking a contiguous slice -- and sampling noise is keyed by each row's global id, so
the rollout of a step does not depend on the DP layout. Rows are prompt-major: sample j of
global prompt i is row i*G + j, as `grpo_advantages` expects.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from core.generate import generate
from parallel import comm
from parallel.dims import derive_seed
from rl.config import RolloutConfig
from rl.rewards import score_responses


@dataclass
class Rollout:
    sequences: torch.Tensor  # [B, P + N] left-padded prompts, then responses
    attention_mask: torch.Tensor  # [B, P + N]
    response_mask: torch.Tensor  # [B, N] bool, response tokens incl. EOS
    prompt_len: int  # P
    scores: torch.Tensor  # [B] fp32 reward per response (before normalisation)
    row_ids: torch.Tensor  # [B] global row ids
    metas: list  # one per local prompt
    responses: list  # B decoded strings

    @property
    def responses_ids(self) -> torch.Tensor:
        """[B, N] the sampled response tokens (targets of the response positions)."""
        return self.sequences[:, self.prompt_len:]


def raise_everywhere(error: str | None, group=None) -> None:
    """Raise on every rank of `group` if any rank has an error, so none is left in a collective."""
    flag = torch.tensor([0.0 if error is None else 1.0], device="cpu")
    comm.all_reduce(flag, "max", group)  # did any rank fail?
    if flag.item() > 0:
        gather = group is not None and torch.distributed.is_initialized()
        if error is None and gather:
            errs = [None] * torch.distributed.get_world_size(group)
            # only on failure: the culprits' messages, so every rank (every node's log) names them
            torch.distributed.all_gather_object(errs, None, group=group)
            error = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errs) if e is not None)
        elif gather:
            torch.distributed.all_gather_object([None] * torch.distributed.get_world_size(group), error, group=group)
        raise ValueError(error or "another rank failed (see its error above)")


def step_prompts(task, n_global: int, seed: int, step: int, dp_rank: int, dp_size: int):
    """(global index of the first local prompt, [(prompt_text, meta)]) for this rank."""
    if n_global % dp_size:
        raise ValueError(f"rollout.prompts_per_step={n_global} must be a multiple of dp={dp_size}")
    rng = random.Random(derive_seed(seed, step))
    prompts = task.sample_prompts(n_global, rng)
    per = n_global // dp_size
    return dp_rank * per, prompts[dp_rank * per:(dp_rank + 1) * per]


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ids [B, P] and mask [B, P], right-aligned (left padding)."""
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), P), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, P - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, P - len(r):] = 1
    return ids, mask


def decode_responses(tokenizer, gen_tokens: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    out = []
    for toks, m in zip(gen_tokens.tolist(), response_mask.tolist()):
        ids = [t for t, keep in zip(toks, m) if keep and t != tokenizer.eos_id]
        out.append(tokenizer.decode(ids))
    return out


@torch.no_grad()
def collect_rollout(policy, tokenizer, task, reward_fn, cfg: RolloutConfig, *, seed: int, step: int,
                    dp_rank: int = 0, dp_size: int = 1, tp_group=None, dp_group=None, device="cpu",
                    world_group=None) -> Rollout:
    """Sample G responses for each of this rank's prompts and score them."""
    G = cfg.group_size
    first, prompts = step_prompts(task, cfg.prompts_per_step, seed, step, dp_rank, dp_size)
    metas = [m for _, m in prompts]
    rows = [[tokenizer.bos_id] + tokenizer.encode(p) for p, _ in prompts for _ in range(G)]
    ids, mask = left_pad(rows, tokenizer.pad_id)
    row_ids = torch.tensor([(first + i) * G + j for i in range(len(prompts)) for j in range(G)])
    gen = generate(policy, ids.to(device), mask.to(device), max_new_tokens=cfg.max_new_tokens,
                   eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, temperature=cfg.temperature,
                   top_k=cfg.top_k, seed=seed, step=step, row_ids=row_ids.to(device), tp_group=tp_group,
                   dp_group=dp_group)
    responses = decode_responses(tokenizer, gen.sequences[:, gen.prompt_len:].cpu(), gen.response_mask.cpu())
    error, scores = None, None
    try:
        scores = score_responses(reward_fn, metas, responses, G)
    except ValueError as e:  # name the global prompt, not the local index
        error = f"{e} [this rank's prompts start at global prompt {first}; step {step}; prompts: " \
                f"{[m['prompt'] for m in metas][:4]}...]"
    raise_everywhere(error, world_group)
    return Rollout(gen.sequences, gen.attention_mask, gen.response_mask.bool(), gen.prompt_len,
                   scores.to(device), row_ids.to(device), metas, responses)
