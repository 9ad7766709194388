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
from rl.objectives.kl import KLConfig, kl_loss_term, sanitize

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICIES = ("ppo", "gspo", "gspo_token", "cispo")  # loss.policy; all but ppo: rl/objectives/policy_objectives.py


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


def _with_future_kl(advantages: torch.Tensor, m: torch.Tensor, kl_cfg: KLConfig | None, beta: float,
                    kl_future: torch.Tensor | None) -> torch.Tensor:
    """advantages - beta * kl_future (kl.gradient='sequence' in the loss: the future KL as a return,
    rl/objectives/kl_place.py); the advantages unchanged otherwise. Refuses a missing or misplaced `kl_future`."""
    wanted = kl_cfg is not None and kl_cfg.where == "loss" and kl_cfg.gradient == "sequence" and beta != 0.0
    if kl_future is None:
        if wanted:
            raise ValueError("kl.gradient='sequence' with kl.where='loss' needs `kl_future` "
                             "(rl.objectives.kl_place.future_kl of the rollout's per-token KL)")
        return advantages
    if not wanted:
        raise ValueError("kl_future is given but the KL is not in the loss with kl.gradient='sequence' and beta != 0 "
                         "(in the reward the future KL is already in the returns)")
    if kl_future.shape != advantages.shape:
        raise ValueError(f"kl_future has shape {tuple(kl_future.shape)}, the advantages {tuple(advantages.shape)}")
    return advantages - beta * sanitize(kl_future, m).detach().to(advantages.dtype)


def _masked_stats(x: torch.Tensor, m: torch.Tensor, empty: float) -> tuple[torch.Tensor, ...]:
    """(mean, min, max) of x over valid positions, detached; `empty` for all three when none."""
    if not m.any():
        return tuple(torch.tensor(empty, device=x.device) for _ in range(3))
    v = x.detach().float()[m]
    return v.mean(), v.min(), v.max()


def _surrogate_terms(logp, old_logp, advantages, m, clip_low, clip_high, dual_clip, log_ratio_clamp):
    """(per-token clipped loss, clipped flags, dual-clip flags, log_ratio), all [B, S], 0/False off
    the mask; inputs are sanitized at masked positions before any arithmetic."""
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
    return loss, clipped, dual, log_ratio


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
    loss, clipped, dual, log_ratio = _surrogate_terms(logp, old_logp, advantages, m, clip_low, clip_high, dual_clip,
                                                      log_ratio_clamp)
    dt = loss.dtype
    ratio = torch.exp(log_ratio)
    n = int(m.sum())
    lr = log_ratio.detach()
    r_mean, r_min, r_max = _masked_stats(ratio, m, 1.0)
    stats = {
        "clipfrac": clipped.sum().float() / max(n, 1),
        "dual_clipfrac": dual.sum().float() / max(n, 1),
        "ratio_mean": r_mean, "ratio_min": r_min, "ratio_max": r_max,
        "approx_kl_old": torch.where(m, torch.expm1(lr) - lr, torch.zeros((), dtype=dt, device=lr.device)).sum().float()
        / max(n, 1),
        "valid_tokens": torch.tensor(float(n), device=m.device),
    }
    return loss, stats


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, clip: float | None = 0.2) -> tuple[torch.Tensor, dict]:
    """PPO value loss per token: 0.5 * max((V - R)^2, (V_clip - R)^2),
    V_clip = V_old + clip(V - V_old, -clip, clip); clip=None: 0.5 * (V - R)^2.

    values (with grad), old_values, returns, mask: [B, S]. Returns (per-token [B, S] fp32, 0 masked; vf_clipfrac).
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

    policy: str = "ppo"  # one of POLICIES: the token-level PPO clip, GSPO's sequence ratio, CISPO's clipped weight
    clip_low: float = 0.2
    clip_high: float | None = None  # None: = clip_low; e.g. 0.28 for DAPO's clip-higher
    dual_clip: float | None = None  # e.g. 3.0
    agg: str = "token-mean"  # one of AGG_MODES
    norm_len: float | None = None  # seq-mean-token-sum-norm: the constant (max response length)
    entropy_coef: float = 0.0  # loss -= entropy_coef * entropy (the start value when entropy_target is set)
    entropy_target: float | None = None  # adapt the coefficient to hold the mean entropy here (nats/token)
    entropy_lr: float = 0.01  # coefficient change per step per nat of entropy error
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 0.1
    log_ratio_clamp: float = 20.0

    def __post_init__(self):
        if self.agg not in AGG_MODES or self.policy not in POLICIES:
            raise ValueError(f"loss.agg must be one of {AGG_MODES} and loss.policy one of {POLICIES}, got "
                             f"{self.agg!r}, {self.policy!r}")
        if self.agg == "seq-mean-token-sum-norm" and not (self.norm_len and self.norm_len > 0):
            raise ValueError("loss.agg='seq-mean-token-sum-norm' needs a positive loss.norm_len")
        if self.entropy_target is not None and not (self.entropy_target >= 0 and self.entropy_lr > 0 and
                                                    self.entropy_coef_min <= self.entropy_coef_max):
            raise ValueError(f"loss.entropy_target needs entropy_target >= 0, entropy_lr > 0 and entropy_coef_min <= "
                             f"entropy_coef_max, got {self.entropy_target}, {self.entropy_lr}, "
                             f"{self.entropy_coef_min}, {self.entropy_coef_max}")
        if not self.clip_low > 0 or (self.clip_high is not None and not self.clip_high > 0):
            raise ValueError(f"loss.clip_low/clip_high must be positive, got {self.clip_low}, "
                             f"{self.clip_high}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cfg: PolicyLossConfig | None = None, *,
                kl_cfg: KLConfig | None = None, beta: float = 0.0,
                ref_logp: torch.Tensor | None = None, kl: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, scale: LossScale | None = None,
                kl_future: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Surrogate + beta * KL + (-entropy_coef * entropy), each aggregated by `cfg.agg` with `scale`.

    All tensors [B, S]. The KL term enters when `kl_cfg.in_loss` (the KL in the loss, or the exact KL
    in the reward, whose pathwise part only the loss carries: rl/objectives/kl_place.py): from `kl` (a per-token
    KL with grad, e.g. the exact KL from the fused head; required when kl_cfg.exact) or else from
    `kl_estimate(logp, ref_logp)` with kl_cfg's estimator. With a sampled KL in the reward (or no kl_cfg)
    no KL term is added, but the KL is still reported when `kl` (or, unless kl_cfg.exact,
    `ref_logp`) is given. `kl_future` ([B, S], `rl.objectives.kl_place.future_kl` of the rollout's KL; needed with
    kl.gradient='sequence' in the loss): -beta * kl_future joins the advantages (the future KL as a return).
    `entropy` (with grad) is needed when cfg.entropy_coef != 0.
    Returns (loss: 0-d fp32 tensor with grad, stats: dict of detached 0-d tensors: pg_loss,
    kl_loss (the aggregated KL; scaled like the loss), entropy, clipfrac, dual_clipfrac,
    ratio_mean/min/max, approx_kl_old, valid_tokens).
    """
    cfg = cfg or PolicyLossConfig()
    advantages = _with_future_kl(advantages, mask.bool(), kl_cfg, beta, kl_future)
    pg, stats = clipped_surrogate(logp, old_logp, advantages, mask, cfg.clip_low, cfg.clip_high,
                                  cfg.dual_clip, cfg.log_ratio_clamp)
    agg = lambda x: aggregate(x, mask, cfg.agg, scale, cfg.norm_len)
    pg_loss = agg(pg)
    loss = pg_loss
    stats["pg_loss"] = pg_loss.detach()

    kl_in_loss = kl_cfg is not None and kl_cfg.in_loss
    exact = kl_cfg is not None and kl_cfg.exact
    if kl is not None or (ref_logp is not None and not exact):  # sanitized, importance-weighted
        kl = kl_loss_term(kl_cfg or KLConfig(), logp, ref_logp, old_logp, mask, kl)
    if kl_in_loss and kl is None:
        raise ValueError(f"policy_loss: kl.where={kl_cfg.where!r} needs the per-token `kl`" +
                         (" (kl.exact=True: the exact KL from the head)" if exact else " or `ref_logp`"))
    if kl is not None:
        kl_loss = agg(kl)
        stats["kl_loss"] = kl_loss.detach()
        if kl_in_loss and beta != 0.0:
            loss = loss + beta * kl_loss

    if cfg.entropy_coef != 0.0 and entropy is None:
        raise ValueError("policy_loss: loss.entropy_coef != 0 needs the per-token `entropy`")
    if entropy is not None:
        ent = agg(sanitize(entropy, mask.bool()))
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


class TokenPolicyLoss:
    """`policy_loss` as a per-token function, for `parallel.fused_loss.fused_head_loss` (which calls it
    chunk by chunk and forms the gradient in its forward pass) and for the unfused path (called once
    on every token). Summed over every token its values equal `policy_loss(...)`'s loss.

    weights, mask, old_logp, advantages, ref_logp: [B, S] (flattened here); `weights` from `token_weights`;
    `is_weights` (c_t on the policy-gradient term) and `kl_old` (log mu: the KL term's weight is pi/mu, not
    pi/old_logp) from rl/objectives/off_policy.py's `loss_inputs`; `is_weight_fn` in place of `is_weights` on
    the deferred rows (on_policy): c_t from this forward's own detached log-prob. Everything bound here and the
    head's values are sanitized at masked positions before any arithmetic: padding reaches no value and no gradient.
    `on_policy`: the first mini-batch after the rollout, whose old policy is the current one (old log-probs:
    the current ones, detached).

    Each call records its tokens' detached parts, so `stats()` needs no second evaluation."""

    _PARTS = ("pg", "kl", "entropy", "log_ratio", "clipped", "dual")

    def __init__(self, cfg: PolicyLossConfig, weights: torch.Tensor, mask: torch.Tensor, old_logp: torch.Tensor,
                 advantages: torch.Tensor, *, kl_cfg: KLConfig | None = None, beta: float = 0.0,
                 ref_logp: torch.Tensor | None = None, on_policy: bool = False, entropy_coef: float | None = None,
                 kl_future: torch.Tensor | None = None, is_weights: torch.Tensor | None = None,
                 kl_old: torch.Tensor | None = None, is_weight_fn=None):
        self.cfg, self.kl_cfg, self.beta, self.on_policy = cfg, kl_cfg, beta, on_policy
        self.c_fn = is_weight_fn  # deferred rows: c_t = fn(log pi_old - log mu, mask), pi_old this forward's own
        if is_weight_fn is not None and (not on_policy or kl_old is None):
            raise ValueError("TokenPolicyLoss: is_weight_fn needs on_policy=True (pi_old is this forward's "
                             "log-prob) and kl_old (log mu)")
        self.ent_coef = cfg.entropy_coef if entropy_coef is None else entropy_coef  # adaptive: the controller's
        self.m = mask.reshape(-1).bool()
        flat = lambda t: None if t is None else sanitize(t.reshape(-1), self.m).detach()  # noqa: E731
        self.w, self.old, self.adv, self.ref = flat(weights), flat(old_logp), flat(advantages), flat(ref_logp)
        self.c, self.kl_old = flat(is_weights), flat(kl_old)  # off-policy: rl/objectives/off_policy.py
        kl_future = None if kl_future is None else kl_future.reshape(-1)
        self.adv = _with_future_kl(self.adv, self.m, kl_cfg, beta, kl_future)
        self.kl_in_loss = kl_cfg is not None and kl_cfg.in_loss and beta != 0.0
        if self.kl_in_loss and not kl_cfg.exact and self.ref is None:
            raise ValueError("TokenPolicyLoss: kl.where='loss' with a sampled estimator needs `ref_logp`")
        self.rec = {k: torch.zeros(self.m.numel(), dtype=torch.float64, device=self.m.device) for k in self._PARTS}
        self.seen = {"kl": False, "entropy": False}

    def __call__(self, logp, entropy, kl, tokens):
        """This chunk's [c] head values (entropy/kl None if not asked) at `tokens` -> weighted loss [c]."""
        mm = self.m[tokens]
        logp = sanitize(logp, mm)
        o = logp.detach() if self.on_policy else self.old[tokens]
        pg, clipped, dual, lr = self._surrogate(logp, o, mm, tokens)
        if self.c_fn is not None:
            pg = pg * self.c_fn(o - self.kl_old[tokens], mm).to(pg.dtype)
        elif self.c is not None:
            pg = pg * self.c[tokens].to(pg.dtype)
        total = pg
        rec = {"pg": pg, "log_ratio": lr, "clipped": clipped, "dual": dual}
        kc = self.kl_cfg
        if kc is not None and (kl is not None if kc.exact else self.ref is not None):
            ref = None if self.ref is None else self.ref[tokens]
            klt = kl_loss_term(kc, logp, ref, o if self.kl_old is None else self.kl_old[tokens], mm,
                               None if kl is None else sanitize(kl, mm))
            rec["kl"], self.seen["kl"] = klt, True
            if self.kl_in_loss:
                total = total + self.beta * klt
        elif self.kl_in_loss:
            raise ValueError(f"TokenPolicyLoss: kl.exact=True with kl.where={kc.where!r} needs the head's exact KL")
        if entropy is not None:
            entropy = sanitize(entropy, mm)
            rec["entropy"], self.seen["entropy"] = entropy, True
        if self.ent_coef != 0.0:
            if entropy is None:
                raise ValueError("TokenPolicyLoss: loss.entropy_coef != 0 needs the per-token entropy")
            total = total - self.ent_coef * entropy
        for k, v in rec.items():
            self.rec[k][tokens] = v.detach().to(torch.float64)
        w = self.w[tokens].to(total.dtype)
        return torch.where(mm, total * w, torch.zeros((), dtype=total.dtype, device=total.device))

    def _surrogate(self, logp, old, mm, tokens):
        """(term, clip flags, dual flags, log-ratio) at `tokens`: PPO's; GSPO's, CISPO's: policy_objectives.py."""
        c = self.cfg
        return _surrogate_terms(logp, old, self.adv[tokens], mm, c.clip_low,
                                c.clip_low if c.clip_high is None else c.clip_high, c.dual_clip, c.log_ratio_clamp)

    def stats(self) -> dict:
        """`policy_loss`'s statistics over the tokens seen so far (pg_loss, kl_loss, entropy: weighted sums scaled
        like the loss; clipfrac, dual_clipfrac, ratio_mean/min/max, approx_kl_old, valid_tokens), floats."""
        m, w, r = self.m, self.w.to(torch.float64), self.rec
        n = int(m.sum())
        out = {"pg_loss": float((w * r["pg"]).sum())}
        for k in ("kl", "entropy"):
            if self.seen[k]:
                out["kl_loss" if k == "kl" else k] = float((w * r[k]).sum())
        lr = r["log_ratio"][m]
        ratio = lr.exp()
        out.update(clipfrac=float(r["clipped"].sum()) / max(n, 1), dual_clipfrac=float(r["dual"].sum()) / max(n, 1),
                   ratio_mean=float(ratio.mean()) if n else 1.0, ratio_min=float(ratio.min()) if n else 1.0,
                   ratio_max=float(ratio.max()) if n else 1.0,
                   approx_kl_old=float((torch.expm1(lr) - lr).sum()) / max(n, 1), valid_tokens=float(n))
        return out


def token_policy_loss(cfg: PolicyLossConfig, weights: torch.Tensor, mask: torch.Tensor, old_logp: torch.Tensor,
                      advantages: torch.Tensor, **kw) -> TokenPolicyLoss:
    """`TokenPolicyLoss(...)`: loss.policy=ppo's; every policy's: rl/objectives/policy_objectives.make_token_loss."""
    if cfg.policy != "ppo":
        raise ValueError(f"token_policy_loss is loss.policy=ppo's; for {cfg.policy!r} use make_token_loss")
    return TokenPolicyLoss(cfg, weights, mask, old_logp, advantages, **kw)
