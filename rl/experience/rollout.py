"""Rollouts: this DP rank's share of a step's prompts, G sampled responses each, and their scores.

A prompt source gives each DP rank its contiguous slice of the step's global prompt list, the same
list for every layout: `TaskPrompts` draws a built-in task's prompts from a generator keyed by
(seed, step); `DataPrompts` takes a data set's prompts in `rl.experience.prompts.PromptSampler`'s order (their
ids already carry bos where the tokenizer wants one). Sampling noise is keyed by each row's global
id, so the rollout of a step does not depend on the DP layout. Rows are prompt-major: sample j of
global prompt i is row i*G + j, as `grpo_advantages` expects. `evaluate` scores a held-out set
greedily (pass@1) and, with `rollout.eval_k`, by the mean reward of k samples (mean@k).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from core.generation.generate import generate
from parallel import comm
from parallel.dims import derive_seed
from rl.config import RolloutConfig
from rl.experience.prompts import PromptSampler, PromptSet, eval_rank_indices
from rl.experience.rewards import score_responses


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
    # what the sampler recorded (core/generation/generate.py), [B, N] float32, 0 off the response mask:
    # log pi_T(token), the tempered full-vocabulary log-prob (what the trainer's old log-probs estimate),
    # and log mu(token), the distribution actually drawn from (top-k / top-p / min-p truncated, renormalised)
    rollout_logprobs: torch.Tensor | None = None
    rollout_sampled_logprobs: torch.Tensor | None = None
    rollout_hidden: torch.Tensor | None = None  # [B, N, H] final hidden states (`rollout.record_hidden`)
    # [B] int64: the weights version (updates behind it) that sampled each row, set where the rollout ranks
    # generate (rl/pipeline); None: this step's own weights (the colocated rollout)
    policy_version: torch.Tensor | None = None

    @property
    def responses_ids(self) -> torch.Tensor:
        """[B, N] the sampled response tokens (targets of the response positions)."""
        return self.sequences[:, self.prompt_len:]

    def select(self, rows: torch.Tensor) -> Rollout:
        """The rollout of the local rows `rows` ([k] indices, in that order): every per-row field
        indexed, `prompt_len` and the per-prompt `metas` kept whole, `responses` ([] stays [])."""
        idx = rows.tolist()
        pick = lambda t: None if t is None else t[rows]
        return Rollout(self.sequences[rows], self.attention_mask[rows], self.response_mask[rows], self.prompt_len,
                       self.scores[rows], self.row_ids[rows], self.metas,
                       [self.responses[i] for i in idx] if self.responses else [], pick(self.rollout_logprobs),
                       pick(self.rollout_sampled_logprobs), pick(self.rollout_hidden), pick(self.policy_version))


def raise_everywhere(error: str | None, group=None) -> None:
    """Raise on every rank of `group` if any rank has an error, so none is left in a collective."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=comm.collective_device(group))
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


class TaskPrompts:
    """A built-in task's prompts (`step_prompts`), encoded with bos when the tokenizer has one. A
    generated task repeats its prompts (the arithmetic task has 100 at max_operand 9), so each text's ids
    are kept (up to `CACHE` texts, then the cache starts over): a step encodes only the texts it has
    not seen."""

    CACHE = 1 << 16

    def __init__(self, task, tokenizer):
        self.task, self.tok = task, tokenizer
        self._ids: dict[str, tuple[int, ...]] = {}

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Ids of `texts` with bos prepended when the tokenizer has one (one batched call where it can)."""
        new = list(dict.fromkeys(t for t in texts if t not in self._ids))
        if new:
            if len(self._ids) + len(new) > self.CACHE:
                self._ids.clear()
                new = list(dict.fromkeys(texts))
            bos = [] if self.tok.bos_id is None else [self.tok.bos_id]
            batch = getattr(self.tok, "encode_batch", None)
            got = batch(new) if batch else [self.tok.encode(t) for t in new]
            self._ids.update((t, tuple(bos + list(ids))) for t, ids in zip(new, got))
        return [list(self._ids[t]) for t in texts]

    def rank_prompts(self, n_global: int, seed: int, step: int, dp_rank: int, dp_size: int):
        """(global index of the first local prompt, [prompt ids], [meta]) for this rank."""
        first, prompts = step_prompts(self.task, n_global, seed, step, dp_rank, dp_size)
        ids = self._encode([p for p, _ in prompts])
        return first, ids, [m for _, m in prompts]

    def eval_prompts(self, n: int, seed: int) -> list[tuple[list[int], dict]]:
        """`n` fixed prompts (a generator no training step uses) as [(ids, meta)]."""
        prompts = self.task.sample_prompts(n, random.Random(f"eval-{seed}"))
        ids = self._encode([p for p, _ in prompts])
        return [(i, m) for i, (_, m) in zip(ids, prompts)]


class DataPrompts:
    """A data set's prompts (rl.experience.prompts) in `sampler`'s global order."""

    def __init__(self, prompts: PromptSet, sampler: PromptSampler):
        self.prompts, self.sampler = prompts, sampler

    def rank_prompts(self, n_global: int, seed: int, step: int, dp_rank: int, dp_size: int):
        if n_global != self.sampler.B:
            raise ValueError(f"rollout.prompts_per_step={n_global} but the prompt sampler draws {self.sampler.B}")
        idx = self.sampler.rank_indices(step, dp_rank, dp_size)
        chosen = [self.prompts.prompts[i] for i in idx]
        return dp_rank * len(idx), [p.ids for p in chosen], [p.meta for p in chosen]


def pad_id_of(tokenizer) -> int:
    """The id that fills left padding: the tokenizer's pad id, else its first EOS id (masked out anyway)."""
    return tokenizer.pad_id if tokenizer.pad_id is not None else eos_ids_of(tokenizer)[0]


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ids [B, P] and mask [B, P], right-aligned (left padding). Built as Python lists
    and converted once (one tensor op instead of three per row)."""
    P = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (P - len(r)) + list(r) for r in rows], dtype=torch.long, device="cpu")
    lens = torch.tensor([len(r) for r in rows], dtype=torch.long, device="cpu")
    mask = (torch.arange(P, device="cpu") >= (P - lens)[:, None]).long()
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
    eos, V = set(eos_ids_of(tokenizer)), tokenizer.vocab_size
    # ids past the tokenizer (a model vocabulary padded beyond it, as Qwen2.5's) have no text
    ids = [[t for t, keep in zip(toks, m) if keep and t not in eos and t < V]
           for toks, m in zip(gen_tokens.tolist(), response_mask.tolist())]
    if hasattr(type(tokenizer), "decode_batch"):  # core.tokenizer.Tokenizer: one backend call
        return tokenizer.decode_batch(ids)
    return [tokenizer.decode(x) for x in ids]  # a duck-typed tokenizer with `decode` only


def _generate(policy, tokenizer, prompt_ids: list[list[int]], G: int, cfg: RolloutConfig, *, greedy: bool,
              seed: int, step: int, row_ids: torch.Tensor, tp_group, dp_group, device, record: bool = False):
    """G responses for each prompt of `prompt_ids` (rows prompt-major) -> (GenerationOutput, decoded)."""
    pad = pad_id_of(tokenizer)
    ids, mask = left_pad([r for r in prompt_ids for _ in range(G)], pad)
    sample = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0) if greedy else dict(
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
    gen = generate(policy, ids.to(device), mask.to(device), max_new_tokens=cfg.max_new_tokens,
                   eos_id=tokenizer.eos_id, eos_ids=eos_ids_of(tokenizer), pad_id=pad,
                   stop_check=stop_string_check(tokenizer, cfg.stop),
                   vocab_limit=getattr(tokenizer, "vocab_size", None), seed=seed, step=step,
                   row_ids=row_ids.to(device), tp_group=tp_group, dp_group=dp_group,
                   share_prefill=cfg.share_prefill and G > 1, prefill_tokens=cfg.prefill_tokens,
                   min_new_tokens=cfg.min_new_tokens, record=record, record_hidden=record and cfg.record_hidden,
                   **sample)
    return gen, decode_responses(tokenizer, gen.sequences[:, gen.prompt_len:].cpu(), gen.response_mask.cpu())


def _score(reward_fn, metas, responses, G, where: str, world_group):
    """`score_responses`, its error (naming `where`) raised on every rank."""
    error, scores = None, None
    try:
        scores = score_responses(reward_fn, metas, responses, G)
    except Exception as e:  # noqa: BLE001 - any reward failure is raised on every rank, never a silent 0
        error = f"{type(e).__name__}: {e} [{where}; prompts: {[m.get('prompt') for m in metas][:4]}...]"
    raise_everywhere(error, world_group)
    return scores


@torch.no_grad()
def collect_rollout(policy, tokenizer, task, reward_fn, cfg: RolloutConfig, *, seed: int, step: int,
                    dp_rank: int = 0, dp_size: int = 1, tp_group=None, dp_group=None, device="cpu",
                    world_group=None, stats: dict | None = None) -> Rollout:
    """Sample G responses for each of this rank's prompts and score them.

    `task`: a prompt source (`TaskPrompts`, `DataPrompts`: anything with `rank_prompts`) or a
    built-in task (wrapped in `TaskPrompts`). Sampling reads cfg.temperature, top_k, top_p, min_p
    and stop (stop strings, beside the tokenizer's EOS ids). Ids >= the tokenizer's vocab_size are
    never sampled (checkpoints whose embedding is padded past the tokenizer). `stats`, when given,
    receives this rank's rollout_tokens (response tokens generated), rollout_s (generation wall
    time) and rollout_tokens_per_s."""
    G = cfg.group_size
    source = task if hasattr(task, "rank_prompts") else TaskPrompts(task, tokenizer)
    first, prompt_ids, metas = source.rank_prompts(cfg.prompts_per_step, seed, step, dp_rank, dp_size)
    row_ids = torch.tensor([(first + i) * G + j for i in range(len(metas)) for j in range(G)], device="cpu")
    gen, responses = _generate(policy, tokenizer, prompt_ids, G, cfg, greedy=False, seed=seed, step=step,
                               row_ids=row_ids, tp_group=tp_group, dp_group=dp_group, device=device, record=True)
    if stats is not None:
        stats.update(rollout_tokens=gen.n_tokens, rollout_s=gen.seconds, rollout_tokens_per_s=gen.tokens_per_s)
    where = f"this rank's prompts start at global prompt {first}; step {step}"
    scores = _score(reward_fn, metas, responses, G, where, world_group)
    return Rollout(gen.sequences, gen.attention_mask, gen.response_mask.bool(), gen.prompt_len,
                   scores.to(device), row_ids.to(device), metas, responses, gen.tempered_logprobs, gen.logprobs,
                   gen.hidden)


@torch.no_grad()
def evaluate(policy, tokenizer, prompts: list[tuple[list[int], dict]], reward_fn, cfg: RolloutConfig, *,
             seed: int, step: int, dp_rank: int = 0, dp_size: int = 1, tp_group=None, dp_group=None,
             device="cpu", world_group=None) -> dict:
    """Score the held-out `prompts` ([(ids, meta)], the global list): {"eval_pass1": mean reward of the
    greedy response, "eval_n": prompts} and, when cfg.eval_k > 0, "eval_mean_at_k": the mean reward of
    eval_k samples per prompt (the rollout's sampling settings). Each DP rank scores its share
    (`eval_rank_indices`), padded to the largest share by repeating a prompt whose score is not
    counted, so every rank runs the same number of generations (FSDP collectives)."""
    n = len(prompts)
    per = -(-n // dp_size)  # the largest share
    mine = eval_rank_indices(n, dp_rank, dp_size)
    idx = mine + [mine[-1] if mine else 0] * (per - len(mine))
    chunk = max(1, cfg.prompts_per_step // dp_size)
    sums = torch.zeros(3, dtype=torch.float64, device="cpu")  # greedy reward sum, sampled reward sum, prompts
    for lo in range(0, per, chunk):
        part = idx[lo:lo + chunk]
        keep = torch.tensor([lo + i < len(mine) for i in range(len(part))], dtype=torch.float64, device="cpu")
        ids, metas = [prompts[i][0] for i in part], [prompts[i][1] for i in part]
        for col, k, greedy in ((0, 1, True), (1, cfg.eval_k, False)):
            if k == 0:
                continue
            rows = torch.tensor([i * k + j for i in part for j in range(k)], device="cpu")
            _, responses = _generate(policy, tokenizer, ids, k, cfg, greedy=greedy, seed=seed, step=step,
                                     row_ids=rows, tp_group=tp_group, dp_group=dp_group, device=device)
            scores = _score(reward_fn, metas, responses, k, f"eval at step {step}", world_group)
            sums[col] += (scores.double().view(-1, k).mean(1) * keep).sum()
        sums[2] += keep.sum()
    sums = sums.to(device)
    comm.all_reduce(sums, "sum", dp_group)  # reward sums and prompt counts over the DP ranks' shares
    out = {"eval_pass1": float(sums[0] / sums[2]), "eval_n": int(sums[2])}
    if cfg.eval_k:
        out["eval_mean_at_k"] = float(sums[1] / sums[2])
    return out
