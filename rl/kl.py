"""KL to the reference policy: sampled estimators, their configuration, masked fp32 aggregation.

Per response token, with `logp = log pi(x)` (policy) and `ref_logp = log pi_ref(x)` (reference),
both `[B, S]` and evaluated at the sampled token x ~ pi, and `log_ratio = logp - ref_logp`,
r = pi_ref(x) / pi(x) = exp(-log_ratio):

| estimator | value                                  | E_{x~pi}[value]      | gradient as a loss term (on-policy) |
|-----------|----------------------------------------|----------------------|-------------------------------------|
| `k1`      | log_ratio = -log r                     | KL(pi||ref), exactly | zero in expectation                 |
| `k2`      | 0.5 * log_ratio**2                     | biased (>= 0)        | grad KL(pi||ref)                    |
| `k3`      | (r - 1) - log r                        | KL(pi||ref), exactly | grad KL(ref||pi)  (the REVERSE KL)  |
| `k1+`     | value of k1, gradient of k2            | KL(pi||ref)          | grad KL(pi||ref)                    |
| `k3+`     | value of k3, gradient of k2            | KL(pi||ref)          | grad KL(pi||ref)                    |
| `low_var_kl` | k3 with clamps 20 (log-ratio) / 10 (value) unless given (verl's name) | | as k3 |

"Gradient as a loss term" means E_{x~pi}[grad_theta k(x)] with the sampling distribution held
fixed, which is what minimising `mean(k)` over on-policy samples does. k1's gradient is
E_pi[grad log pi] = 0; k2's is E_pi[log(pi/ref) grad log pi] = grad KL(pi||ref); k3's is
E_pi[(1 - r) grad log pi] = -E_ref[grad log pi] = grad KL(ref||pi). So k3 is a fine *value*
(unbiased, non-negative: use it for rewards and metrics) but optimises the reverse KL as a loss;
the straight-through variants `k1+`/`k3+` (value.detach() + k2 - k2.detach()) keep the value and take the
forward-KL gradient. tests/test_rl_kl.py checks every line of this table by exact enumeration.

`direction="reverse"` estimates KL(ref||pi) = E_pi[r log r] from the same on-policy samples:
`k1` -> r log r (unbiased, any sign), `k3` -> r log r - (r - 1) (unbiased, >= 0). The other
estimators have no reverse form here. The exact full-vocabulary KL (either direction) comes from
`parallel.vocab` / `parallel.fused`; `KLConfig.exact` selects it and this module then only
aggregates it.

Clamps (`log_ratio_clamp`, `value_clamp`) clip the log-ratio before and the value after the
estimator; clamped tokens get zero gradient through the clipped quantity. Computation is fp32
(or fp64 if the inputs are fp64) whatever the input dtype.

Aggregation (`masked_sum`, `masked_mean`, `kl_quantiles`, `kl_by_position`) reduces in fp32 over
valid tokens only and, given `dp_group`, over every DP rank (counted collectives), so metrics
describe the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel import comm

ESTIMATORS = ("k1", "k2", "k3", "k1+", "k3+", "low_var_kl")
REVERSE_ESTIMATORS = ("k1", "k3")


@dataclass
class KLConfig:
    """The `kl` section: how the KL to the reference is measured and where it enters."""

    estimator: str = "k3"  # one of ESTIMATORS (ignored when exact=True)
    exact: bool = False  # use the exact full-vocab KL from the vocab-parallel head instead
    direction: str = "forward"  # "forward" KL(pi||ref) | "reverse" KL(ref||pi)
    where: str = "loss"  # "loss": beta * KL term in the policy loss; "reward": -beta * KL per token
    log_ratio_clamp: float | None = None  # clip log(pi/ref) to [-c, c] before the estimator
    value_clamp: float | None = None  # clip the estimate to [-v, v]
    fp32: bool = True  # upcast to fp32 before computing (fp64 inputs stay fp64)

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"kl.estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if self.direction not in ("forward", "reverse"):
            raise ValueError(f"kl.direction must be 'forward' or 'reverse', got {self.direction!r}")
        if self.where not in ("loss", "reward"):
            raise ValueError(f"kl.where must be 'loss' or 'reward', got {self.where!r}")
        if self.direction == "reverse" and not self.exact and self.estimator not in REVERSE_ESTIMATORS:
            raise ValueError(f"kl.direction='reverse' with a sampled estimator needs kl.estimator in "
                             f"{REVERSE_ESTIMATORS}, got {self.estimator!r}")
        for name in ("log_ratio_clamp", "value_clamp"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"kl.{name} must be positive or null, got {v!r}")


def _upcast(t: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    if fp32 and t.dtype not in (torch.float32, torch.float64):
        return t.float()
    return t


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3",
                log_ratio_clamp: float | None = None, value_clamp: float | None = None,
                direction: str = "forward", fp32: bool = True) -> torch.Tensor:
    """Per-token sampled KL estimate.

    logp, ref_logp: [B, S] (any shape, equal), log-probs of the sampled tokens under the policy
    and the reference. Returns [B, S] in fp32 (fp64 for fp64 inputs). Padding positions are
    computed like any other; mask them when aggregating.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"kl_estimate: logp has shape {tuple(logp.shape)} but ref_logp has "
                         f"{tuple(ref_logp.shape)}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"kl_estimate: unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    if direction not in ("forward", "reverse"):
        raise ValueError(f"kl_estimate: direction must be 'forward' or 'reverse', got {direction!r}")
    if estimator == "low_var_kl":
        estimator = "k3"
        log_ratio_clamp = 20.0 if log_ratio_clamp is None else log_ratio_clamp
        value_clamp = 10.0 if value_clamp is None else value_clamp
    lr = _upcast(logp, fp32) - _upcast(ref_logp, fp32)  # log(pi / ref)
    if log_ratio_clamp is not None:
        lr = lr.clamp(-log_ratio_clamp, log_ratio_clamp)

    if direction == "reverse":
        if estimator not in REVERSE_ESTIMATORS:
            raise ValueError(f"kl_estimate: direction='reverse' supports {REVERSE_ESTIMATORS}, "
                             f"got {estimator!r}")
        r = torch.exp(-lr)  # ref / pi
        value = r * (-lr) if estimator == "k1" else r * (-lr) - (r - 1.0)
        return value.clamp(-value_clamp, value_clamp) if value_clamp is not None else value

    k2 = 0.5 * lr * lr
    if estimator in ("k1", "k1+"):
        value = lr
    elif estimator == "k2":
        value = k2
    else:  # k3, k3+
        value = torch.expm1(-lr) + lr  # (r - 1) - log r, with r - 1 computed accurately near 0
    if value_clamp is not None:
        value = value.clamp(-value_clamp, value_clamp)
    if estimator.endswith("+"):
        value = value.detach() + (k2 - k2.detach())  # value of k1/k3, gradient of k2 only
    return value


def kl_from_config(cfg: KLConfig, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """`kl_estimate` with the settings of a `KLConfig` (sampled estimators only)."""
    if cfg.exact:
        raise ValueError("kl.exact=True: the KL comes from the vocab-parallel head, not from "
                         "sampled log-probs; pass it in directly")
    return kl_estimate(logp, ref_logp, cfg.estimator, cfg.log_ratio_clamp, cfg.value_clamp,
                       cfg.direction, cfg.fp32)


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

    values, mask: [B, S]. Returns {"p50": .., "p90": .., "p99": .., "max": .., "count": n} with
    keys f"p{100*q:g}" (numpy's linear interpolation). Global over DP: every rank's valid values
    are gathered (O(tokens) floats, fine for a metric), so each rank returns the same exact
    numbers. No valid token anywhere: every statistic is 0.0 and count is 0.
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
        out.update(max=0.0, count=0)
        return out
    xs = torch.sort(local).values
    for q in qs:
        out[f"p{100 * q:g}"] = _quantile_sorted(xs, q)
    out["max"] = float(xs[-1])
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
