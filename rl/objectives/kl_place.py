"""Which KL gradient each (estimator, direction, place) follows, the default estimator per place, and
the future-KL return that turns a per-token KL loss term into the sequence-level gradient.

Notation: a response x = (x_1 .. x_L) ~ pi, prefix h_t = (prompt, x_<t), g_t = grad log pi(x_t | h_t),
lr_t = log pi(x_t | h_t) - log ref(x_t | h_t), D_t(h_t) = KL(pi(.|h_t) || ref(.|h_t)) the exact
per-position KL. The sequence-level KL is K = E_pi[sum_t lr_t] = E_pi[sum_t D_t(h_t)] (chain rule);
the trainer's `kl_mean` is its per-token average. Its gradient (score function through the
sequence's probability, E[g_t] = 0, then the tower rule E[g_t lr_s] = E[g_t D_s] for s > t):

    grad K = E[sum_t grad D_t(h_t)]  +  E[sum_t g_t F_t],       F_t = sum_{s>t} D_s(h_s)
             (per token, prefix fixed)   (the future KL as a return)

Any per-token value v_s with E[v_s | h_s] = D_s (k1, k3, k1+, k3+, the exact KL) may stand in for
D_s in F_t. So:

- **KL in the loss** (`kl.where=loss`): the loss term's gradient is E[sum_t grad D_t] only -- the
  per-token gradient with the prefix held fixed (k2, k1+, k3+, exact; k3 and `ref_pi` the same for
  KL(ref||pi)). It misses grad K by 0.4-4% near the reference and by 4-60% on 2-4 token responses of
  a reference further off (docs/kl_playbook.md; tests/test_kl_sequence.py::test_gap_sizes).
  `kl.gradient=sequence` adds the second term: -beta * F_t joins token t's advantage (F_t summed
  from the rollout's per-token values, detached), which needs a value unbiased for KL(pi||ref)
  and a loss term whose gradient is that of KL(pi||ref) (`sequence_gradient_error`).
- **KL in the reward** (`kl.where=reward`, PPO's per-token reward -beta v_t, return-to-go
  sum_{s>=t}): the expected gradient is beta (E[sum_t g_t F_t] + E[sum_t g_t v_t]). The current
  token's E[g_t v_t | h_t] is grad D_t for k1 (and k1+, whose value is k1's): exactly grad K.
  For k3 it is grad D_t - grad KL_t(ref||pi), whose two parts nearly cancel near the reference;
  for k2 no KL's; for the exact KL it is 0 (D_t is fixed by the prefix), so the exact KL in the
  reward also puts beta * D_t into the loss (its pathwise term, `KLConfig.in_loss`). A per-token
  KL(ref||pi) summed over the policy's prefixes is not the sequence-level KL(ref||pi) (that takes
  the reference's prefixes), so `ref_pi` has no place in the reward. These are refused
  (`reward_error`).

`log_ratio_clamp` / `value_clamp` bias the value wherever they bite; that is their purpose, not counted
here. tests/test_kl_sequence.py checks every allowed row by exact enumeration of all 2- and 3-token
responses of a 3-token vocabulary against autograd of K in float64.
"""

from __future__ import annotations

import torch

GRADIENTS = ("token", "sequence")
REWARD_ESTIMATORS = ("k1", "k1+")  # sampled values whose per-token reward follows grad K(pi||ref)
UNBIASED_VALUES = ("k1", "k3", "k1+", "k3+")  # E_pi[value | prefix] = KL(pi||ref) at the position
_REWARD_BIAS = {
    "k3": "grad KL(pi||ref) - grad KL(ref||pi) at the current token (the two nearly cancel near the reference)",
    "k3+": "k3's (a reward uses only the value, and k3+'s is k3's): grad KL(pi||ref) - grad KL(ref||pi) at the "
           "current token, which nearly cancel near the reference",
    "low_var_kl": "k3's, clamped: grad KL(pi||ref) - grad KL(ref||pi) at the current token",
    "k2": "E[g_t * 0.5 log^2(pi/ref)] at the current token, no KL's gradient",
}


def default_estimator(where: str, direction: str, is_weight: str) -> str:
    """The estimator when `kl.estimator` is not set: k1 in the reward (the only sampled value whose
    per-token reward follows a KL's gradient); in the loss k3+ (value of k3, gradient of KL(pi||ref)),
    k3 for `ref_pi` (its gradient is that of KL(ref||pi)) and for `is_weight=live` (then KL(pi||ref))."""
    if where == "reward":
        return "k1"
    return "k3" if direction == "ref_pi" or is_weight == "live" else "k3+"


def reward_error(estimator: str, direction: str, exact: bool, gradient: str) -> str | None:
    """Why this KL may not go into the reward (None: it may), in one sentence naming the keys."""
    if direction == "ref_pi":
        return ("kl.direction='ref_pi' with kl.where='reward': a per-token KL(ref||pi) summed over the policy's "
                "prefixes is not the sequence-level KL(ref||pi), so the reward follows no KL's gradient; use "
                "kl.direction='pi_ref' in the reward, or kl.where='loss' for KL(ref||pi) per token")
    if gradient == "token":
        return ("kl.gradient='token' with kl.where='reward': a per-token reward acts through the returns of "
                "earlier tokens, so its gradient is the sequence-level one; for the per-token gradient with "
                "the prefix fixed use kl.where='loss'")
    if not exact and estimator not in REWARD_ESTIMATORS:
        return (f"kl.estimator={estimator!r} with kl.where='reward' follows no KL's gradient: as a per-token "
                f"reward its gradient is {_REWARD_BIAS[estimator]}; use kl.estimator='k1' (the reward's default; "
                f"k1+ is the same there) or kl.exact=true, or kl.where='loss' for {estimator}")
    return None


def sequence_gradient_error(estimator: str, direction: str, exact: bool, loss_grad: str) -> str | None:
    """Why `kl.gradient=sequence` cannot be had in the loss with these settings (None: it can);
    `loss_grad` is what the loss term follows (rl.objectives.kl.loss_gradient)."""
    if direction != "pi_ref":
        return ("kl.gradient='sequence' with kl.direction='ref_pi': the sequence-level KL(ref||pi) is an "
                "expectation over the reference's prefixes, not a sum of per-token terms under the policy; "
                "use kl.direction='pi_ref' or kl.gradient='token'")
    if exact:
        return None
    if estimator not in UNBIASED_VALUES:
        return (f"kl.gradient='sequence' with kl.estimator={estimator!r}: its value is not an unbiased "
                f"KL(pi||ref), so the future-KL return is biased; use kl.estimator='k3+' or 'k1+', or "
                f"kl.gradient='token'")
    if loss_grad != "grad KL(pi||ref)":
        return (f"kl.gradient='sequence' with kl.estimator={estimator!r} in the loss: its loss term's gradient "
                f"is {loss_grad}, not the per-token grad KL(pi||ref); use kl.estimator='k3+' or 'k1+' "
                f"(or kl.is_weight='live' with k1/k3)")
    return None


def future_kl(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """F_t = sum of the valid per-token KL values after position t in the same row (not t itself).

    kl, mask: [B, S]; returns [B, S] detached, fp32 (fp64 for fp64 input), 0 on masked positions
    (whatever they held)."""
    if kl.shape != mask.shape or kl.dim() != 2:
        raise ValueError(f"future_kl: kl {tuple(kl.shape)} and mask {tuple(mask.shape)} must be equal [B, S] shapes")
    dt = torch.float64 if kl.dtype == torch.float64 else torch.float32
    m = mask.bool()
    v = torch.where(m, kl.detach().to(dt), torch.zeros((), dtype=dt, device=kl.device))
    after = v.flip(1).cumsum(1).flip(1) - v  # sum_{s >= t} - v_t
    return torch.where(m, after, torch.zeros((), dtype=dt, device=kl.device))
