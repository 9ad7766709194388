"""`KLController`: the KL coefficient beta, fixed or adapted from the measured KL.

Every mode works on `recent`, the mean of the last `window` KL values passed to `update`
(window=1: the current value). After each update beta is clipped to [beta_min, beta_max].
Unit: every KL here -- the values passed to `update`, `target` -- is a mean KL per response token in
nats (the trainer's masked token mean `kl_mean`), never a sum over a response; a target above
MAX_TARGET_PER_TOKEN is refused as the per-sequence figure it almost surely is.

| mode         | rule                                                                          |
|--------------|-------------------------------------------------------------------------------|
| `fixed`      | beta unchanged                                                                |
| `adaptive`   | Ziegler et al. 2019: e = clip(recent/target - 1, -0.2, 0.2); beta *= 1 + e * n / horizon |
| `threshold`  | beta *= up if recent > target * band_high; beta *= down if recent < target * band_low |
| `normalized` | beta = min(target / recent, normalized_max); unchanged if recent <= 0. Holds the |
|              | penalty beta x KL at target, NOT the KL: positive feedback on the KL (a warning says so) |
| `grad_ratio` | beta = grad_fraction * |grad pg| / |grad KL| (per unit beta), set before each update |

With `every` = N > 1 the rule acts only on every N-th call of `update` (on the mean of the last
`window` values); the calls in between only record the KL.

`grad_ratio` needs the two gradient norms, measured by the trainer on each step's on-policy batch
(`set_from_grad_norms`); `update` then only records the KL. Presets (`kl_ctl.preset`, see PRESETS and
docs/kl_playbook.md) fill the rule keys the config leaves unset with a published recipe; `band` and
`ziegler` drive the KL of a bandit to its target (tests/test_controller_closed_loop.py).

The adaptive clock is Ziegler et al.'s: `n` is the number of samples (responses) the KL value was
measured on -- the trainer passes the step's global rollout.prompts_per_step * rollout.group_size --
and `horizon` is in samples, so with the KL persistently above (below) target beta grows (shrinks)
by about e^0.2 every `horizon` samples. n / horizon must stay below 5, else one update could drive
the factor 1 + e * n / horizon to 0 or below (beta stuck at 0 for good); larger is refused.
A non-finite KL raises ValueError: a NaN would otherwise poison beta for good.
State (`state_dict`) is plain Python numbers and round-trips exactly.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

MODES = ("fixed", "adaptive", "threshold", "normalized", "grad_ratio")
MAX_N_OVER_HORIZON = 5.0  # 1 + e * n / horizon > 0 for every e >= -0.2
# kl_ctl.target is a mean KL per response token (nats). A healthy run's is 0.01-0.4 (grpo_tiny: 0.09 -> 0.36);
# the 5-10 of RLHF guides and TRL's/Ziegler's 6 are sums over a response. Above this a target is refused.
MAX_TARGET_PER_TOKEN = 1.0

# name -> (the keys it sets, where the recipe comes from). A preset fills a key only where the config does not
# set it: a key the user set wins (the summary says so), and a user's `mode` other than the preset's is refused.
PRESETS: dict[str, tuple[dict, str]] = {
    "band": (dict(mode="threshold", band_high=1.5, band_low=1 / 1.5, up=1.2, down=0.8, every=10, window=10),
             "the band of PPO's adaptive KL penalty (Schulman et al. 2017, sec. 4: act when the KL leaves "
             "[target/1.5, 1.5 target]) with the gentler factors x1.2 / x0.8 of the RLHF guides instead of PPO's "
             "x2 / x0.5, on a 10-step window mean every 10 steps"),
    "band_tight": (dict(mode="threshold", band_high=1.2, band_low=0.8, up=1.2, down=0.8, every=10, window=10),
                   "the guides' tighter band (beta x1.2 above 1.2 target, x0.8 below 0.8 target), every 10 steps "
                   "on a 10-step mean"),
    "ziegler": (dict(mode="adaptive", horizon_steps=10.0),
                "Ziegler et al. 2019 (Fine-Tuning LMs from Human Preferences; TRL's AdaptiveKLController): "
                "e = clip(KL/target - 1, +-0.2), beta *= 1 + e n / horizon, n = samples in the step, horizon "
                "= 10 steps' samples (unless kl_ctl.horizon is set), so beta moves by about e^0.2 every 10 steps"),
    "grad_ratio": (dict(mode="grad_ratio", grad_fraction=0.1, beta_max=10.0),
                   "gradient balancing: beta set each step so the KL term's gradient norm is 0.1 of the "
                   "policy-gradient term's (measured at the sampled tokens' log-probs, all DP ranks summed)"),
}
# presets taken out, with the reason given to whoever asks for one
WITHDRAWN = {
    "target_over_kl": "beta = target / KL is positive feedback on the KL (more KL, smaller beta, more KL): it holds "
                      "the penalty's value beta x KL at kl_ctl.target, not the KL, and runs beta to a bound: on a "
                      "bandit with a known optimum the KL ended at 46x the target (beta at its floor) or at 0.13x "
                      "(beta at its cap), where band and ziegler settle at 0.84-1.41x. Its source scales the KL "
                      "term against the policy loss (which it found 10^3 apart): that is kl_ctl.preset=grad_ratio; to "
                      "hold the KL at kl_ctl.target use kl_ctl.preset=ziegler or band (kl_ctl.mode=normalized "
                      "remains, explicitly)",
}

# the keys a preset may fill: None in the config means "not set", resolved to these defaults after the preset
RULE_DEFAULTS = dict(mode="fixed", horizon=10000.0, band_low=0.5, band_high=1.5, up=1.5, down=1.0 / 1.5,
                     beta_min=0.0, beta_max=1.0e6, window=1, normalized_max=10.0, every=1, grad_fraction=0.1)


@dataclass
class KLControllerConfig:
    """The `kl_ctl` section. Every KL here is the mean KL per response token in nats (the masked token mean
    the trainer logs as `kl_mean`), never a sum over a response. A rule key left unset (null) takes the
    preset's value, else its default (RULE_DEFAULTS, shown in the comments)."""

    mode: str | None = None  # one of MODES; default fixed
    beta: float = 0.05  # initial coefficient (the penalty is beta x per-token KL)
    target: float = 0.1  # target KL, nats per response token (a healthy run: 0.01-0.4); at most 1
    horizon: float | None = None  # adaptive: SAMPLES (responses) over which beta changes by about e^(+-0.2); 10000
    band_low: float | None = None  # threshold: shrink beta when recent < target * band_low; 0.5
    band_high: float | None = None  # threshold: grow beta when recent > target * band_high; 1.5
    up: float | None = None  # threshold: growth factor; 1.5
    down: float | None = None  # threshold: shrink factor; 1/1.5
    beta_min: float | None = None  # 0
    beta_max: float | None = None  # 1e6
    window: int | None = None  # number of recent KL values averaged into `recent`; 1
    normalized_max: float | None = None  # normalized: beta <= this, so a tiny KL (1e-6) cannot blow beta up; 10
    every: int | None = None  # apply the rule on every `every`-th update only (the others just record the KL); 1
    horizon_steps: float | None = None  # adaptive: if set, horizon = this x samples per step (set by RLConfig)
    grad_fraction: float | None = None  # grad_ratio: |beta grad KL| = grad_fraction |grad pg|; 0.1
    preset: str | None = None  # one of PRESETS: fills the unset keys above with a published recipe

    def __post_init__(self):
        self.user_keys = {k for k in (*RULE_DEFAULTS, "horizon_steps") if getattr(self, k) is not None}
        self.preset_summary = apply_preset(self) if self.preset is not None else ""
        for k, v in RULE_DEFAULTS.items():
            if getattr(self, k) is None:
                setattr(self, k, v)
        if self.mode not in MODES:
            raise ValueError(f"kl_ctl.mode must be one of {MODES}, got {self.mode!r}")
        if not 0.0 <= self.beta_min <= self.beta_max:
            raise ValueError(f"kl_ctl needs 0 <= beta_min <= beta_max, got beta_min={self.beta_min}, "
                             f"beta_max={self.beta_max}")
        if not self.beta_min <= self.beta <= self.beta_max:
            raise ValueError(f"kl_ctl.beta={self.beta} is outside [beta_min={self.beta_min}, "
                             f"beta_max={self.beta_max}]")
        if self.mode != "fixed" and not self.target > 0:
            raise ValueError(f"kl_ctl.target must be positive for mode {self.mode!r}, got {self.target}")
        if self.target > MAX_TARGET_PER_TOKEN:
            raise ValueError(f"kl_ctl.target={self.target:g} is a KL per response token (nats), and above "
                             f"{MAX_TARGET_PER_TOKEN:g} it is a per-sequence figure: the guides' 5-10 and TRL's / "
                             f"Ziegler et al.'s 6 are KL sums over a response. Divide by the mean response length "
                             f"(6 over 200 tokens: 0.03); a healthy run's per-token KL is 0.01-0.4")
        if not self.horizon > 0:
            raise ValueError(f"kl_ctl.horizon must be positive, got {self.horizon}")
        if not 0 < self.band_low <= self.band_high:
            raise ValueError(f"kl_ctl needs 0 < band_low <= band_high, got {self.band_low}, {self.band_high}")
        if not (self.up >= 1.0 and 0.0 < self.down <= 1.0):
            raise ValueError(f"kl_ctl needs up >= 1 and 0 < down <= 1, got up={self.up}, down={self.down}")
        if not self.normalized_max > 0:
            raise ValueError(f"kl_ctl.normalized_max must be positive, got {self.normalized_max}")
        if self.window < 1 or self.every < 1:
            raise ValueError(f"kl_ctl.window and kl_ctl.every must be >= 1, got {self.window}, {self.every}")
        if self.mode == "normalized":
            warnings.warn("kl_ctl.mode=normalized sets beta = target / KL: it holds the penalty beta x KL at "
                          "kl_ctl.target, not the KL, and is positive feedback on the KL (more KL, smaller beta); "
                          "to hold the KL at its target use kl_ctl.preset=ziegler or band", stacklevel=3)
        if self.horizon_steps is not None and not self.horizon_steps > 0:
            raise ValueError(f"kl_ctl.horizon_steps must be positive or null, got {self.horizon_steps}")
        if not self.grad_fraction > 0:
            raise ValueError(f"kl_ctl.grad_fraction must be positive, got {self.grad_fraction}")


def apply_preset(cfg: KLControllerConfig) -> str:
    """Fill `cfg`'s rule keys the user left unset (None) from PRESETS[cfg.preset]; return a one-paragraph
    summary of what was set and which of the user's own values were kept. A user's `mode` that is not the
    preset's is refused (the preset is its rule); so is a withdrawn preset, with the reason."""
    if cfg.preset in WITHDRAWN:
        raise ValueError(f"kl_ctl.preset={cfg.preset} was withdrawn: {WITHDRAWN[cfg.preset]}")
    if cfg.preset not in PRESETS:
        raise ValueError(f"kl_ctl.preset must be one of {sorted(PRESETS)}, got {cfg.preset!r}")
    keys, source = PRESETS[cfg.preset]
    if cfg.mode is not None and cfg.mode != keys["mode"]:
        raise ValueError(f"kl_ctl.preset={cfg.preset} is kl_ctl.mode={keys['mode']}, but kl_ctl.mode={cfg.mode} "
                         f"is set: drop one of the two (an override kl_ctl.mode=null unsets the config file's)")
    set_, kept = [], []
    for k, v in keys.items():
        mine = "horizon" if k == "horizon_steps" and cfg.horizon is not None else k  # one clock, two spellings
        if getattr(cfg, mine) is None:
            setattr(cfg, k, v)
            set_.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
        elif mine != "mode":
            kept.append(f"{mine}={getattr(cfg, mine)}")
    msg = f"kl_ctl.preset={cfg.preset}: set {', '.join(set_)}"
    if kept:
        msg += f"; kept your {', '.join(kept)}"
    return msg + f"; target {cfg.target:g} nats per response token. Source: {source}."


class KLController:
    def __init__(self, config: KLControllerConfig | None = None):
        self.config = config or KLControllerConfig()
        self._beta = float(self.config.beta)
        self._history: list[float] = []
        self._n_updates = 0

    @property
    def beta(self) -> float:
        return self._beta

    def update(self, kl_mean: float, n_samples: int = 1) -> float:
        """Record the measured KL (a Python number or 0-d tensor), measured on `n_samples` responses,
        and return the new beta."""
        kl = float(kl_mean)
        if not math.isfinite(kl):
            raise ValueError(f"KLController.update: kl_mean is {kl} (not finite)")
        c = self.config
        if n_samples < 0:
            raise ValueError(f"KLController.update: n_samples must be >= 0, got {n_samples}")
        if c.mode == "adaptive" and not n_samples / c.horizon < MAX_N_OVER_HORIZON:
            raise ValueError(f"KLController.update: n_samples / kl_ctl.horizon = {n_samples} / {c.horizon} must be "
                             f"< {MAX_N_OVER_HORIZON:g}, else the factor 1 + e * n / horizon (e >= -0.2) can reach 0")
        self._history = (self._history + [kl])[-c.window:]
        recent = sum(self._history) / len(self._history)
        beta = self._beta
        self._n_updates += 1
        if self._n_updates % c.every:
            return self._beta
        if c.mode == "adaptive":
            error = min(max(recent / c.target - 1.0, -0.2), 0.2)
            beta = beta * (1.0 + error * n_samples / c.horizon)
        elif c.mode == "threshold":
            if recent > c.target * c.band_high:
                beta = beta * c.up
            elif recent < c.target * c.band_low:
                beta = beta * c.down
        elif c.mode == "normalized":
            if recent > 0:
                beta = min(c.target / recent, c.normalized_max)
        self._beta = min(max(beta, c.beta_min), c.beta_max)
        return self._beta

    def set_from_grad_norms(self, pg_norm: float, kl_norm: float) -> float:
        """grad_ratio: beta = grad_fraction * pg_norm / kl_norm, clipped to [beta_min, beta_max]; kl_norm
        is the KL term's gradient norm per unit beta. Unchanged when kl_norm is 0 (nothing to balance)
        or a norm is not finite. Both norms must be global (the same on every rank)."""
        c = self.config
        if c.mode != "grad_ratio":
            raise ValueError(f"KLController.set_from_grad_norms needs kl_ctl.mode='grad_ratio', not {c.mode!r}")
        if kl_norm > 0 and math.isfinite(pg_norm) and math.isfinite(kl_norm):
            self._beta = min(max(c.grad_fraction * pg_norm / kl_norm, c.beta_min), c.beta_max)
        return self._beta

    def state_dict(self) -> dict:
        return {"beta": self._beta, "history": list(self._history), "n_updates": self._n_updates}

    def load_state_dict(self, state: dict) -> None:
        want = {"beta", "history", "n_updates"}
        if set(state) != want:
            raise ValueError(f"KLController.load_state_dict: expected keys {sorted(want)}, got "
                             f"{sorted(state)}")
        self._beta = float(state["beta"])
        self._history = [float(x) for x in state["history"]][-self.config.window:]
        self._n_updates = int(state["n_updates"])


class EntropyController:
    """An adaptive entropy coefficient (`loss.entropy_target`): after each step with mean entropy H,
    coef <- clip(coef + entropy_lr * (entropy_target - H), entropy_coef_min, entropy_coef_max), an
    integral controller (as SAC's temperature) that raises the bonus while the entropy is under the
    target and lowers it above. With `entropy_target` None the coefficient stays `entropy_coef`."""

    def __init__(self, loss_cfg):
        self.cfg = loss_cfg
        self.coef = float(loss_cfg.entropy_coef)

    def update(self, entropy: float) -> float:
        c = self.cfg
        if c.entropy_target is not None and math.isfinite(entropy):
            self.coef = min(max(self.coef + c.entropy_lr * (c.entropy_target - entropy), c.entropy_coef_min),
                            c.entropy_coef_max)
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
