"""DAPO's data side (Yu et al. 2025, arXiv 2503.14476, sec. 3.2 and 3.4) around the rollout of one step.

- Soft overlong punishment (`algo.overlong_buffer` = L_cache > 0), eq. 13, with L_max = rollout.max_new_tokens:
  a response of |y| tokens (its stop token included) gets
  -overlong_penalty x (|y| - (L_max - L_cache)) / L_cache added to its reward when |y| > L_max - L_cache
  (-overlong_penalty at the limit), before anything reads the rewards.
- Overlong filtering (`algo.overlong_filter`): a truncated response (L_max tokens and no stop: its last token no
  EOS id, its text no stop string) leaves the loss (its response mask cleared); its reward still counts in its
  group's baseline.
- Dynamic sampling (`algo.dynamic_sampling`), eq. 11: a prompt group whose rewards are all equal has advantage 0
  for every sample (GRPO, RLOO, REINFORCE++-baseline) and only dilutes the batch. Such groups are dropped and more
  prompts sampled, round by round, until every DP rank holds its rollout.prompts_per_step / dp groups (the count
  agreed with one all-reduce per round, so every rank runs the same rounds: generation's collectives) or
  `algo.dynamic_sampling_max_rounds` extra rounds have run; a rank still short then fills its share with dropped
  groups (zero advantage: no signal, only counted), reported as `ds_filled`. Round r >= 1 draws its prompts and
  sampling noise under the key step + r x train.steps, a step no regular step of the run uses.

Metrics (global over DP, into the step's record): ds_rounds (extra rounds run), ds_drop_rate (share of the first
round's groups with equal rewards: rises as the task saturates, the sign to raise the difficulty),
ds_groups_sampled, ds_filled, ds_extra_rollout_s (this rank's generation time in the extra rounds),
overlong_rate (share of responses truncated), overlong_penalty_mean (mean punishment per response).
"""

from __future__ import annotations

import torch

from parallel import comm
from rl.experience.rollout import Rollout, eos_ids_of


def truncated(ro: Rollout, max_new_tokens: int, eos_ids, stop: list[str]) -> torch.Tensor:
    """[B] bool: responses that hit max_new_tokens without a stop (EOS id as last token, or a stop string)."""
    m = ro.response_mask.bool()
    n = m.sum(1)
    last = ro.responses_ids.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
    eos = torch.tensor(sorted(set(eos_ids)), dtype=last.dtype, device=last.device)
    stopped = torch.isin(last, eos)
    if stop and ro.responses:
        stopped |= torch.tensor([any(s in r for s in stop) for r in ro.responses], device=last.device)
    return (n >= max_new_tokens) & ~stopped


def overlong_punishment(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO eq. 13 [B] (fp32): 0 up to max_new_tokens - buffer tokens, then linear down to -penalty at the limit."""
    over = (lengths.to(torch.float32) - (max_new_tokens - buffer)).clamp(min=0.0)
    return -penalty * torch.clamp(over / buffer, max=1.0)


def shape_overlong(ro: Rollout, cfg, eos_ids) -> dict:
    """Apply the overlong punishment and filter of `cfg` (RLConfig) to `ro` in place; returns the local sums
    {truncated, responses, penalty} for the metrics."""
    a, r = cfg.algo, cfg.rollout
    trunc = truncated(ro, r.max_new_tokens, eos_ids, r.stop)
    pen = torch.zeros_like(ro.scores)
    if a.overlong_buffer > 0:
        pen = overlong_punishment(ro.response_mask.sum(1), r.max_new_tokens, a.overlong_buffer,
                                  a.overlong_penalty).to(ro.scores)
        ro.scores = ro.scores + pen
    if a.overlong_filter:
        ro.response_mask = ro.response_mask & ~trunc[:, None]
    return {"truncated": float(trunc.sum()), "responses": float(trunc.numel()), "penalty": float(pen.sum())}


def constant_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] bool: prompt groups whose G rewards are all equal (no signal)."""
    g = scores.view(-1, group_size)
    return g.amax(1) == g.amin(1)


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Rows of several rollouts in one: prompts left-padded to the longest prompt, responses right-padded to the
    longest response (masks 0 there). row_ids, metas and responses are concatenated as given."""
    P = max(p.prompt_len for p in parts)
    N = max(p.sequences.shape[1] - p.prompt_len for p in parts)
    seqs, att, resp = [], [], []
    for p in parts:
        pre, post = P - p.prompt_len, N - (p.sequences.shape[1] - p.prompt_len)
        seqs.append(torch.nn.functional.pad(p.sequences, (pre, post), value=pad_id))
        att.append(torch.nn.functional.pad(p.attention_mask, (pre, post), value=0))
        resp.append(torch.nn.functional.pad(p.response_mask, (0, post), value=False))
    return Rollout(torch.cat(seqs), torch.cat(att), torch.cat(resp), P, torch.cat([p.scores for p in parts]),
                   torch.cat([p.row_ids for p in parts]), [m for p in parts for m in p.metas],
                   [s for p in parts for s in p.responses])


def _select_groups(ro: Rollout, groups: list[int], G: int) -> Rollout:
    rows = torch.tensor([g * G + j for g in groups for j in range(G)], dtype=torch.long, device=ro.scores.device)
    sub = ro.select(rows)
    sub.metas = [ro.metas[g] for g in groups]
    return sub


def collect_step(collect, cfg, step: int, *, tokenizer, pad_id: int, dp_rank: int, dp_group, stats: dict
                 ) -> tuple[Rollout, dict]:
    """This rank's rollout of `step` with cfg.algo's overlong shaping and dynamic sampling (module docstring).
    `collect(key_step)` -> this rank's scored Rollout for the prompts and noise of `key_step` (rows
    prompt-major, row ids (first prompt + i) x G + j), filling `stats` (rollout_s, rollout_tokens) as
    rl.experience.rollout.collect_rollout does. Returns (the rollout, its metrics: global over DP)."""
    a, G = cfg.algo, cfg.rollout.group_size
    if not (a.dynamic_sampling or a.overlong_filter or a.overlong_buffer):
        return collect(step), {}
    eos = eos_ids_of(tokenizer)
    sums = {"truncated": 0.0, "responses": 0.0, "penalty": 0.0}

    def one(key: int) -> Rollout:
        ro = collect(key)
        for k, v in shape_overlong(ro, cfg, eos).items():
            sums[k] += v
        return ro

    first = one(step)
    if not a.dynamic_sampling:
        return first, _metrics(sums, None, dp_group)
    per = first.scores.numel() // G
    parts, kept, dropped = [first], [], []
    seconds, tokens = [stats.get("rollout_s", 0.0)], stats.get("rollout_tokens", 0)
    c0 = constant_groups(first.scores, G)
    counts = [float(c0.sum()), float(per)]  # the first round's dropped and sampled groups: the drop rate
    rounds = 0
    while True:
        ro = parts[-1]
        const = constant_groups(ro.scores, G).tolist()
        for g, c in enumerate(const):
            (dropped if c else kept).append((len(parts) - 1, g))
        have = torch.tensor([-float(len(kept))], dtype=torch.float64, device=comm.collective_device(dp_group))
        comm.all_reduce(have, "max", dp_group)  # the fewest kept groups on any DP rank (as -max of -count)
        if -float(have) >= per or rounds >= a.dynamic_sampling_max_rounds:
            break
        rounds += 1
        parts.append(one(step + rounds * max(cfg.train.steps, 1)))
        seconds.append(stats.get("rollout_s", 0.0))
        tokens += stats.get("rollout_tokens", 0)
    chosen = (kept + dropped)[:per]  # kept groups in the order found; dropped (zero-signal) ones fill a short rank
    filled = sum(1 for c in chosen[len(kept):])
    offsets = [0]
    for p in parts:
        offsets.append(offsets[-1] + p.scores.numel())
    rows = torch.tensor([offsets[k] + g * G + j for k, g in chosen for j in range(G)], dtype=torch.long,
                        device=first.scores.device)
    out = concat_rollouts(parts, pad_id).select(rows)
    out.metas = [parts[k].metas[g] for k, g in chosen]
    out.row_ids = torch.arange(dp_rank * per * G, (dp_rank + 1) * per * G, device=first.row_ids.device)
    stats.update(rollout_s=sum(seconds), rollout_tokens=tokens)
    ds = [float(rounds), counts[0], counts[1], float(filled), float(sum(seconds[1:])), float(len(parts) * per)]
    return out, _metrics(sums, ds, dp_group)


def _metrics(sums: dict, ds: list[float] | None, dp_group) -> dict:
    vals = [sums["truncated"], sums["responses"], sums["penalty"]] + ([ds[1], ds[2], ds[3], ds[5]] if ds else [])
    t = torch.tensor(vals, dtype=torch.float64, device=comm.collective_device(dp_group))
    comm.all_reduce(t, "sum", dp_group)  # truncation, punishment and dynamic-sampling counts over DP
    n = max(float(t[1]), 1.0)
    out = {"overlong_rate": float(t[0]) / n, "overlong_penalty_mean": float(t[2]) / n}
    if ds:
        out.update(ds_rounds=int(ds[0]), ds_drop_rate=float(t[3]) / max(float(t[4]), 1.0),
                   ds_groups_sampled=int(t[6]), ds_filled=int(t[5]), ds_extra_rollout_s=ds[4])
    return out
