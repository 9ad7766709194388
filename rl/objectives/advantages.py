"""Advantages: GRPO group normalisation, GAE for PPO, masked whitening, KL-in-reward shaping.

Layout: responses are right padded, `[B, S]` with column s = response position s, and
`mask[b, s]` true on the response tokens that count. Every function here is local to one
process except `whiten`, which, given `dp_group`, uses the mean and variance over the valid
tokens of every DP rank.
"""

from __future__ import annotations

import torch

from parallel import comm


def _check_finite_rewards(rewards: torch.Tensor, group_size: int, where: str) -> None:
    bad = ~torch.isfinite(rewards)
    if bad.any():
        k = int(bad.nonzero()[0, 0])
        raise ValueError(f"{where}: reward {float(rewards[k])} for prompt {k // group_size}, sample "
                         f"{k % group_size} (flat index {k}) is not finite")


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True,
                    eps: float = 1e-6, unbiased_std: bool = True) -> torch.Tensor:
    """Group-normalised advantages, one per sample.

    rewards: [N * G], the G samples of prompt i at flat indices i*G .. i*G+G-1 (G = group_size).
    A = r - mean(group), divided by (std(group) + eps) when `scale_by_std` (std with Bessel's
    correction unless `unbiased_std=False`). A group whose rewards are all equal -- including
    every group when G == 1, where there is nothing to compare against -- gets exactly 0: it
    carries no learning signal, and a singleton's std is undefined. Returns [N * G], fp32
    (fp64 for fp64 rewards). A non-finite reward raises ValueError naming prompt and sample.

    The group mean and std are taken in float64 whatever the rewards' dtype: rewards that share a
    large offset (1e7 + {0, 1}) would lose the baseline in an fp32 sum (8 x 1e7 is past 2^24, so
    the mean rounds and the advantages come out 0 or 1.32 instead of -+0.94). fp32 rewards are exact
    in float64; only the returned advantages are rounded, once.
    """
    if rewards.dim() != 1:
        raise ValueError(f"grpo_advantages: rewards must be 1-D [N*G], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"grpo_advantages: {rewards.numel()} rewards do not split into groups of "
                         f"{group_size}")
    _check_finite_rewards(rewards, group_size, "grpo_advantages")
    out_dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    g = rewards.to(torch.float64).view(-1, group_size)  # [N, G]; [N*G] floats, float64 costs nothing
    adv = g - g.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        adv = adv / (g.std(dim=1, keepdim=True, unbiased=unbiased_std) + eps)
    constant = g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)  # [N, 1]
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(out_dtype)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's leave-one-out advantages (Ahmadian et al. 2024, arXiv 2402.14740, eq. 6): each sample's reward minus
    the mean of the other G - 1 of its group, = G / (G - 1) x (r - group mean). rewards: [N * G] prompt-major;
    G >= 2. Returns [N * G], fp32 (fp64 for fp64 rewards); the group mean in float64 as in `grpo_advantages`."""
    if rewards.dim() != 1 or group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"rloo_advantages: {tuple(rewards.shape)} rewards must be 1-D and split into groups of "
                         f"group_size={group_size} >= 2 (the others of a group are the baseline)")
    _check_finite_rewards(rewards, group_size, "rloo_advantages")
    g = rewards.to(torch.float64).view(-1, group_size)
    adv = (g - g.mean(dim=1, keepdim=True)) * (group_size / (group_size - 1))
    out_dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    return adv.reshape(-1).to(out_dtype)


def reinforce_pp_advantages(scores: torch.Tensor, mask: torch.Tensor, group_size: int, *, baseline: bool = False,
                            kl: torch.Tensor | None = None, beta: float = 0.0, dp_group=None) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): each token's return (the response's score, minus beta x the KL of
    this and every later token when `kl` [B, S] is given: the KL per token in the reward, gamma = 1), whitened
    over the valid tokens of the whole batch on every DP rank (`whiten`: one mean, one std for all). With
    `baseline` (REINFORCE++-baseline) each score first loses its group's mean. scores: [B] prompt-major;
    mask: [B, S]. Returns [B, S], 0 off the mask."""
    _check_finite_rewards(scores, group_size, "reinforce_pp_advantages")
    s = scores.to(torch.float64)
    if baseline:
        g = s.view(-1, group_size)
        s = (g - g.mean(dim=1, keepdim=True)).reshape(-1)
    m = mask.bool()
    if kl is None or beta == 0.0:
        returns = broadcast_to_tokens(s, m)
    else:  # returns-to-go of the shaped rewards: the score at the last token, -beta KL at every token
        valid = m.any(1)
        rewards = torch.zeros(m.shape, dtype=torch.float64, device=m.device)
        if valid.any():
            rewards[valid] = kl_shaped_rewards(s[valid], kl[valid].to(torch.float64), m[valid], beta)
        returns, _ = gae(rewards, torch.zeros_like(rewards), m, gamma=1.0, lam=1.0)
    out = whiten(returns, m, dp_group)
    return out.to(torch.float64 if scores.dtype == torch.float64 else torch.float32)


def outcome_advantages(kind: str, scores: torch.Tensor, mask: torch.Tensor, group_size: int, *,
                       std_norm: bool = True, kl: torch.Tensor | None = None, beta: float = 0.0,
                       kl_in_reward: bool = False, dp_group=None) -> torch.Tensor:
    """`algo.advantage`'s per-token advantages [B, S] from response scores [B] (critic-free). With the KL in the
    reward (`kl_in_reward`): grpo and rloo take each response's summed KL off its score; REINFORCE++ puts it
    per token into the returns."""
    if kind.startswith("reinforce_pp"):
        return reinforce_pp_advantages(scores, mask, group_size, baseline=kind == "reinforce_pp_baseline",
                                       kl=kl if kl_in_reward else None, beta=beta, dp_group=dp_group)
    if kl_in_reward:  # the response's summed KL penalty enters its reward
        scores = scores - beta * kl.sum(1)
    if kind == "rloo":
        return broadcast_to_tokens(rloo_advantages(scores, group_size), mask)
    if kind != "grpo":
        raise ValueError(f"algo.advantage={kind!r} is not a critic-free advantage")
    return broadcast_to_tokens(grpo_advantages(scores, group_size, std_norm), mask)


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] per-sequence values -> [B, S] on the valid tokens, 0 elsewhere."""
    if seq_values.dim() != 1 or seq_values.shape[0] != mask.shape[0]:
        raise ValueError(f"broadcast_to_tokens: values of shape {tuple(seq_values.shape)} do not match "
                         f"{mask.shape[0]} rows of the mask")
    return torch.where(mask.bool(), seq_values[:, None], torch.zeros((), dtype=seq_values.dtype,
                                                                        device=seq_values.device))


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each response.

    token_rewards, values, mask: [B, S]. Only valid tokens take part: a masked position (right
    padding, or a hole such as tool output inside a response) is skipped, the recursion
    carrying the next valid token's value and advantage across it; after the last valid token
    the episode ends (next value 0). With t' the next valid token after t:
        delta_t = r_t + gamma * V_t' - V_t,  A_t = delta_t + gamma * lam * A_t'.
    Returns (advantages, returns = advantages + values), both [B, S], 0 on masked positions,
    fp32 (fp64 for fp64 inputs), detached. Whatever masked positions hold (NaN, inf) is ignored.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.dim() != 2:
        raise ValueError(f"gae: rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and "
                         f"mask {tuple(mask.shape)} must be equal [B, S] shapes")
    dt = torch.float64 if values.dtype == torch.float64 else torch.float32
    keep = mask.bool()
    zero = torch.zeros((), dtype=dt, device=values.device)
    # masked positions are replaced before any arithmetic: a NaN value in the padding would
    # otherwise survive the multiplications by the mask below (NaN * 0 = NaN) and poison the row
    r = torch.where(keep, token_rewards.detach().to(dt), zero)
    v = torch.where(keep, values.detach().to(dt), zero)
    m = keep.to(dt)
    B, S = r.shape
    next_value = torch.zeros(B, dtype=dt, device=r.device)
    next_adv = torch.zeros(B, dtype=dt, device=r.device)
    adv = torch.zeros_like(r)
    for t in range(S - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        mt = m[:, t]
        adv[:, t] = a_t * mt
        next_value = v[:, t] * mt + next_value * (1 - mt)  # masked tokens pass the state through
        next_adv = a_t * mt + next_adv * (1 - mt)
    returns = (adv + v) * m
    return adv, returns


def whiten(values: torch.Tensor, mask: torch.Tensor, dp_group=None, shift_mean: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the valid tokens of every DP rank.

    values, mask: [B, S]. The mean and (Bessel-corrected) variance are taken over all valid
    tokens of all ranks in `dp_group` (None: this process only), so the result does not depend
    on how the batch is split. shift_mean=False adds the mean back (scale only). Fewer than two
    valid tokens overall: variance is taken as 0. Returns [B, S], 0 on masked positions.
    """
    if values.shape != mask.shape:
        raise ValueError(f"whiten: values {tuple(values.shape)} and mask {tuple(mask.shape)} differ")
    dt = torch.float64 if values.dtype == torch.float64 else torch.float32
    m = mask.bool()
    x = torch.where(m, values.to(dt), torch.zeros((), dtype=dt, device=values.device))
    sc = torch.stack([x.sum(), m.sum().to(dt)])
    comm.all_reduce(sc, "sum", dp_group)  # [sum of valid values, valid-token count] over DP
    n = sc[1]
    mean = sc[0] / n.clamp(min=1)
    dev = torch.where(m, x - mean, torch.zeros((), dtype=dt, device=values.device))
    ss = (dev * dev).sum().reshape(1)
    comm.all_reduce(ss, "sum", dp_group)  # sum of squared deviations from the global mean over DP
    var = ss[0] / (n - 1) if n > 1 else torch.zeros((), dtype=dt, device=values.device)
    out = dev * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=dt, device=values.device))


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """[B, S] mask -> [B] index of the last valid token; ValueError naming rows without one."""
    m = mask.bool()
    empty = ~m.any(dim=1)
    if empty.any():
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(f"empty response (no valid token) in rows {rows[:10]}"
                         f"{' ...' if len(rows) > 10 else ''}: a response needs at least its EOS token")
    pos = torch.arange(m.shape[1], device=m.device).expand_as(m)
    return torch.where(m, pos, torch.full_like(pos, -1)).amax(dim=1)


def kl_shaped_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                      beta: float) -> torch.Tensor:
    """KL in the reward: token_rewards = -beta * kl on valid tokens, plus the sequence score at
    the last valid token of each response.

    scores: [B] scalar reward per response; kl: [B, S] per-token KL estimate (detached here);
    mask: [B, S]. Returns [B, S] fp32, 0 on masked positions. A row with no valid token raises
    ValueError (its score would have nowhere to go).
    """
    if kl.shape != mask.shape or scores.shape != (mask.shape[0],):
        raise ValueError(f"kl_shaped_rewards: scores {tuple(scores.shape)}, kl {tuple(kl.shape)}, mask "
                         f"{tuple(mask.shape)}; expected [B], [B, S], [B, S]")
    _check_finite_rewards(scores, 1, "kl_shaped_rewards")
    dt = torch.float64 if kl.dtype == torch.float64 else torch.float32
    m = mask.bool()
    out = torch.where(m, -beta * kl.detach().to(dt), torch.zeros((), dtype=dt, device=kl.device))
    last = last_token_index(m)
    rows = torch.arange(m.shape[0], device=m.device)
    out[rows, last] += scores.to(dt)
    return out
