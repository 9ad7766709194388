"""KL to the reference policy: sampled estimators, their configuration, masked fp32 aggregation.

Per response token, with `logp = log pi(x)` (policy) and `ref_logp = log pi_ref(x)` (reference),
both `[B, S]` and evaluated at the sampled token x, `log_ratio = logp - ref_logp` and
r = pi_ref(x) / pi(x) = exp(-log_ratio). Directions are named by their arguments, in order:
`pi_ref` is KL(pi||ref) = E_pi[log(pi/ref)] (what most RL-for-LLM papers call the reverse KL),
`ref_pi` is KL(ref||pi) = E_pi[r log r] (their forward KL). The old names `forward` / `reverse` are
refused with an error naming the new one.

| estimator    | value (direction pi_ref)         | E_pi[value] | as a loss term (on-policy) | as a reward   |
|--------------|----------------------------------|-------------|----------------------------|---------------|
| `k1`         | log_ratio = -log r               | KL(pi||ref) | zero in expectation        | seq. (default)|
| `k2`         | 0.5 * log_ratio**2               | biased >= 0 | tok. KL(pi||ref)           | refused       |
| `k3`         | (r - 1) - log r                  | KL(pi||ref) | tok. KL(ref||pi)           | refused       |
| `k1+`        | value of k1, gradient of k2      | KL(pi||ref) | tok. KL(pi||ref)           | seq. (as k1)  |
| `k3+`        | value of k3, gradient of k2      | KL(pi||ref) | tok. KL(pi||ref) (default) | refused       |
| `low_var_kl` | k3, clamps 20 (log-ratio) / 10 (value) unless given (verl's name) | | as k3 | refused       |
| exact        | the full-vocabulary KL per position | the KL    | tok. KL of its direction   | seq. (*)      |

"tok." is the per-token gradient with the prefix held fixed, E[sum_t grad KL_t(prefix)]; "seq." the
gradient of the response-level KL(pi||ref) = E[sum_t log(pi/ref)] (what `kl_mean` reports per token);
(*) the exact KL's current-token (pathwise) part then goes into the loss (`KLConfig.in_loss`).
tok. and seq. differ by the future KL's score-function term; `kl.gradient=sequence` adds it in the loss (k1+,
k3+, exact; k1/k3 with is_weight=live), and rl/objectives/kl_place.py derives every row and says why the
refused ones follow no KL. `kl.direction=ref_pi` goes in the loss only (tok. KL(ref||pi)).

"Gradient as a loss term" means E_{x~pi}[grad_theta k(x)] with the sampling distribution held
fixed, which is what minimising `mean(k)` over on-policy samples does. k1's gradient is
E_pi[grad log pi] = 0; k2's is E_pi[log(pi/ref) grad log pi] = grad KL(pi||ref); k3's is
E_pi[(1 - r) grad log pi] = -E_ref[grad log pi] = grad KL(ref||pi). So plain k3 is a fine *value*
(unbiased, non-negative) but optimises KL(ref||pi) as a loss (logged once when asked for); the
straight-through variants `k1+`/`k3+` (value.detach() + k2 - k2.detach()) keep the value and take
the gradient of KL(pi||ref). `value_clamp` bounds both their value (to [-v, v]) and their
per-token gradient coefficient d/dlogp (log_ratio clamped to [-v, v], so |grad| <= v |grad logp|).

`direction="ref_pi"` estimates KL(ref||pi) from the same samples: `k1` -> r log r (unbiased, any
sign), `k3` -> r log r - (r - 1) (unbiased, >= 0), each with a straight-through gradient
-r * grad log pi, whose expectation is grad KL(ref||pi). The exact full-vocabulary KL (either
direction) comes from `parallel.vocab` / `parallel.fused`; `KLConfig.exact` selects it.

Off-policy (algo.epochs x algo.mini_batches > 1): after the first mini-batch the tokens come from
pi_old, not pi. `kl_loss_term` multiplies the loss term by the token-level importance weight
w = pi/pi_old, clamped to at most `is_ratio_max`: `is_weight="detached"` (default) keeps every
estimator's on-policy gradient exactly, off-policy too (E_old[w grad k] = E_pi[grad k]);
`"live"` (gradient through w; DeepSeek-V3.2 / TRL's bias-corrected k3) turns k1 and k3 into
differentiable unbiased estimates of KL(pi||ref), whose gradient is grad KL(pi||ref) on- and
off-policy; `"none"` leaves the term unweighted (biased off-policy). tests/test_kl_table.py
checks every estimator x place x weight by exact enumeration on one token (on- and off-policy),
tests/test_kl_sequence.py every allowed row over whole responses (tok. vs seq.).

Masked positions (padding) never reach a value or a gradient: with `mask`, the inputs there are
replaced by a constant before any arithmetic, so NaN or inf in the padding cannot leak.
Computation is fp32 (or fp64 if the inputs are fp64) whatever the input dtype.

Aggregation (`masked_sum`, `masked_mean`, `kl_quantiles`, `kl_by_position`) reduces in fp32 over
valid tokens only and, given `dp_group`, over every DP rank (counted collectives), so metrics
describe the whole batch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from parallel import comm
from rl.objectives.kl_place import GRADIENTS, default_estimator, reward_error, sequence_gradient_error

ESTIMATORS = ("k1", "k2", "k3", "k1+", "k3+", "low_var_kl")
DIRECTIONS = ("pi_ref", "ref_pi")  # KL(pi||ref), KL(ref||pi)
OLD_DIRECTIONS = {"forward": "pi_ref", "reverse": "ref_pi"}
REVERSE_ESTIMATORS = ("k1", "k3")  # sampled estimators of KL(ref||pi)
IS_WEIGHTS = ("none", "detached", "live")
LIVE_ESTIMATORS = ("k1", "k3", "low_var_kl")  # where a live ratio gives an exact gradient
HEAD_DIRECTION = {"pi_ref": "forward", "ref_pi": "reverse"}  # parallel.vocab's names for the exact KL

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()


def check_direction(direction: str, where: str) -> str:
    """`direction` if valid; the old names raise an error that gives the new one."""
    if direction in OLD_DIRECTIONS:
        raise ValueError(f"{where}={direction!r} is no longer accepted (it was easy to misread): use "
                         f"{OLD_DIRECTIONS[direction]!r} (= KL({'pi||ref' if direction == 'forward' else 'ref||pi'}))")
    if direction not in DIRECTIONS:
        raise ValueError(f"{where} must be one of {DIRECTIONS} (KL(pi||ref), KL(ref||pi)), got {direction!r}")
    return direction


def loss_gradient(estimator: str, direction: str = "pi_ref", is_weight: str = "detached") -> str:
    """What minimising the KL term in the loss follows in expectation, on- and off-policy (with the
    importance weight): 'grad KL(pi||ref)', 'grad KL(ref||pi)' or 'zero'."""
    if direction == "ref_pi":
        return "grad KL(ref||pi)"
    if is_weight == "live":
        return "grad KL(pi||ref)"
    return {"k1": "zero", "k3": "grad KL(ref||pi)", "low_var_kl": "grad KL(ref||pi)"}.get(estimator,
                                                                                         "grad KL(pi||ref)")


@dataclass
class KLConfig:
    """The `kl` section: how the KL to the reference is measured, where it enters, which gradient it follows."""

    # one of ESTIMATORS (ignored when exact=True); null: by place (rl.objectives.kl_place.default_estimator): k1 in
    # the reward, k3+ in the loss (k3 for ref_pi or is_weight=live)
    estimator: str | None = None
    exact: bool = False  # use the exact full-vocab KL from the vocab-parallel head instead
    direction: str = "pi_ref"  # "pi_ref": KL(pi||ref) | "ref_pi": KL(ref||pi)
    # "loss": beta * KL term in the policy loss; "reward": -beta * KL per token; "auto" (resolved by
    # rl.config.RLConfig): reward for PPO, loss for GRPO (a bare KLConfig treats "auto" as "loss")
    where: str = "auto"
    # "token": the per-position KL's gradient with the prefix held fixed (the loss term alone);
    # "sequence": the gradient of the response-level KL (the loss: the future KL joins each token's
    # advantage; the reward: always). null: sequence in the reward, token in the loss (rl/objectives/kl_place.py)
    gradient: str | None = None
    log_ratio_clamp: float | None = None  # clip log(pi/ref) to [-c, c] before the estimator
    value_clamp: float | None = None  # clip the estimate to [-v, v]; k1+/k3+: also d/dlogp to [-v, v]
    fp32: bool = True  # upcast to fp32 before computing (fp64 inputs stay fp64)
    # importance weight w = pi/pi_old on each token's KL loss term (sampled, where=loss): "detached"
    # keeps each estimator's on-policy gradient exactly off-policy; "live" (k1, k3 only) makes the
    # gradient that of KL(pi||ref); "none": unweighted (biased after the first mini-batch)
    is_weight: str = "detached"
    is_ratio_max: float = 10.0  # w is clamped to at most this (a clamped token keeps w, loses w's grad)

    def __post_init__(self):
        if self.estimator is not None and self.estimator not in ESTIMATORS:
            raise ValueError(f"kl.estimator must be one of {ESTIMATORS} or null, got {self.estimator!r}")
        check_direction(self.direction, "kl.direction")
        if self.where not in ("loss", "reward", "auto"):
            raise ValueError(f"kl.where must be 'loss', 'reward' or 'auto', got {self.where!r}")
        if self.gradient is not None and self.gradient not in GRADIENTS:
            raise ValueError(f"kl.gradient must be one of {GRADIENTS} or null, got {self.gradient!r}")
        for name in ("log_ratio_clamp", "value_clamp"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"kl.{name} must be positive or null, got {v!r}")
        if self.is_weight not in IS_WEIGHTS:
            raise ValueError(f"kl.is_weight must be one of {IS_WEIGHTS}, got {self.is_weight!r}")
        if not self.is_ratio_max >= 1.0:
            raise ValueError(f"kl.is_ratio_max must be >= 1, got {self.is_ratio_max!r}")
        self.where_auto = self.where == "auto"  # RLConfig then picks the place by algorithm
        self.estimator_auto, self.gradient_auto = self.estimator is None, self.gradient is None
        self.place("loss" if self.where_auto else self.where, warn=not self.where_auto)

    def place(self, where: str, warn: bool = True) -> None:
        """Put the KL in `where` ("loss" | "reward"): resolve the estimator and gradient left unset, and
        refuse a combination whose gradient follows no KL (rl/objectives/kl_place.py), naming its keys."""
        self.where = where
        if self.estimator_auto:
            self.estimator = default_estimator(where, self.direction, self.is_weight)
        if self.gradient_auto:
            self.gradient = "sequence" if where == "reward" else "token"
        if self.direction == "ref_pi" and not self.exact and self.estimator not in REVERSE_ESTIMATORS:
            raise ValueError(f"kl.direction='ref_pi' with a sampled estimator needs kl.estimator in "
                             f"{REVERSE_ESTIMATORS}, got {self.estimator!r}")
        if self.is_weight == "live" and not self.exact and (self.estimator not in LIVE_ESTIMATORS
                                                            or self.direction != "pi_ref"):
            raise ValueError(f"kl.is_weight='live' gives a biased gradient with kl.estimator={self.estimator!r}, "
                             f"kl.direction={self.direction!r}: use it with kl.estimator in {LIVE_ESTIMATORS} and "
                             f"kl.direction='pi_ref', or kl.is_weight='detached'")
        if where == "reward":
            err = reward_error(self.estimator, self.direction, self.exact, self.gradient)
        elif self.gradient == "sequence":
            err = sequence_gradient_error(self.estimator, self.direction, self.exact,
                                          loss_gradient(self.estimator, self.direction, self.is_weight))
        else:
            err = None
        if err:
            raise ValueError(err)
        if warn and where == "loss" and not self.exact and self.direction == "pi_ref" and \
                self.estimator in ("k1", "k3", "low_var_kl"):
            msg = (f"kl.estimator={self.estimator!r} in the loss (kl.is_weight={self.is_weight!r}, "
                   f"kl.direction={self.direction!r}): its gradient is "
                   f"{loss_gradient(self.estimator, self.direction, self.is_weight)}")
            if msg not in _LOGGED:
                _LOGGED.add(msg)
                log.warning("%s; k3+ (the loss's default) follows grad KL(pi||ref)", msg)

    @property
    def in_loss(self) -> bool:
        """Whether the policy loss carries a KL term with a gradient: the KL in the loss, or the exact KL
        in the reward, whose current-token (pathwise) part only the loss can carry (rl/objectives/kl_place.py)."""
        return self.where == "loss" or (self.where == "reward" and self.exact)


def _upcast(t: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    if fp32 and t.dtype not in (torch.float32, torch.float64):
        return t.float()
    return t


def sanitize(t: torch.Tensor, mask: torch.Tensor | None, fill: float = 0.0) -> torch.Tensor:
    """`t` with masked-out positions (mask false) replaced by `fill` before any arithmetic: whatever
    they held (NaN, inf), they reach no value and no gradient (torch.where passes 0 there)."""
    if mask is None:
        return t
    if mask.shape != t.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but the values have {tuple(t.shape)}")
    return torch.where(mask.bool(), t, torch.full((), fill, dtype=t.dtype, device=t.device))


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3+",
                log_ratio_clamp: float | None = None, value_clamp: float | None = None,
                direction: str = "pi_ref", fp32: bool = True, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token sampled KL estimate.

    logp, ref_logp: [B, S] (any shape, equal), log-probs of the sampled tokens under the policy
    and the reference; mask (optional, same shape): where false the result is exactly 0 with zero
    gradient, whatever the inputs hold. Returns [B, S] in fp32 (fp64 for fp64 inputs).
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"kl_estimate: logp has shape {tuple(logp.shape)} but ref_logp has "
                         f"{tuple(ref_logp.shape)}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"kl_estimate: unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    check_direction(direction, "kl_estimate: direction")
    if estimator == "low_var_kl":
        estimator = "k3"
        log_ratio_clamp = 20.0 if log_ratio_clamp is None else log_ratio_clamp
        value_clamp = 10.0 if value_clamp is None else value_clamp
    lr = sanitize(_upcast(logp, fp32), mask) - sanitize(_upcast(ref_logp, fp32), mask)  # log(pi / ref)
    if log_ratio_clamp is not None:
        lr = lr.clamp(-log_ratio_clamp, log_ratio_clamp)

    if direction == "ref_pi":
        if estimator not in REVERSE_ESTIMATORS:
            raise ValueError(f"kl_estimate: direction='ref_pi' supports {REVERSE_ESTIMATORS}, got {estimator!r}")
        r = torch.exp(-lr)  # ref / pi
        value = r * (-lr) if estimator == "k1" else r * (-lr) - (r - 1.0)
        if value_clamp is not None:
            value = value.clamp(-value_clamp, value_clamp)
        # value of the estimator, gradient -r grad log pi: E_pi of it is grad KL(ref||pi)
        return value.detach() - r.detach() * (lr - lr.detach())

    if estimator in ("k1", "k1+"):
        value = lr
    elif estimator == "k2":
        value = 0.5 * lr * lr
    else:  # k3, k3+
        value = torch.expm1(-lr) + lr  # (r - 1) - log r, with r - 1 computed accurately near 0
    if value_clamp is not None:
        value = value.clamp(-value_clamp, value_clamp)
    if estimator.endswith("+"):  # value of k1/k3, gradient of k2 (d/dlogp = log_ratio, bounded by value_clamp)
        g = lr.detach() if value_clamp is None else lr.detach().clamp(-value_clamp, value_clamp)
        value = value.detach() + g * (lr - lr.detach())
    return value


def kl_from_config(cfg: KLConfig, logp: torch.Tensor, ref_logp: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """`kl_estimate` with the settings of a `KLConfig` (sampled estimators only)."""
    if cfg.exact:
        raise ValueError("kl.exact=True: the KL comes from the vocab-parallel head, not from "
                         "sampled log-probs; pass it in directly")
    return kl_estimate(logp, ref_logp, cfg.estimator, cfg.log_ratio_clamp, cfg.value_clamp,
                       cfg.direction, cfg.fp32, mask)


def kl_loss_term(cfg: KLConfig, logp: torch.Tensor, ref_logp: torch.Tensor | None,
                 old_logp: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 kl: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token KL term of the loss [B, S]: the estimate (or the exact `kl` from the head)
    times the importance weight w = min(pi/pi_old, is_ratio_max) as `cfg.is_weight` says.
    The sampled estimate needs `ref_logp`; the weight needs `old_logp` (None: no weight, on-policy).
    The exact KL is a full-vocabulary expectation at each position: no token weight applies."""
    if cfg.exact:
        if kl is None:
            raise ValueError("kl_loss_term: kl.exact=True needs the exact per-token `kl` from the head")
        return sanitize(_upcast(kl, cfg.fp32), mask)
    k = kl_from_config(cfg, logp, ref_logp, mask)
    if cfg.is_weight == "none" or old_logp is None:
        return k
    lw = sanitize(_upcast(logp, cfg.fp32), mask) - sanitize(_upcast(old_logp, cfg.fp32), mask)
    w = torch.exp(lw.clamp(max=math.log(cfg.is_ratio_max)))
    return (w.detach() if cfg.is_weight == "detached" else w) * k


# ---------------------------------------------------------------------------------------------
# masked aggregation (fp32)


def _check_mask(values: torch.Tensor, mask: torch.Tensor, where: str) -> torch.Tensor:
    if values.shape != mask.shape:
        raise ValueError(f"{where}: values have shape {tuple(values.shape)} but mask has "
                         f"{tuple(mask.shape)}")
    return mask.bool()


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
               dp_group=None) -> torch.Tensor:
    """Sum of `values` over positions where `mask` is true, in fp32 (fp64 stays fp64).

    values, mask: [B, S]. dim=None sums everything (then, with `dp_group`, also over DP ranks,
    as a detached metric); otherwise sums along `dim` locally. Masked positions contribute exactly 0 even if they hold
    NaN or inf.
    """
    m = _check_mask(values, mask, "masked_sum")
    v = torch.where(m, _upcast(values), torch.zeros((), dtype=_upcast(values).dtype, device=values.device))
    if dim is not None:
        return v.sum(dim)
    s = v.sum()
    if comm.group_size(dp_group) > 1:
        s = comm.all_reduce(s.detach().clone(), "sum", dp_group)  # sum of every rank's masked sum
    return s


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                dp_group=None) -> torch.Tensor:
    """Mean of `values` over valid positions, fp32. An empty selection gives 0 (not NaN).

    dim=None: the mean over all valid tokens, and with `dp_group` over all valid tokens of every
    DP rank (a metric: the result is detached). With `dim`: the local per-row mean along `dim`.
    """
    m = _check_mask(values, mask, "masked_mean")
    v = torch.where(m, _upcast(values), torch.zeros((), dtype=_upcast(values).dtype, device=values.device))
    if dim is not None:
        return v.sum(dim) / m.sum(dim).clamp(min=1).to(v.dtype)
    if comm.group_size(dp_group) > 1:
        sc = torch.stack([v.sum().detach(), m.sum().to(v.dtype)])
        comm.all_reduce(sc, "sum", dp_group)  # [sum of valid values, valid-token count] over DP
        return sc[0] / sc[1].clamp(min=1)
    return v.sum() / m.sum().clamp(min=1).to(v.dtype)


def _quantile_sorted(xs: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of an ascending 1-D tensor."""
    pos = q * (xs.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, xs.numel() - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def kl_quantiles(values: torch.Tensor, mask: torch.Tensor, qs=(0.5, 0.9, 0.99),
                 dp_group=None) -> dict[str, float]:
    """Quantiles and max of `values` over all valid tokens (of every DP rank, given dp_group).

    values, mask: [B, S]. Returns {"p50": .., "p90": .., "p99": .., "max": .., "top1_share": ..,
    "count": n} with keys f"p{100*q:g}" (numpy's linear interpolation); top1_share is the share of
    the positive KL mass (sum of max(v, 0)) carried by the ceil(1%) largest tokens (0 without any).
    Global over DP: every rank's valid values are gathered (O(tokens) floats, fine for a metric), so
    each rank returns the same exact numbers. No valid token anywhere: every statistic is 0.0 and
    count is 0.
    """
    m = _check_mask(values, mask, "kl_quantiles")
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"kl_quantiles: quantile {q} is outside [0, 1]")
    local = values.detach().float()[m]
    if comm.group_size(dp_group) > 1:
        n = torch.tensor([local.numel()], dtype=torch.int64, device=values.device)
        comm.all_reduce(n, "max", dp_group)  # longest per-rank list, so the gather has one shape
        pad = torch.full((int(n.item()) - local.numel(),), float("nan"), device=values.device)
        # every rank's valid values, NaN-padded to a common length
        allv = comm.all_gather_along(torch.cat([local, pad]), 0, dp_group)
        local = allv[~torch.isnan(allv)]
    out: dict[str, float] = {}
    if local.numel() == 0:
        out = {f"p{100 * q:g}": 0.0 for q in qs}
        out.update(max=0.0, top1_share=0.0, count=0)
        return out
    xs = torch.sort(local).values
    for q in qs:
        out[f"p{100 * q:g}"] = _quantile_sorted(xs, q)
    out["max"] = float(xs[-1])
    pos = xs.double().clamp(min=0)
    total = float(pos.sum())
    out["top1_share"] = float(pos[-math.ceil(0.01 * xs.numel()):].sum()) / total if total > 0 else 0.0
    out["count"] = int(xs.numel())
    return out


def kl_by_position(values: torch.Tensor, mask: torch.Tensor, n_buckets: int,
                   max_len: int | None = None, dp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean KL per response-position bucket, for a position heatmap (one row per step).

    values, mask: [B, S], column s = response position s (responses start at column 0).
    Position s falls in bucket floor(s * n_buckets / L), L = max_len or S; give the same
    `max_len` (e.g. the max response length) on every rank so buckets agree across DP.
    Returns (mean [n_buckets] fp32, count [n_buckets] fp32), summed over DP ranks given dp_group;
    empty buckets have mean 0 and count 0.
    """
    m = _check_mask(values, mask, "kl_by_position")
    if n_buckets < 1:
        raise ValueError(f"kl_by_position: n_buckets must be >= 1, got {n_buckets}")
    S = values.shape[-1]
    L = S if max_len is None else max_len
    if S > L:
        raise ValueError(f"kl_by_position: responses have {S} columns but max_len={L}")
    bucket = torch.arange(S, device=values.device) * n_buckets // L  # [S]
    v = torch.where(m, values.detach().float(), torch.zeros((), device=values.device))
    sums = torch.zeros(2, n_buckets, device=values.device)
    sums[0].index_add_(0, bucket, v.reshape(-1, S).sum(0))
    sums[1].index_add_(0, bucket, m.reshape(-1, S).sum(0).float())
    comm.all_reduce(sums, "sum", dp_group)  # [per-bucket KL sum, per-bucket token count] over DP
    return sums[0] / sums[1].clamp(min=1), sums[1]
