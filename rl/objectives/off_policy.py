"""Off-policy corrections: samples drawn by a behaviour policy mu that is not the policy the clip is taken against.

Three policies, by the role each plays in one update (docs/off_policy.md):

| name   | what it is                                                         | where kltron gets its log-probs        |
|--------|--------------------------------------------------------------------|----------------------------------------|
| mu     | behaviour: the weights (policy_version) and sampler that drew the  | the rollout records them:              |
|        | tokens (`algo.off_policy.behaviour`: its tempered distribution, or | `StepData.rollout_logprobs` (or        |
|        | the truncated one actually sampled)                                | `rollout_sampled_logprobs`)            |
| pi_old | proximal: the clip is taken against it; the current weights before | the old-log-prob pass recomputes them  |
|        | the update (what the first mini-batch's ratio 1 is measured from)  | (`StepData.old_logp`)                  |
| pi     | current: the weights being trained, with gradient                 | the update's own forward               |

A synchronous run has mu = pi_old up to numerics (kernels, batch shape, precision) and the sampler's truncation;
one version stale (one-step-off), mu is the previous step's weights. With the token ratio
rho_t = pi_old(y_t) / mu(y_t) (detached), A the advantage, r_t = pi(y_t) / pi_old(y_t), the policy-gradient term
of token t is c_t * PPOclip(r_t, A) and `algo.off_policy.correction` chooses c_t (C = `algo.off_policy.cap`):

| correction | c_t                                                           | source                                 |
|------------|---------------------------------------------------------------|----------------------------------------|
| none       | 1; at algo.max_staleness > 0 the clip is on pi/mu (no recompute) | naive PPO (AReaL's baseline)        |
| tis        | min(rho_t, C)                                                 | Yao et al. 2025, "Your efficient RL    |
|            |                                                               | framework secretly brings you          |
|            |                                                               | off-policy RL training"; verl's        |
|            |                                                               | rollout correction (token IS)          |
| seq_tis    | min(prod_t rho_t, C), one weight per response                 | verl's rollout correction (seq. IS)    |
| mis        | rho_t if 1/C <= rho_t <= C, else 0 (the token is dropped)     | verl's rollout correction (masked IS)  |
| geo_rs     | min(rho_t, C) if 1/C <= exp(mean_t log rho_t) <= C, else 0    | verl's rollout correction: geometric-  |
|            | (the whole response rejected)                                 | mean rejection, with token TIS         |
| decoupled  | rho_t (untruncated; with C set, tokens with rho_t > C dropped) | Hilton et al. 2021, "Batch size-      |
|            |                                                               | invariance for policy optimization";   |
|            |                                                               | AReaL (behav_imp_weight_cap)           |

Every c_t is detached. `decoupled` is the unbiased one: E_mu[rho_t f] = E_pi_old[f]; the truncated and masked
forms trade that bias for bounded variance (geo_rs rejects whole responses whose mean log-ratio is far, and
weighs the rest as tis does, so with nothing rejected or truncated it is the decoupled objective). In the
synchronous run (max_staleness = 0) `none` keeps today's objective exactly (clip on pi/pi_old, mu only
measured); every other correction needs the rollout's log-probs. The token-level ones (tis, mis, decoupled) read
token t's pi_old alone, so the rows whose pi_old is the update's own first forward (`algo.old_from_update`) get
c_t inside the loss from that forward's detached log-prob (`token_correction`), with no old-log-prob pass over
them; seq_tis and geo_rs weigh a row by all its tokens' pi_old, so the old pass then defers no row. The KL
term of the loss is weighted by pi/mu whenever mu is not pi_old (`kl_old`): the KL-under-staleness table
(docs/off_policy.md, tests/test_kl_staleness.py) is why.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parallel import comm

CORRECTIONS = ("none", "tis", "seq_tis", "mis", "geo_rs", "decoupled")
TOKEN_LEVEL = ("tis", "mis", "decoupled")  # c_t reads token t's pi_old alone
BEHAVIOURS = ("tempered", "sampled")  # which recorded log-prob is log mu (OffPolicyConfig.behaviour)
DEFAULT_CAP = {"tis": 2.0, "seq_tis": 2.0, "mis": 2.0, "geo_rs": 2.0, "decoupled": None, "none": None}
LOG_RHO_CLAMP = 20.0  # log rho is clamped to +-20 before exp (as loss.log_ratio_clamp does the clip's ratio)

log = logging.getLogger(__name__)
_WARNED: set[str] = set()


@dataclass
class OffPolicyConfig:
    """The `algo.off_policy` section: how samples drawn by mu != pi_old are corrected (module docstring)."""

    correction: str = "none"  # one of CORRECTIONS
    # C: tis / seq_tis truncate at C, mis / geo_rs keep ratios in [1/C, C], decoupled drops tokens above C;
    # null: 2.0 (verl's default threshold) for tis, seq_tis, mis, geo_rs; untruncated for decoupled
    cap: float | None = None
    # which recorded log-prob is log mu: "tempered" (StepData.rollout_logprobs: the behaviour weights' tempered
    # full-vocabulary distribution; corrects stale weights and numerics, as verl's rollout log-probs do) or
    # "sampled" (rollout_sampled_logprobs: the top-k / top-p / min-p truncated distribution actually drawn from;
    # also reweights by the sampler's truncation, rho_t <= kept mass on every token)
    behaviour: str = "tempered"

    def __post_init__(self):
        if self.correction not in CORRECTIONS:
            raise ValueError(f"algo.off_policy.correction must be one of {CORRECTIONS}, got {self.correction!r}")
        if self.behaviour not in BEHAVIOURS:
            raise ValueError(f"algo.off_policy.behaviour must be one of {BEHAVIOURS}, got {self.behaviour!r}")
        if self.correction == "none" and self.cap is not None:
            raise ValueError(f"algo.off_policy.cap={self.cap} with algo.off_policy.correction='none': the cap "
                             f"belongs to a correction; unset it or choose one of {CORRECTIONS[1:]}")
        if self.cap is None:
            self.cap = DEFAULT_CAP[self.correction]
        if self.cap is not None and not self.cap > 1.0:
            raise ValueError(f"algo.off_policy.cap must be > 1 (the band is [1/C, C]), got {self.cap!r}")


def check_off_policy(cfg) -> None:
    """Start-up checks of algo.off_policy and algo.max_staleness against the rest of an RLConfig `cfg`: refuse
    what would be silently biased, naming the keys; warn (once) for naive PPO at staleness."""
    a, k = cfg.algo, cfg.kl
    op = a.off_policy
    if a.max_staleness > 0 and k.where == "loss" and not k.exact and k.is_weight == "none":
        raise ValueError(f"kl.is_weight='none' with kl.where='loss' and algo.max_staleness={a.max_staleness}: stale "
                         f"samples come from mu, not pi, so the unweighted KL term's gradient follows no KL "
                         f"(docs/off_policy.md, the KL-under-staleness table); use kl.is_weight='detached' (the term "
                         f"is then weighted by pi/mu) or 'live'")
    if op.correction != "none" and cfg.kl_ctl.mode == "grad_ratio":
        raise ValueError(f"kl_ctl.mode='grad_ratio' balances the unweighted policy-gradient and KL terms; with "
                         f"algo.off_policy.correction={op.correction!r} the loss weighs them by the correction: use "
                         f"kl_ctl.mode='fixed' or 'adaptive'")
    if op.correction != "none" and a.name == "distill":
        raise ValueError("algo.off_policy.correction with algo.name='distill': the distillation term has no "
                         "behaviour-policy weight; use algo.off_policy.correction='none'")
    if a.max_staleness > 0 and (k.where == "reward" or k.gradient == "sequence"):
        _warn_once(f"algo.max_staleness={a.max_staleness} with kl.where={k.where!r}, kl.gradient={k.gradient!r}: the "
                   f"KL summed into each token's return runs over mu's continuation, which the token weights do "
                   f"not correct (exact per position only; docs/off_policy.md, 'The KL under staleness')")
    if a.max_staleness > 0 and op.correction == "none":
        msg = (f"algo.max_staleness={a.max_staleness} with algo.off_policy.correction='none': naive PPO, the clip "
               f"is taken on pi/mu around a policy up to {a.max_staleness} versions old and nothing corrects for it "
               f"(AReaL's baseline); algo.off_policy.correction='decoupled' (or tis) recomputes pi_old and weighs "
               f"by pi_old/mu")
        _warn_once(msg)


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        log.warning(msg)


def behaviour_logprobs(data, behaviour: str = "tempered") -> torch.Tensor | None:
    """log mu at each response token [B, N] from a StepData-like `data` (OffPolicyConfig.behaviour): "tempered"
    the rollout's tempered full-vocabulary log-prob (`rollout_logprobs`), "sampled" the truncated distribution
    the sampler drew from (`rollout_sampled_logprobs`, the same without a truncating sampler); None if the
    rollout recorded neither."""
    first, second = ("rollout_logprobs", "rollout_sampled_logprobs")[::1 if behaviour == "tempered" else -1]
    mu = getattr(data, first, None)
    return mu if mu is not None else getattr(data, second, None)


def _rows_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1, keepdim=True)


def correction_weights(cfg: OffPolicyConfig, old_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """c_t of `cfg.correction` (module docstring) for every response token.

    old_logp (log pi_old), behaviour_logp (log mu), mask: [B, N], one response per row. Returns (c [B, N]
    float64, detached, 0 off the mask; this rank's sums for `weight_metrics`: tokens, sum/max of c,
    tokens dropped (c = 0 by a mask or rejection), tokens truncated (c = C), responses, responses rejected).
    `none` gives c = 1 on the mask."""
    if not (old_logp.shape == behaviour_logp.shape == mask.shape) or mask.dim() != 2:
        raise ValueError(f"correction_weights: old_logp {tuple(old_logp.shape)}, behaviour_logp "
                         f"{tuple(behaviour_logp.shape)} and mask {tuple(mask.shape)} must be equal [B, N] shapes")
    m = mask.bool()
    dt, dev = torch.float64, mask.device
    zero = torch.zeros((), dtype=dt, device=dev)
    lr = torch.where(m, old_logp.detach().to(dt) - behaviour_logp.detach().to(dt), zero)  # log rho, 0 off the mask
    lr = lr.clamp(-LOG_RHO_CLAMP, LOG_RHO_CLAMP)
    C = cfg.cap
    logc = math.log(C) if C is not None else math.inf
    truncated = torch.zeros_like(m)
    rows = m.any(-1, keepdim=True)
    rejected = torch.zeros_like(rows)
    kind = cfg.correction
    if kind == "none":
        c = torch.ones_like(lr)
    elif kind in TOKEN_LEVEL:
        c, truncated = _token_c(kind, lr, logc), (lr > logc) if kind == "tis" else truncated
    elif kind == "seq_tis":
        s = _rows_sum(lr, m)  # log prod_t rho_t per response
        c, truncated = s.clamp(max=logc).exp().expand_as(lr), (s > logc).expand_as(m)
    elif kind == "geo_rs":
        g = _rows_sum(lr, m) / m.sum(-1, keepdim=True).clamp(min=1)  # log of the geometric-mean ratio
        rejected = (g.abs() > logc) & rows
        c, truncated = torch.where(rejected, zero, lr.clamp(max=logc).exp()), (lr > logc) & ~rejected
    else:
        raise ValueError(f"correction_weights: unknown correction {kind!r}")
    c = torch.where(m, c, zero)
    n = m.sum()
    sums = torch.stack([n.to(dt), c.sum(), ((c == 0) & m).sum().to(dt), (truncated & m).sum().to(dt),
                        rows.sum().to(dt), rejected.sum().to(dt)])
    cmax = c.max().reshape(1) if c.numel() else torch.zeros(1, dtype=dt, device=dev)
    return c, {"sums": sums, "max": cmax}


def _token_c(kind: str, lr: torch.Tensor, logc: float) -> torch.Tensor:
    """c_t of a token-level correction (TOKEN_LEVEL) from log rho_t (clamped), 0 where it drops the token."""
    zero = torch.zeros((), dtype=lr.dtype, device=lr.device)
    if kind == "tis":
        return lr.clamp(max=logc).exp()
    if kind == "mis":
        return torch.where(lr.abs() <= logc, lr.exp(), zero)
    if kind == "decoupled":
        return torch.where(lr <= logc, lr.exp(), zero)
    raise ValueError(f"{kind!r} is not a token-level correction {TOKEN_LEVEL}")


def token_correction(cfg: OffPolicyConfig, log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """c_t of the token-level correction `cfg.correction` from log rho_t = log pi_old - log mu of any shape (float64,
    detached, 0 off `mask`): what `correction_weights` gives token by token, for a loss that learns pi_old in its own
    forward (the deferred rows of `algo.old_from_update`)."""
    m = mask.bool()
    lr = torch.where(m, log_rho.detach().to(torch.float64), 0.0).clamp(-LOG_RHO_CLAMP, LOG_RHO_CLAMP)
    c = _token_c(cfg.correction, lr, math.log(cfg.cap) if cfg.cap is not None else math.inf)
    return torch.where(m, c, 0.0)


def weight_metrics(parts: dict, dp_group=None) -> dict[str, float]:
    """The correction's metrics, global over DP, from `correction_weights`' second value: off_policy_weight_mean /
    _max (of c over response tokens), off_policy_dropped_share (tokens whose c is 0: masked or rejected),
    off_policy_truncated_share (tokens whose c was cut to C), off_policy_rejected_seq_share (geo_rs)."""
    dev = comm.collective_device(dp_group)
    sums, mx = parts["sums"].clone().to(dev), parts["max"].clone().to(dev)
    comm.all_reduce(sums, "sum", dp_group)  # tokens, sum of c, dropped, truncated, responses, rejected: over DP
    comm.all_reduce(mx, "max", dp_group)  # the largest weight of any rank
    n, seqs = max(float(sums[0]), 1.0), max(float(sums[4]), 1.0)
    return {"off_policy_weight_mean": float(sums[1]) / n if float(sums[0]) else 1.0,
            "off_policy_weight_max": float(mx[0]) if float(sums[0]) else 1.0,
            "off_policy_dropped_share": float(sums[2]) / n, "off_policy_truncated_share": float(sums[3]) / n,
            "off_policy_rejected_seq_share": float(sums[5]) / seqs}


@dataclass
class LossInputs:
    """What the policy loss takes from the three policies (all [B, N] or None): `old_logp` the clip's anchor,
    `weights` the correction's c_t, `kl_old` the log-prob the KL term's importance weight divides by (None: the
    anchor), `on_policy_ok` whether epoch 0's first mini-batch may take the anchor from its own forward,
    `deferred_weights` c_t of a token-level correction as a function of (log rho, mask) for the rows whose pi_old
    is that forward (`StepData.deferred`; `weights` holds nothing meaningful there): the correction's metrics
    then come after the update (`correction_metrics`)."""

    old_logp: torch.Tensor
    weights: torch.Tensor | None
    kl_old: torch.Tensor | None
    on_policy_ok: bool
    metrics: dict
    deferred_weights: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def loss_inputs(cfg, data, dp_group=None) -> LossInputs:
    """The policy loss's anchor, weights and KL weight for this step's `data` (a StepData) under `cfg` (an
    RLConfig): module docstring. Refuses a correction without the rollout's log-probs, and samples staler than
    algo.max_staleness (rl/update/staleness.py's StalenessBound must have dropped them), naming the culprit."""
    a = cfg.algo
    op = a.off_policy
    metrics = staleness_metrics(data, a.max_staleness, dp_group)
    if op.correction == "none" and a.max_staleness == 0:
        return LossInputs(data.old_logp, None, None, True, metrics)
    mu = behaviour_logprobs(data, op.behaviour)
    if mu is None:
        raise ValueError(f"algo.off_policy.correction={op.correction!r}, algo.max_staleness={a.max_staleness}: the "
                         f"rollout recorded no log-probs (StepData.rollout_logprobs / rollout_sampled_logprobs), so mu "
                         f"is unknown")
    mu = mu.to(data.old_logp.dtype)
    if op.correction == "none":  # naive PPO: the clip on pi/mu; the KL weight pi/anchor is then pi/mu
        return LossInputs(mu, None, None, False, metrics)
    c, parts = correction_weights(op, data.old_logp, mu, data.mask)
    if getattr(data, "deferred", None) is None:
        metrics.update(weight_metrics(parts, dp_group))
        return LossInputs(data.old_logp, c, mu, True, metrics)
    if op.correction not in TOKEN_LEVEL:
        raise ValueError(f"algo.off_policy.correction={op.correction!r} weighs a response by every token's pi_old, "
                         f"so no row's pi_old may be deferred to the update (StepData.deferred must be None)")
    return LossInputs(data.old_logp, c, mu, True, metrics, functools.partial(token_correction, op))


def correction_metrics(cfg, data, dp_group=None) -> dict[str, float]:
    """`weight_metrics` of the step's correction over every row of `data` (a StepData whose old log-probs are all
    known: after the update has filled the deferred rows). Every DP rank calls it."""
    op = cfg.algo.off_policy
    mu = behaviour_logprobs(data, op.behaviour).to(data.old_logp.dtype)
    return weight_metrics(correction_weights(op, data.old_logp, mu, data.mask)[1], dp_group)


def staleness_metrics(data, max_staleness: int, dp_group=None) -> dict[str, float]:
    """staleness_mean / staleness_max over the step's responses (global over DP) when `data.policy_version` ([B]
    ints) and `data.current_version` are set ({} otherwise); a response staler than `max_staleness` raises."""
    pv, cur = getattr(data, "policy_version", None), getattr(data, "current_version", None)
    if pv is None or cur is None:
        return {}
    s = (int(cur) - pv.to(torch.int64)).double()
    m = data.mask.bool().any(-1)  # responses still in the loss (a dropped one has no token left)
    dev = comm.collective_device(dp_group)
    sums = torch.stack([torch.where(m, s, 0.0).sum(), m.sum().double()]).to(dev)
    # [stalest, -freshest] response: a version ahead of the current is refused like one too stale
    mx = (torch.stack([s[m].max(), -s[m].min()]) if m.any() else s.new_zeros(2)).to(dev)
    comm.all_reduce(sums, "sum", dp_group)  # staleness sum and responses over DP
    comm.all_reduce(mx, "max", dp_group)  # the stalest and the freshest response of any rank
    if float(mx[0]) > max_staleness or float(mx[1]) > 0:
        bad = int(mx[0]) if float(mx[0]) > max_staleness else -int(mx[1])
        raise ValueError(f"a response of this step has staleness {bad} (current version {cur}) but "
                         f"algo.max_staleness={max_staleness}: apply rl.update.staleness.StalenessBound before the "
                         f"update (a version ahead of the current one is refused too)")
    return {"staleness_mean": float(sums[0]) / max(float(sums[1]), 1.0), "staleness_max": float(mx[0])}
