"""Model shapes known before any weights exist: named presets of published checkpoints, and the shape
read from a Hugging Face `config.json`. Used where a size must be planned without a checkpoint
(`rl.train --dry-run`, `tools.kl_memory --model`).

| preset        | layers | hidden | heads / kv | MLP    | vocab   | tied | qkv bias | parameters |
|---------------|--------|--------|------------|--------|---------|------|----------|------------|
| llama3-8b     | 32     | 4096   | 32 / 8     | 14336  | 128256  | no   | no       | 8.03e9     |
| llama3-70b    | 80     | 8192   | 64 / 8     | 28672  | 128256  | no   | no       | 70.6e9     |
| qwen2.5-7b    | 28     | 3584   | 28 / 4     | 18944  | 152064  | no   | yes      | 7.62e9     |
| qwen2.5-0.5b  | 24     | 896    | 14 / 2     | 4864   | 151936  | yes  | yes      | 0.49e9     |

(Llama 3 = Llama-3.1 / 3.3 Instruct, max_position_embeddings 131072 with llama3 RoPE scaling; Qwen2.5:
32768.) `shape_from_hf_config` reads the keys `tools.convert_hf` converts from; it checks them by
name but not the architecture's other features, which conversion checks.
"""

from __future__ import annotations

import json
import os

from core.config import ConfigError, ModelConfig

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             intermediate_size=14336, max_seq_len=131072, rope_theta=500000.0,
                             rope_scaling=_LLAMA31_ROPE, norm_eps=1e-5),
    "llama3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              intermediate_size=28672, max_seq_len=131072, rope_theta=500000.0,
                              rope_scaling=_LLAMA31_ROPE, norm_eps=1e-5),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                              intermediate_size=18944, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-6,
                              qkv_bias=True),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, n_layers=24, n_heads=14, n_kv_heads=2,
                                intermediate_size=4864, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-6,
                                qkv_bias=True, tie_embeddings=True),
}


def preset(name: str) -> ModelConfig:
    """A copy of the named preset; ConfigError listing the names otherwise."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    c = PRESETS[name]
    return ModelConfig(**{**c.__dict__, "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None})


def _positive(c: dict, key: str, where: str, default=None) -> int:
    v = c.get(key, default)
    if v is None:
        raise ConfigError(f"{where}: missing key '{key}'")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{where}: key '{key}' must be a positive integer, found {v!r}")
    return v


def shape_from_hf_config(path: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face `config.json` (`path`: the file or its folder): sizes, RoPE theta,
    tied embeddings, and the qkv bias of Qwen2. ConfigError naming the file and the key."""
    where = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(where, encoding="utf-8") as f:
            c = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file (expected a Hugging Face config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: cannot read ({e})") from e
    if not isinstance(c, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    H, nh = _positive(c, "hidden_size", where), _positive(c, "num_attention_heads", where)
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else c
    archs = c.get("architectures") or []
    cfg = ModelConfig(vocab_size=_positive(c, "vocab_size", where), hidden_size=H,
                      n_layers=_positive(c, "num_hidden_layers", where), n_heads=nh,
                      n_kv_heads=_positive(c, "num_key_value_heads", where, nh),
                      intermediate_size=_positive(c, "intermediate_size", where),
                      head_dim=_positive(c, "head_dim", where, H // nh),
                      max_seq_len=_positive(c, "max_position_embeddings", where),
                      rope_theta=float(rope.get("rope_theta", 10000.0)),
                      norm_eps=float(c.get("rms_norm_eps", 1e-6)), qkv_bias="Qwen2ForCausalLM" in archs,
                      tie_embeddings=bool(c.get("tie_word_embeddings", False)))
    try:
        return cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e
