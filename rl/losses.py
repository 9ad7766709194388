"""Clipped PPO/GRPO losses and their aggregation, normalised by global counts.

Shapes: per-token tensors are `[B, S]` (this rank's micro-batch, right-padded responses),
`mask` true on valid response tokens. Masked positions contribute exactly 0 to values and
gradients even when they hold NaN/inf (selected away with `torch.where`).

Normalisation over data parallel
--------------------------------
A mini-batch is split over DP ranks (and over micro-batches on each rank). `LossScale` carries
the counts of the WHOLE mini-batch -- valid tokens, and sequences with at least one valid token,
summed over every micro-batch of every DP rank. Each micro-batch's loss is

    local_loss = (sum of this micro-batch's per-token/per-sequence terms) / global_count

The trainer sums `local_loss` over its micro-batches (backward on each, no extra averaging) and
kltron's FSDP2 *sums* gradients over DP (parallel/fsdp.py: divide factor 1), so the resulting
gradient is exactly the gradient of the single-process loss on the whole mini-batch, however the
batch is split; and the sum over DP ranks of the local losses equals the single-process loss.
`loss_scale(masks, dp_group)` builds a `LossScale` with one all-reduce; with `scale=None` the
local counts are used (single process).

Aggregation modes (`aggregate`), with T = global valid tokens, N = global non-empty sequences:
  token-mean              sum_{b,s} x / T
  seq-mean-token-mean     sum_b (sum_s x / n_b) / N           (n_b = valid tokens of row b)
  seq-mean-token-sum-norm sum_b (sum_s x / norm_len) / N      (Dr. GRPO; norm_len e.g. the max
                                                               response length, a fixed constant)
Empty rows add 0 and are not counted in N; an empty mini-batch gives a loss of exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel import comm
from rl.kl import KLConfig, kl_from_config

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossScale:
    tokens: int  # valid tokens in the whole mini-batch (all micro-batches, all DP ranks)
    seqs: int  # sequences with >= 1 valid token, same scope


def loss_scale(masks, dp_group=None) -> LossScale:
    """Global counts from this rank's mask(s): one [B, S] tensor or a list (one per micro-batch)."""
    masks = [masks] if isinstance(masks, torch.Tensor) else list(masks)
    tokens = sum(int(m.bool().sum()) for m in masks)
    seqs = sum(int(m.bool().any(dim=-1).sum()) for m in masks)
    counts = torch.tensor([tokens, seqs], dtype=torch.int64, device=masks[0].device if masks else None)
    comm.all_reduce(counts, "sum", dp_group)  # [valid tokens, non-empty sequences] over DP ranks
    return LossScale(int(counts[0]), int(counts[1]))


def _zero_masked(values: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    dt = torch.float64 if values.dtype == torch.float64 else torch.float32
    return torch.where(m, values.to(dt), torch.zeros((), dtype=dt, device=values.device))


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              scale: LossScale | None = None, norm_len: float | None = None) -> torch.Tensor:
    """Scalar loss from per-token terms `values` [B, S] (see the module docstring), fp32."""
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"aggregate: values {tuple(values.shape)} and mask {tuple(mask.shape)} must be "
                         f"equal [B, S] shapes")
    if mode not in AGG_MODES:
        raise ValueError(f"aggregate: unknown mode {mode!r}; expected one of {AGG_MODES}")
    m = mask.bool()
    if scale is None:
        scale = LossScale(int(m.sum()), int(m.any(dim=-1).sum()))
    x = _zero_masked(values, m)
    if mode == "token-mean":
        return x.sum() / max(scale.tokens, 1)
    if mode == "seq-mean-token-mean":
        per_seq = x.sum(-1) / m.sum(-1).clamp(min=1).to(x.dtype)
    else:
        if norm_len is None or not norm_len > 0:
            raise ValueError(f"aggregate: mode 'seq-mean-token-sum-norm' needs a positive norm_len "
                             f"(e.g. the max response length), got {norm_len!r}")
        per_seq = x.sum(-1) / norm_len
    return per_seq.sum() / max(scale.seqs, 1)


def _masked_stats(x: torch.Tensor, m: torch.Tensor, empty: float) -> tuple[torch.Tensor, ...]:
    """(mean, min, max) of x over valid positions, detached; `empty` for all three when none."""
    x = x.detach().float()
    if not m.any():
        e = torch.tensor(empty, device=x.device)
        return e, e.clone(), e.clone()
    v = x[m]
    return v.mean(), v.min(), v.max()


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, clip_low: float = 0.2, clip_high: float | None = None,
                      dual_clip: float | None = None, log_ratio_clamp: float = 20.0
                      ) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate, per token.

    logp (with grad), old_logp (behaviour policy), advantages, mask: [B, S].
    ratio = exp(clamp(logp - old_logp, +-log_ratio_clamp));
    loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)), clip_high defaults to
    clip_low; with dual_clip = c > 1, tokens with A < 0 are capped at c * |A| (Ye et al. 2020).
    Returns (per-token loss [B, S] fp32, 0 on masked positions; stats of detached 0-d tensors
    over this micro-batch's valid tokens: clipfrac (share where the clipped branch is taken),
    dual_clipfrac, ratio_mean/min/max (1.0 with no valid token), approx_kl_old (k3 estimate of
    KL(old || new) from the old policy's samples), valid_tokens).
    """
    if not (logp.shape == old_logp.shape == advantages.shape == mask.shape):
        raise ValueError(f"clipped_surrogate: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, "
                         f"advantages {tuple(advantages.shape)}, mask {tuple(mask.shape)} must match")
    clip_high = clip_low if clip_high is None else clip_high
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"clipped_surrogate: dual_clip must be > 1, got {dual_clip}")
    m = mask.bool()
    dt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    log_ratio = _zero_masked(logp, m) - _zero_masked(old_logp, m)
    log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    adv = _zero_masked(advantages, m).detach()
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1) & m
    dual = torch.zeros_like(m)
    if dual_clip is not None:
        cap = -adv * dual_clip  # = dual_clip * |A| where A < 0
        dual = (adv < 0) & (loss > cap) & m
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    loss = torch.where(m, loss, torch.zeros((), dtype=dt, device=loss.device))
    n = int(m.sum())
    lr = log_ratio.detach()
    r_mean, r_min, r_max = _masked_stats(ratio, m, 1.0)
    stats = {
        "clipfrac": clipped.sum().float() / max(n, 1),
        "dual_clipfrac": dual.sum().float() / max(n, 1),
        "ratio_mean": r_mean, "ratio_min": r_min, "ratio_max": r_max,
        "approx_kl_old": torch.where(m, torch.expm1(lr) - lr, torch.zeros((), dtype=dt, device=lr.device)).sum().float()
        / max(n, 1),
        "valid_tokens": torch.tensor(float(n), device=lr.device),
    }
    return loss, stats


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, clip: float | None = 0.2) -> tuple[torch.Tensor, dict]:
    """PPO value loss per token: 0.5 * max((V - R)^2, (V_clip - R)^2),
    V_clip = V_old + clip(V - V_old, -clip, clip); clip=None: 0.5 * (V - R)^2.

    values (with grad), old_values, returns, mask: [B, S]. Returns (per-token [B, S] fp32, 0 on
    masked positions; {"vf_clipfrac": share of valid tokens where the clipped branch is taken}).
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(f"clipped_value_loss: values {tuple(values.shape)}, old_values "
                         f"{tuple(old_values.shape)}, returns {tuple(returns.shape)}, mask "
                         f"{tuple(mask.shape)} must match")
    m = mask.bool()
    v = _zero_masked(values, m)
    v_old = _zero_masked(old_values, m).detach()
    ret = _zero_masked(returns, m).detach()
    l1 = (v - ret) ** 2
    if clip is None:
        loss, clipped = 0.5 * l1, torch.zeros_like(m)
    else:
        v_clip = v_old + (v - v_old).clamp(-clip, clip)
        l2 = (v_clip - ret) ** 2
        loss, clipped = 0.5 * torch.maximum(l1, l2), (l2 > l1) & m
    loss = torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    return loss, {"vf_clipfrac": clipped.sum().float() / max(int(m.sum()), 1)}


@dataclass
class PolicyLossConfig:
    """The `loss` section of the policy objective."""

    clip_low: float = 0.2
    clip_high: float | None = None  # None: = clip_low; e.g. 0.28 for DAPO's clip-higher
    dual_clip: float | None = None  # e.g. 3.0
    agg: str = "token-mean"  # one of AGG_MODES
    norm_len: float | None = None  # seq-mean-token-sum-norm: the constant (max response length)
    entropy_coef: float = 0.0  # loss -= entropy_coef * entropy
    log_ratio_clamp: float = 20.0

    def __post_init__(self):
        if self.agg not in AGG_MODES:
            raise ValueError(f"loss.agg must be one of {AGG_MODES}, got {self.agg!r}")
        if self.agg == "seq-mean-token-sum-norm" and not (self.norm_len and self.norm_len > 0):
            raise ValueError("loss.agg='seq-mean-token-sum-norm' needs a positive loss.norm_len")
        if not self.clip_low > 0 or (self.clip_high is not None and not self.clip_high > 0):
            raise ValueError(f"loss.clip_low/clip_high must be positive, got {self.clip_low}, "
                             f"{self.clip_high}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cfg: PolicyLossConfig | None = None, *,
                kl_cfg: KLConfig | None = None, beta: float = 0.0,
                ref_logp: torch.Tensor | None = None, kl: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, scale: LossScale | None = None
                ) -> tuple[torch.Tensor, dict]:
    """Surrogate + beta * KL + (-entropy_coef * entropy), each aggregated by `cfg.agg` with `scale`.

    All tensors [B, S]. The KL term enters when `kl_cfg.where == "loss"`: from `kl` (a per-token
    KL with grad, e.g. the exact KL from the fused head; required when kl_cfg.exact) or else from
    `kl_estimate(logp, ref_logp)` with kl_cfg's estimator. With where == "reward" (or no kl_cfg)
    no KL term is added, but the KL is still reported when `kl` (or, unless kl_cfg.exact,
    `ref_logp`) is given.
    `entropy` (with grad) is needed when cfg.entropy_coef != 0.
    Returns (loss: 0-d fp32 tensor with grad, stats: dict of detached 0-d tensors: pg_loss,
    kl_loss (the aggregated KL; scaled like the loss), entropy, clipfrac, dual_clipfrac,
    ratio_mean/min/max, approx_kl_old, valid_tokens).
    """
    cfg = cfg or PolicyLossConfig()
    pg, stats = clipped_surrogate(logp, old_logp, advantages, mask, cfg.clip_low, cfg.clip_high,
                                  cfg.dual_clip, cfg.log_ratio_clamp)
    agg = lambda x: aggregate(x, mask, cfg.agg, scale, cfg.norm_len)
    pg_loss = agg(pg)
    loss = pg_loss
    stats["pg_loss"] = pg_loss.detach()

    kl_in_loss = kl_cfg is not None and kl_cfg.where == "loss"
    exact = kl_cfg is not None and kl_cfg.exact
    if kl is None and ref_logp is not None and not exact:
        kl = kl_from_config(kl_cfg or KLConfig(), logp, ref_logp)
    if kl_in_loss and kl is None:
        raise ValueError("policy_loss: kl.where='loss' needs the per-token `kl`" +
                         (" (kl.exact=True: the exact KL from the head)" if exact else " or `ref_logp`"))
    if kl is not None:
        kl_loss = agg(kl)
        stats["kl_loss"] = kl_loss.detach()
        if kl_in_loss and beta != 0.0:
            loss = loss + beta * kl_loss

    if cfg.entropy_coef != 0.0 and entropy is None:
        raise ValueError("policy_loss: loss.entropy_coef != 0 needs the per-token `entropy`")
    if entropy is not None:
        ent = agg(entropy)
        stats["entropy"] = ent.detach()
        if cfg.entropy_coef != 0.0:
            loss = loss - cfg.entropy_coef * ent
    return loss, stats


def token_weights(mask: torch.Tensor, mode: str = "token-mean", scale: LossScale | None = None,
                  norm_len: float | None = None) -> torch.Tensor:
    """Per-token weights w [B, S] (fp32, 0 off the mask) with aggregate(x, mask, mode, scale,
    norm_len) == (w * x).sum() for any x: every aggregation mode is linear in the per-token terms."""
    m = mask.bool()
    if scale is None:
        scale = LossScale(int(m.sum()), int(m.any(dim=-1).sum()))
    one = torch.ones(m.shape, dtype=torch.float32, device=m.device)
    if mode == "token-mean":
        w = one / max(scale.tokens, 1)
    elif mode == "seq-mean-token-mean":
        w = one / (m.sum(-1, keepdim=True).clamp(min=1).float() * max(scale.seqs, 1))
    elif mode == "seq-mean-token-sum-norm":
        if norm_len is None or not norm_len > 0:
            raise ValueError("token_weights: mode 'seq-mean-token-sum-norm' needs a positive norm_len")
        w = one / (norm_len * max(scale.seqs, 1))
    else:
        raise ValueError(f"token_weights: unknown mode {mode!r}; expected one of {AGG_MODES}")
    return torch.where(m, w, torch.zeros((), device=m.device))


def token_policy_loss(cfg: PolicyLossConfig, weights: torch.Tensor, mask: torch.Tensor, old_logp: torch.Tensor,
                      advantages: torch.Tensor, *, kl_cfg: KLConfig | None = None, beta: float = 0.0,
                      ref_logp: torch.Tensor | None = None, on_policy: bool = False):
    """`policy_loss` as a per-token function for `parallel.fused_loss.fused_head_loss`, which forms
    the gradient during its forward pass, chunk by chunk. All tensors [B, S] (flattened here);
    `weights` from `token_weights`. Summed over every token, the returned function's values equal
    `policy_loss(...)`'s loss. `on_policy`: the first mini-batch after the rollout, whose old
    policy is the current one, so old log-probs are the current ones, detached (ratio exactly 1)."""
    w, m = weights.reshape(-1), mask.reshape(-1).bool()
    old, adv = old_logp.reshape(-1), advantages.reshape(-1)
    ref = None if ref_logp is None else ref_logp.reshape(-1)
    kl_in_loss = kl_cfg is not None and kl_cfg.where == "loss" and beta != 0.0

    def fn(logp, entropy, kl, tokens):
        mm = m[tokens]
        o = logp.detach() if on_policy else old[tokens]
        total, _ = clipped_surrogate(logp, o, adv[tokens], mm, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                                     cfg.log_ratio_clamp)
        if kl_in_loss:
            total = total + beta * (kl if kl_cfg.exact else kl_from_config(kl_cfg, logp, ref[tokens]))
        if cfg.entropy_coef != 0.0:
            total = total - cfg.entropy_coef * entropy
        return torch.where(mm, total * w[tokens].to(total.dtype), torch.zeros((), dtype=total.dtype,
                                                                               device=total.device))
    return fn
