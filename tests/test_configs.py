"""Every shipped config in configs/ parses with load_config (RL configs: grpo_* / ppo_* / recipes_* /
multiturn_* / distill_*; the rest are SFT), and the RL configs' rewards build (short names resolve to
rl.experience.math_reward's functions)."""

import glob
import os

import pytest

from core.config import SFTConfig, load_config
from rl.config import RLConfig
from rl.experience.math_reward import format_reward, math_reward
from rl.experience.rewards import build_reward
from tests.dist import REPO

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))


def _cls(path):
    rl = ("grpo", "ppo", "recipes", "distill", "multiturn")
    return RLConfig if os.path.basename(path).startswith(rl) else SFTConfig


def test_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"grpo_gsm8k_qwen2.yaml", "grpo_llama3_8b_multinode.yaml", "grpo_tiny.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_parses(path):
    cfg = load_config(_cls(path), path)
    if isinstance(cfg, RLConfig):
        task, fn, _ = build_reward(cfg.reward)
        assert (task is None) == (cfg.reward.task is None)


def test_real_model_configs():
    q = load_config(RLConfig, os.path.join(REPO, "configs", "grpo_gsm8k_qwen2.yaml"))
    assert q.parallel.tp == 2 and q.parallel.fsdp and q.data.apply_chat_template and q.reward.task is None
    _, fn, _ = build_reward(q.reward)
    assert fn.fn.fns == [math_reward, format_reward] and fn.fn.weights == [1.0, 0.1]  # inside the max_abs bound
    meta = {"answer": "She has 3 + 4 = 7.\n#### 7"}
    assert fn(meta, "3 + 4 = 7\n#### 7") == pytest.approx(1.1) and fn(meta, "#### 8") == pytest.approx(0.1)
    assert fn(meta, "it is 7") == pytest.approx(1.0)  # the last number, no "####" line
    ll = load_config(RLConfig, os.path.join(REPO, "configs", "grpo_llama3_8b_multinode.yaml"))
    assert ll.parallel.tp == 8 and ll.parallel.dp == -1 and ll.parallel.mixed_precision == "bf16"
    assert ll.reference.checkpoint is None and ll.init.checkpoint
