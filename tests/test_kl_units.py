"""The unit of every KL key: the controller's target and the guards' limits are a mean KL per response token
(nats), the trainer's `kl_mean`. Per-sequence magnitudes (the guides' 5-10 and 20 / 50, TRL's target 6: sums over
a response) given per token are refused naming the key; the renamed guard keys are refused with their new name;
the defaults sit above a healthy run's per-token KL."""

import pytest
import yaml

from core.config import ConfigError, from_dict, load_config, to_dict
from rl.config import GuardConfig, RLConfig

# the default job (configs/grpo_tiny.yaml, 200 steps) at commit b8ba51b on a 2-core shared CPU:
# 20-step window means of kl_mean 0.087 -> 0.367, the largest single step 0.78 (docs/kl_playbook.md)
HEALTHY_MAX_STEP_KL = 0.78


@pytest.mark.parametrize("mode", ["fixed", "adaptive", "threshold"])
def test_a_per_sequence_target_is_refused_naming_the_key(mode):
    with pytest.raises(ConfigError, match=r"kl_ctl.target=6 is a KL per response token.*per-sequence.*TRL"):
        load_config(RLConfig, None, [f"kl_ctl.mode={mode}", "kl_ctl.target=6"])
    for ok in (0.03, 1.0):
        assert load_config(RLConfig, None, [f"kl_ctl.mode={mode}", f"kl_ctl.target={ok}"]).kl_ctl.target == ok


def test_guard_keys_name_their_unit():
    for old, new in (("kl_warn", "kl_warn_per_token"), ("kl_stop", "kl_stop_per_token")):
        with pytest.raises(ConfigError, match=f"guard.{old} is now guard.{new}.*per-sequence"):
            load_config(RLConfig, None, [f"guard.{old}=20"])
    with pytest.raises(ConfigError, match=r"guard.kl_stop_per_token=50 must be in \(0, 10\].*per-sequence"):
        load_config(RLConfig, None, ["guard.kl_stop_per_token=50"])
    with pytest.raises(ConfigError, match="guard.kl_warn_per_token=3 is above guard.kl_stop_per_token=2"):
        load_config(RLConfig, None, ["guard.kl_warn_per_token=3", "guard.kl_stop_per_token=2"])
    off = load_config(RLConfig, None, ["guard.kl_warn_per_token=null", "guard.kl_stop_per_token=null"]).guard
    assert (off.kl_warn_per_token, off.kl_stop_per_token) == (None, None)


@pytest.mark.parametrize("path", [None, "configs/grpo_tiny.yaml", "configs/ppo_tiny.yaml"])
def test_guard_defaults_clear_a_healthy_run(path):
    """A healthy run's per-token KL is 0.01-0.4; the default job's largest single step was 0.78: the warning sits
    at least 2x above that, the stop above the warning, both below the refused per-sequence range."""
    g = load_config(RLConfig, path, []).guard if path else GuardConfig()
    assert 2 * HEALTHY_MAX_STEP_KL <= g.kl_warn_per_token < g.kl_stop_per_token <= 10
    assert load_config(RLConfig, path, []).kl_ctl.target <= 0.4


def test_normalized_mode_says_it_does_not_hold_the_kl():
    with pytest.warns(UserWarning, match="holds the penalty beta x KL at kl_ctl.target, not the KL"):
        load_config(RLConfig, None, ["kl_ctl.mode=normalized"])


@pytest.mark.parametrize("over", [["kl_ctl.preset=ziegler"],
                                  ["kl_ctl.preset=band", "kl_ctl.mode=null", "kl_ctl.up=1.5"],
                                  ["kl_ctl.preset=grad_ratio", "kl_ctl.mode=null"], []])
def test_a_dumped_config_loads_back_the_same(over):
    """`--dry-run` prints the resolved config; read back, it resolves to the same sections (a resolved preset's
    keys all look user-set then, and agree with the preset)."""
    cfg = load_config(RLConfig, "configs/grpo_tiny.yaml", over)
    again = from_dict(RLConfig, yaml.safe_load(yaml.safe_dump(to_dict(cfg))))
    assert to_dict(again.kl_ctl) == to_dict(cfg.kl_ctl) and to_dict(again.guard) == to_dict(cfg.guard)
