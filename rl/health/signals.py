"""Per-step signals for the KL playbook: n-gram repetition of the sampled responses, the reward/KL
correlation over a window, and the two loss terms' gradient norms that `kl_ctl.mode=grad_ratio` balances.

All tensors are this rank's `[B, N]` response tensors (B local rows, N response positions, not
sharded over TP); the returned numbers are global over DP (one all-reduce each).
"""

from __future__ import annotations

import math
from collections import deque

import torch

from parallel import comm
from rl.objectives.kl import KLConfig, kl_loss_term
from rl.objectives.losses import PolicyLossConfig, clipped_surrogate, loss_scale, token_weights


def repetition_rate(ids: torch.Tensor, mask: torch.Tensor, n: int = 3, dp_group=None) -> float:
    """Mean over responses with at least one n-gram of 1 - (distinct n-grams / n-grams), the share of
    a response's token n-grams that repeat an earlier one (0: no repetition). ids, mask: [B, N]; a
    response is its valid tokens (mask true), in order. Global over DP.

    Tensor ops on the ids' device, O(B N log N), no per-token Python (a 512 x 2048 rollout is a million
    tokens): each row's valid tokens moved to its front (a stable sort keeps their order), each n-gram
    one int64 (t_0 V^(n-1) + ... + t_(n-1), exact while V^n < 2^62, V = max id + 1), the row's codes
    sorted, distinct ones counted where the sorted code changes. Where V^n would overflow, the n-grams
    are compared directly (unique over rows of n ids)."""
    B, N = ids.shape
    mask = mask.bool()
    counts, distinct = torch.zeros(B, dtype=torch.long, device=ids.device), None
    if N >= n and B > 0:
        order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices  # valid tokens first, in order
        toks = ids.gather(1, order).long()
        length = mask.sum(1)
        G = N - n + 1
        counts = (length - n + 1).clamp(min=0)  # n-grams per row
        valid = torch.arange(G, device=ids.device)[None, :] < counts[:, None]  # [B, G]
        V = int(toks.max()) + 1 if toks.numel() else 1
        if V ** n < 2 ** 62:
            code = toks[:, :G].clone()
            for j in range(1, n):
                code = code * V + toks[:, j:j + G]
            code = torch.where(valid, code, torch.full_like(code, torch.iinfo(torch.long).max))
            srt = torch.sort(code, dim=1).values  # a row's valid codes first (every code < the fill)
            change = torch.ones_like(valid)
            change[:, 1:] = srt[:, 1:] != srt[:, :-1]
            distinct = (change & valid).sum(1)
        else:  # exact for any vocabulary: ids of (row, n-gram) compared whole
            grams = torch.stack([toks[:, j:j + G] for j in range(n)], dim=-1)  # [B, G, n]
            keys = torch.cat([torch.arange(B, device=ids.device)[:, None, None].expand(B, G, 1), grams], -1)
            uniq = torch.unique(keys[valid], dim=0)
            distinct = torch.bincount(uniq[:, 0], minlength=B)
    has = counts > 0
    rate = torch.zeros(B, dtype=torch.float64, device=ids.device)
    if distinct is not None:
        rate = torch.where(has, 1.0 - distinct.double() / counts.clamp(min=1).double(), rate)
    t = torch.stack([rate.sum(), has.sum().double()])
    comm.all_reduce(t, "sum", dp_group)  # rate sums and counted responses over DP
    return float(t[0] / t[1]) if t[1] > 0 else 0.0


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation of two equal-length series; None with fewer than 3 points or no spread."""
    n = len(xs)
    if n < 3 or n != len(ys):
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 1e-24 or syy <= 1e-24:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)


class WindowCorr:
    """Pearson correlation of the last `window` (x, y) pairs (e.g. reward_mean and kl_mean per step)."""

    def __init__(self, window: int = 20):
        self.pairs: deque = deque(maxlen=window)

    def add(self, x: float, y: float) -> float | None:
        self.pairs.append((float(x), float(y)))
        return pearson([p[0] for p in self.pairs], [p[1] for p in self.pairs])

    def state_dict(self) -> dict:
        """The window's pairs (JSON floats round-trip exactly): a resumed run's correlation is bitwise the same."""
        return {"pairs": [list(p) for p in self.pairs]}

    def load_state_dict(self, state: dict) -> None:
        self.pairs.clear()
        self.pairs.extend((float(x), float(y)) for x, y in state["pairs"])


def loss_term_grad_norms(loss_cfg: PolicyLossConfig, kl_cfg: KLConfig, old_logp: torch.Tensor,
                         ref_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                         dp_group=None) -> tuple[float, float]:
    """(|grad pg|, |grad KL|): the norms of the gradients of the policy-gradient term and of the KL term
    (per unit beta) of this step's on-policy loss with respect to the sampled tokens' log-probs.

    old_logp, ref_logp, advantages, mask: [B, N]. Both terms are aggregated as the loss aggregates them
    (global counts over DP); the squared norms are summed over DP ranks, so every rank gets the same
    pair. Both terms reach the parameters through the same Jacobian d logp / d theta, so this is the
    output-layer measure of their balance (cheap: no extra forward or backward through the model)."""
    logp = old_logp.detach().float().clone().requires_grad_(True)
    scale = loss_scale(mask, dp_group)
    w = token_weights(mask, loss_cfg.agg, scale, loss_cfg.norm_len)
    pg, _ = clipped_surrogate(logp, logp.detach(), advantages, mask, loss_cfg.clip_low, loss_cfg.clip_high,
                              loss_cfg.dual_clip, loss_cfg.log_ratio_clamp)
    (g_pg,) = torch.autograd.grad((w * pg).sum(), logp)
    klt = kl_loss_term(kl_cfg, logp, ref_logp, logp.detach(), mask)
    (g_kl,) = torch.autograd.grad((w * klt).sum(), logp)
    sq = torch.stack([g_pg.double().pow(2).sum(), g_kl.double().pow(2).sum()])
    comm.all_reduce(sq, "sum", dp_group)  # squared norms over DP: one global pair on every rank
    return float(sq[0].sqrt()), float(sq[1].sqrt())
