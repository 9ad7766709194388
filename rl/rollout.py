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

    def select(self, rows: torch.Tensor) -> Rollout:
        """The rollout of the local rows `rows` ([k] indices, in that order): every per-row field
        indexed, `prompt_len` and the per-prompt `metas` kept whole, `responses` ([] stays [])."""
        idx = rows.tolist()
        return Rollout(self.sequences[rows], self.attention_mask[rows], self.response_mask[rows], self.prompt_len,
                       self.scores[rows], self.row_ids[rows], self.metas,
                       [self.responses[i] for i in idx] if self.responses else [])


def raise_everywhere(error: str | None, group=None) -> None:
    """Raise on every rank of `group` if any rank has an error, so none is left in a collective."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=comm.collective_device(group))
    comm.all_reduce(flag, "max", group)  # did any rank fail?
    if flag.item() > 0:
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
    ids = torch.full((len(rows), P), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(rows), P), dtype=torch.long, device="cpu")
    for i, r in enumerate(rows):
        ids[i, P - len(r):] = torch.tensor(r, dtype=torch.long, device="cpu")
        mask[i, P - len(r):] = 1
    return ids, mask


def eos_ids_of(tokenizer) -> list[int]:
    """Every id that ends a response: the tokenizer's `eos_ids` where it has them, else its eos_id."""
    ids = list(getattr(tokenizer, "eos_ids", None) or [])
    return ids or [tokenizer.eos_id]


def stop_string_check(tokenizer, stop_strings):
    """A `generate` stop_check: does the decoded response contain any of `stop_strings`? None if none."""
    stops = [s for s in (stop_strings or []) if s]
    if not stops:
        return None
    return lambda ids: any(s in tokenizer.decode(ids) for s in stops)


def decode_responses(tokenizer, gen_tokens: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    eos = set(eos_ids_of(tokenizer))
    out = []
    for toks, m in zip(gen_tokens.tolist(), response_mask.tolist()):
        # ids past the tokenizer (a model vocabulary padded beyond it, as Qwen2.5's) have no text
        ids = [t for t, keep in zip(toks, m) if keep and t not in eos and t < tokenizer.vocab_size]
        out.append(tokenizer.decode(ids))
    return out


@torch.no_grad()
def collect_rollout(policy, tokenizer, task, reward_fn, cfg: RolloutConfig, *, seed: int, step: int,
                    dp_rank: int = 0, dp_size: int = 1, tp_group=None, dp_group=None, device="cpu",
                    world_group=None, stats: dict | None = None) -> Rollout:
    """Sample G responses for each of this rank's prompts and score them.

    Sampling reads cfg.temperature, top_k and, where the config has them, top_p, min_p and
    stop (a list of stop strings). Ids >= the tokenizer's vocab_size are never sampled (checkpoints
    whose embedding is padded past the tokenizer). `stats`, when given, receives this rank's
    rollout_tokens (response tokens generated), rollout_s (generation wall time) and
    rollout_tokens_per_s."""
    G = cfg.group_size
    first, prompts = step_prompts(task, cfg.prompts_per_step, seed, step, dp_rank, dp_size)
    metas = [m for _, m in prompts]
    rows = [[tokenizer.bos_id] + tokenizer.encode(p) for p, _ in prompts for _ in range(G)]
    ids, mask = left_pad(rows, tokenizer.pad_id)
    row_ids = torch.tensor([(first + i) * G + j for i in range(len(prompts)) for j in range(G)], device="cpu")
    gen = generate(policy, ids.to(device), mask.to(device), max_new_tokens=cfg.max_new_tokens,
                   eos_id=tokenizer.eos_id, eos_ids=eos_ids_of(tokenizer), pad_id=tokenizer.pad_id,
                   temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                   min_p=cfg.min_p,
                   stop_check=stop_string_check(tokenizer, cfg.stop),
                   vocab_limit=getattr(tokenizer, "vocab_size", None), seed=seed, step=step,
                   row_ids=row_ids.to(device), tp_group=tp_group, dp_group=dp_group)
    if stats is not None:
        stats.update(rollout_tokens=gen.n_tokens, rollout_s=gen.seconds, rollout_tokens_per_s=gen.tokens_per_s)
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
