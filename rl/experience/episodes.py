"""Multi-turn rollouts: G episodes per prompt against an environment (rl/envs), token in / token out.

Each turn the policy samples for the episodes still running (core/generation/multiturn.py's
`decode`, continuing its KV cache), the environment answers each turn's text and ids with an
observation, a reward and done; the observation is rendered with the turn markers (`render_observation`)
and its ids appended to the episode (`append`: one forward over them, nothing re-tokenised). An
episode ends when the environment says done, after `rollout.max_turns` turns, or when its
`rollout.max_episode_tokens` response-region tokens are spent (an observation that would not leave
room for one more sampled token is not appended). The Rollout's response region holds exactly the
sampled ids and the appended ids; `response_mask` is 1 on sampled ids only, so appended tokens
condition the model (attention_mask 1) but reach no loss, KL, entropy, advantage or metric. An
episode's score is the sum of its turns' rewards; GRPO groups are whole episodes (rows prompt-major).
"""

from __future__ import annotations

import time

import torch

from core.generation import multiturn as mt
from core.generation.generate import Stopper as _Stopper
from parallel.comm import all_reduce
from rl.envs.base import Episodes
from rl.experience.rollout import (
    Rollout,
    TaskPrompts,
    eos_ids_of,
    left_pad,
    pad_id_of,
    raise_everywhere,
    stop_string_check,
)

SENTINEL = "\ue000"


def render_observation(tokenizer, text: str, eos_sampled: int | None = None) -> str:
    """The text appended after a model turn: with a chat template, the end of the assistant turn (less
    the EOS `eos_sampled` the turn ended with, when it did), a tool turn holding `text` (a user turn
    where the template has no tool role) and the next assistant header; without one, the plain
    markers ' {text} '."""
    if getattr(tokenizer, "chat_template", None) is None:
        return f" {text} "
    head = [{"role": "user", "content": "q"}, {"role": "assistant", "content": SENTINEL}]
    before = tokenizer.render_chat(head, add_generation_prompt=False)
    for role in ("tool", "user"):
        try:
            full = tokenizer.render_chat(head + [{"role": role, "content": text}], add_generation_prompt=True)
            break
        except Exception:  # noqa: BLE001 - a template that refuses the tool role gets a user turn
            continue
    cut = before.index(SENTINEL) + 1
    if full[:cut] != before[:cut]:
        raise ValueError("render_observation: the chat template renders earlier turns differently once a turn "
                         "follows (it cannot be continued token-in/token-out)")
    tail = full[cut:]
    eos_text = (tokenizer.id_to_piece(eos_sampled) or "") if eos_sampled is not None else ""
    if eos_text and tail.startswith(eos_text):
        tail = tail[len(eos_text):]
    return tail


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text)) if text else []


@torch.no_grad()
def collect_episodes(policy, tokenizer, task, cfg, *, seed: int, step: int, dp_rank: int = 0, dp_size: int = 1,
                     tp_group=None, dp_group=None, device="cpu", world_group=None, stats: dict | None = None,
                     timeout_s: float = 30.0) -> Rollout:
    """G episodes for each of this rank's prompts against `cfg.env` (RolloutConfig). `stats` receives
    this rank's rollout_tokens and `env_metrics`: env_turns (mean turns per episode), tool_calls and
    tool_call_success (fraction of tool calls that ran; nan without calls), global over DP."""
    t0 = time.perf_counter()
    if policy.batch_invariant:  # its key layout reads columns as positions; an episode's cache has holes
        raise ValueError("rollout.env (multi-turn episodes) does not run with parallel.batch_invariant=true")
    G = cfg.group_size
    source = task if hasattr(task, "rank_prompts") else TaskPrompts(task, tokenizer)
    first, prompt_ids, metas = source.rank_prompts(cfg.prompts_per_step, seed, step, dp_rank, dp_size)
    B = len(metas) * G
    row_ids = torch.tensor([(first + i) * G + j for i in range(len(metas)) for j in range(G)], device=device)
    pad = pad_id_of(tokenizer)
    ids, mask = left_pad([r for r in prompt_ids for _ in range(G)], pad)
    eos = eos_ids_of(tokenizer)
    vocab = min(policy.cfg.vocab_size, getattr(tokenizer, "vocab_size", None) or policy.cfg.vocab_size)
    sample_kw = dict(vocab_size=vocab, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                     min_p=cfg.min_p, seed=seed, step=step, tp_group=tp_group)
    stopper = _Stopper(set(eos), None, stop_string_check(tokenizer, cfg.stop), device)
    budget_n = cfg.episode_tokens
    if ids.shape[1] + budget_n > policy.cfg.max_seq_len:
        raise ValueError(f"rollout: prompt length {ids.shape[1]} + rollout.max_episode_tokens {budget_n} exceeds "
                         f"model.max_seq_len {policy.cfg.max_seq_len}")
    columns = cfg.max_turns * (cfg.max_new_tokens + cfg.max_obs_tokens)
    conv = mt.start(policy, ids.to(device), mask.to(device), columns=columns, pad_id=pad, tp_group=tp_group,
                    dp_group=dp_group, share_prefill=cfg.share_prefill and G > 1, prefill_tokens=cfg.prefill_tokens)
    error, episodes = None, None
    try:
        episodes = Episodes(cfg.env, [m for m in metas for _ in range(G)], cfg.env_args, timeout_s)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        error = str(e)
    raise_everywhere(error, world_group)
    running = torch.ones(B, dtype=torch.bool, device=device)
    budget = torch.full((B,), budget_n, dtype=torch.long, device=device)
    scores = torch.zeros(B, dtype=torch.float64, device="cpu")  # host-side: filled per row from the environment
    turns = torch.zeros(B, dtype=torch.float64, device="cpu")
    calls = ok = 0
    for turn in range(cfg.max_turns):
        outs = mt.decode(policy, conv, running, max_new_tokens=cfg.max_new_tokens, budget=budget, stopper=stopper,
                         sample_kw=sample_kw, row_ids=row_ids, tp_group=tp_group, dp_group=dp_group)
        blocks: list[list[int]] = [[] for _ in range(B)]
        error = None
        try:
            for r in torch.nonzero(running)[:, 0].tolist():
                text = tokenizer.decode([t for t in outs[r] if t not in eos and t < vocab])
                res = episodes.step(r, turn, text, outs[r])
                scores[r] += float(res.reward)
                turns[r] += 1
                calls, ok = calls + int(res.tool_call), ok + int(res.tool_call and res.tool_ok)
                last = outs[r][-1] if outs[r] and outs[r][-1] in eos else None
                obs = _encode(tokenizer, render_observation(tokenizer, res.observation, last)) if not res.done else []
                if len(obs) > cfg.max_obs_tokens:
                    raise ValueError(f"observation of {len(obs)} tokens exceeds rollout.max_obs_tokens="
                                     f"{cfg.max_obs_tokens} (prompt {metas[r // G].get('prompt')!r}, turn {turn})")
                # the episode goes on only if another turn may follow with room for a sampled token
                if res.done or turn == cfg.max_turns - 1 or int(conv.n_resp[r]) + len(obs) >= budget_n:
                    running[r] = False
                else:
                    blocks[r] = obs
        except Exception as e:  # noqa: BLE001 - named with the plug-in, prompt and turn; raised everywhere
            error = f"{type(e).__name__}: {e} [step {step}]"
        raise_everywhere(error, world_group)
        go = torch.tensor([float(running.any())], device=device)
        if all_reduce(go, "max", dp_group).item() == 0:
            break
        mt.append(policy, conv, blocks, tp_group=tp_group)
    out = mt.finish(conv)
    if stats is not None:  # counts summed over DP: the metrics are the global ones
        tot = torch.tensor([float(turns.sum()), float(B), float(calls), float(ok)], dtype=torch.float64, device=device)
        all_reduce(tot, "sum", dp_group)
        t_sum, n, c, k = tot.tolist()
        stats.update(rollout_tokens=int(out["response_mask"].sum()), rollout_s=time.perf_counter() - t0,
                     env_metrics=dict(env_turns=t_sum / max(n, 1.0), tool_calls=c,
                                      tool_call_success=k / c if c else float("nan")))
    responses = [tokenizer.decode([t for t, k in zip(row, m) if k and t < vocab])
                 for row, m in zip(out["sequences"][:, out["prompt_len"]:].tolist(),
                                   out["attention_mask"][:, out["prompt_len"]:].tolist())]
    return Rollout(out["sequences"], out["attention_mask"], out["response_mask"], out["prompt_len"],
                   scores.float().to(device), row_ids, metas, responses, out["tempered_logprobs"], out["logprobs"],
                   None)
