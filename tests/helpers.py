"""Helpers shared by several test modules (a test module never imports another).

Layout tests: `VARIANTS` (two tiny model shapes), `model_config(variant)`, `global_batch(cfg, device)`.
Conversion tests: `make_hf(kind, path, seed)` saves a random transformers Llama / Qwen2 / Mistral.
"""

from __future__ import annotations

import pytest
import torch

from core.config import ModelConfig

VARIANTS = {
    "v131_untied": dict(vocab_size=131, tie_embeddings=False, qkv_bias=False, ac=False),
    "v128_tied_bias_ac": dict(vocab_size=128, tie_embeddings=True, qkv_bias=True, ac=True),
}
B, S, SEED, STEPS = 4, 8, 7, 3


def model_config(variant: str) -> ModelConfig:
    v = VARIANTS[variant]
    return ModelConfig(vocab_size=v["vocab_size"], hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       intermediate_size=64, max_seq_len=S, tie_embeddings=v["tie_embeddings"],
                       qkv_bias=v["qkv_bias"])


def global_batch(cfg: ModelConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, targets [B, S]; some targets ignored (-100), more in the first rows."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    ignore = torch.zeros(B, S, dtype=torch.bool)
    ignore[0, :5] = True
    ignore[1, 3] = True
    ignore[3, -1] = True
    return ids.to(device), tgt.masked_fill(ignore, -100).to(device)


SMALL = dict(vocab_size=131, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def _randomise(model, seed):
    """Weights of order 1 (not HF's 0.02 init), so logits are O(1) and a 1e-4 match means something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
    return model


def make_hf(kind: str, path: str, seed: int = 0, **kw):
    T = pytest.importorskip("transformers")
    if kind == "llama":
        cfg = T.LlamaConfig(**SMALL, max_position_embeddings=64, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, **kw)
        model = T.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = T.Qwen2Config(**SMALL, max_position_embeddings=64, tie_word_embeddings=True, **kw)
        model = T.Qwen2ForCausalLM(cfg)
    else:
        cfg = T.MistralConfig(**SMALL, max_position_embeddings=64, sliding_window=8, **kw)
        model = T.MistralForCausalLM(cfg)
    model = _randomise(model.float().eval(), seed)
    model.save_pretrained(path, max_shard_size="20KB" if kind == "qwen2" else "10GB")
    return model
