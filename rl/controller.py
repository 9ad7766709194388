"""`KLController`: the KL coefficient beta, fixed or adapted from the measured KL.

Every mode works on `recent`, the mean of the last `window` KL values passed to `update`
(window=1: the current value). After each update beta is clipped to [beta_min, beta_max].

| mode         | rule                                                                          |
|--------------|-------------------------------------------------------------------------------|
| `fixed`      | beta unchanged                                                                |
| `adaptive`   | Ziegler et al. 2019: e = clip(recent/target - 1, -0.2, 0.2); beta *= 1 + e * n / horizon |
| `threshold`  | beta *= up if recent > target * band_high; beta *= down if recent < target * band_low |
| `normalized` | beta = min(target / recent, normalized_max); unchanged if recent <= 0           |

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
from dataclasses import dataclass

MODES = ("fixed", "adaptive", "threshold", "normalized")
MAX_N_OVER_HORIZON = 5.0  # 1 + e * n / horizon > 0 for every e >= -0.2


@dataclass
class KLControllerConfig:
    """The `kl_ctl` section."""

    mode: str = "fixed"  # one of MODES
    beta: float = 0.05  # initial coefficient
    target: float = 0.1  # target KL (same units as the kl_mean passed to update)
    horizon: float = 10000.0  # adaptive: SAMPLES (responses) over which beta changes by about e^(+-0.2)
    band_low: float = 0.5  # threshold: shrink beta when recent < target * band_low
    band_high: float = 1.5  # threshold: grow beta when recent > target * band_high
    up: float = 1.5  # threshold: growth factor
    down: float = 1.0 / 1.5  # threshold: shrink factor
    beta_min: float = 0.0
    beta_max: float = 1.0e6
    window: int = 1  # number of recent KL values averaged into `recent`
    normalized_max: float = 10.0  # normalized: beta <= this, so a tiny KL (1e-6) cannot blow beta up

    def __post_init__(self):
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
        if not self.horizon > 0:
            raise ValueError(f"kl_ctl.horizon must be positive, got {self.horizon}")
        if not 0 < self.band_low <= self.band_high:
            raise ValueError(f"kl_ctl needs 0 < band_low <= band_high, got {self.band_low}, {self.band_high}")
        if not (self.up >= 1.0 and 0.0 < self.down <= 1.0):
            raise ValueError(f"kl_ctl needs up >= 1 and 0 < down <= 1, got up={self.up}, down={self.down}")
        if not self.normalized_max > 0:
            raise ValueError(f"kl_ctl.normalized_max must be positive, got {self.normalized_max}")
        if self.window < 1:
            raise ValueError(f"kl_ctl.window must be >= 1, got {self.window}")


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
        self._n_updates += 1
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
