"""`algo.recipe`: one config line for a published RL-for-LLM algorithm. A recipe fills the keys its paper sets
where the config (file or override) does not set them: a key the config sets wins, and the summary printed at
start-up names what the recipe set and which of the config's values it kept (an override `key=null` unsets a
config file's value, so the recipe's applies). It is applied to the config's dict before the dataclasses are
built (core.config.from_dict calls `RLConfig.prepare_dict`), so every key's own checks see the result.

docs/recipes.md tables each recipe's keys and where kltron departs from its paper, and why.
"""

from __future__ import annotations

import copy

from core.config import ConfigError


def _max_new(data: dict) -> int:
    """rollout.max_new_tokens as the config sets it, else its default (passed in by RLConfig.prepare_dict)."""
    return int((data.get("rollout") or {}).get("max_new_tokens") or data["_max_new_default"])


# name -> (keys(config dict) -> {dotted key: value}, source)
RECIPES = {
    "grpo": (lambda d: {"algo.name": "grpo", "algo.advantage": "grpo", "algo.adv_std_norm": True,
                        "loss.policy": "ppo", "loss.clip_low": 0.2, "loss.agg": "seq-mean-token-mean",
                        "kl.where": "loss", "kl_ctl.mode": "fixed", "kl_ctl.beta": 0.04},
             "GRPO, DeepSeekMath (Shao et al. 2024, arXiv 2402.03300): group-normalised advantages, the PPO clip, "
             "each response's token mean averaged over responses, the KL in the loss with beta 0.04 (kltron keeps "
             "its k3+ estimator: k3's value with the gradient of KL(pi||ref); the paper's k3 follows KL(ref||pi))"),
    "dapo": (lambda d: {"algo.name": "grpo", "algo.advantage": "grpo", "algo.adv_std_norm": True,
                        "loss.policy": "ppo", "loss.clip_low": 0.2, "loss.clip_high": 0.28, "loss.agg": "token-mean",
                        "algo.dynamic_sampling": True, "algo.overlong_filter": True,
                        "algo.overlong_buffer": max(1, round(0.2 * _max_new(d))), "algo.overlong_penalty": 1.0,
                        "kl_ctl.mode": "fixed", "kl_ctl.beta": 0.0},
             "DAPO (Yu et al. 2025, arXiv 2503.14476): clip-higher (0.2 / 0.28), dynamic sampling, the token-level "
             "loss, overlong filtering and the soft overlong punishment over the last 20% of the length (the paper's "
             "4096 of 20480 tokens), no KL penalty (beta 0; the KL is still measured)"),
    "dr_grpo": (lambda d: {"algo.name": "grpo", "algo.advantage": "grpo", "algo.adv_std_norm": False,
                           "loss.policy": "ppo", "loss.agg": "seq-mean-token-sum-norm",
                           "loss.norm_len": float(_max_new(d))},
                "Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): no division by the group's std, each response's token "
                "sum divided by a constant (the generation budget rollout.max_new_tokens) instead of its length"),
    "gspo": (lambda d: {"algo.name": "grpo", "algo.advantage": "grpo", "algo.adv_std_norm": True,
                        "loss.policy": "gspo", "loss.clip_low": 3e-4, "loss.clip_high": 4e-4,
                        "loss.agg": "seq-mean-token-mean"},
             "GSPO (Zheng et al. 2025, arXiv 2507.18071): the length-normalised sequence ratio, clipped per response "
             "at [1 - 3e-4, 1 + 4e-4], responses averaged"),
    "cispo": (lambda d: {"algo.name": "grpo", "algo.advantage": "grpo", "algo.adv_std_norm": True,
                         "loss.policy": "cispo", "loss.clip_low": 1.0, "loss.clip_high": 0.28,
                         "loss.agg": "token-mean"},
              "CISPO, MiniMax-M1 (MiniMax 2025, arXiv 2506.13585): the clipped, stop-gradient importance weight on "
              "every token's log-prob gradient, no lower bound (eps_low 1: the weight's floor is 0), the loss over "
              "all tokens; the paper tunes eps_high without stating it: kltron takes 0.28 (Trinity-RFT's default)"),
    "rloo": (lambda d: {"algo.name": "grpo", "algo.advantage": "rloo", "algo.epochs": 1, "algo.mini_batches": 1,
                        "loss.policy": "ppo", "loss.agg": "seq-mean-token-sum-norm", "loss.norm_len": 1.0,
                        "kl.where": "reward"},
             "RLOO (Ahmadian et al. 2024, arXiv 2402.14740): the leave-one-out baseline, one on-policy update per "
             "batch (REINFORCE: the clip never acts), the response's log-prob (token sum) per response, the KL "
             "in the reward"),
    "reinforce_pp": (lambda d: {"algo.name": "grpo", "algo.advantage": "reinforce_pp", "loss.policy": "ppo",
                                "loss.clip_low": 0.2, "loss.agg": "token-mean", "kl.where": "reward"},
                     "REINFORCE++ (Hu 2025, arXiv 2501.03262): no critic and no group baseline, the KL per token in "
                     "the reward (k1), returns normalised over the whole batch (all DP ranks), the PPO clip; "
                     "algo.advantage=reinforce_pp_baseline subtracts each group's mean first"),
}


def apply_recipe(data: dict, max_new_default: int) -> tuple[dict, str]:
    """(the config dict with `algo.recipe`'s keys filled where it sets none, the summary); unchanged and "" without
    a recipe. An unknown recipe raises ConfigError naming the key and the choices. `max_new_default`:
    rollout.max_new_tokens where the config does not set it (recipes scale lengths by it)."""
    name = (data.get("algo") or {}).get("recipe")
    if name is None:
        return data, ""
    if name not in RECIPES:
        raise ConfigError(f"algo.recipe must be one of {', '.join(RECIPES)}, got {name!r}")
    keys, source = RECIPES[name]
    out, set_, kept = copy.deepcopy(data), [], []
    for dotted, v in keys({**data, "_max_new_default": max_new_default}).items():
        sec, key = dotted.split(".")
        section = out.get(sec) or {}
        out[sec] = section
        if section.get(key) is None:
            section[key] = v
            set_.append(f"{dotted}={v:g}" if isinstance(v, float) else f"{dotted}={v}")
        elif section[key] != v:
            kept.append(f"{dotted}={section[key]} (the recipe's: {v})")
    msg = f"algo.recipe={name}: set {', '.join(set_) or 'nothing'}"
    if kept:
        msg += f"; kept your {', '.join(kept)}"
    return out, msg + f". Source: {source}."
