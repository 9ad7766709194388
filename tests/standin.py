"""A tiny local stand-in for a published Hugging Face chat checkpoint (no hub access): a byte-level BPE
tokenizer with a chat template and several EOS ids (tools.train_tokenizer) and a random-weight model
saved by `transformers` `save_pretrained`, its embedding padded past the tokenizer as real ones are."""

from __future__ import annotations

import json
import os

import torch

from core.tokenizer import DEFAULT_CORPUS
from tools.train_tokenizer import train_hf_tokenizer

TOK_PIECES, MODEL_VOCAB = 300, 320  # the tokenizer has 303 (qwen2) / 308 (llama3) ids; the embedding 320 rows


def hf_standin(folder: str, style: str = "qwen2", seed: int = 0, max_positions: int = 256,
               chat_template: str | None = None) -> str:
    """Write tokenizer files, config.json and model.safetensors into `folder` (Qwen2 or Llama 3 style);
    `chat_template` replaces the tokenizer's plain one (e.g. a tools-aware template)."""
    import transformers

    os.makedirs(folder, exist_ok=True)
    train_hf_tokenizer(DEFAULT_CORPUS, folder, TOK_PIECES, style)
    if chat_template is not None:
        cpath = os.path.join(folder, "tokenizer_config.json")
        with open(cpath, encoding="utf-8") as f:
            tcfg = json.load(f)
        tcfg["chat_template"] = chat_template
        with open(cpath, "w", encoding="utf-8") as f:
            json.dump(tcfg, f, indent=2, ensure_ascii=False)
    gen_path = os.path.join(folder, "generation_config.json")
    with open(gen_path, "rb") as f:
        gen = f.read()  # several EOS ids; save_pretrained writes the model's one
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    shape = dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    if style == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **shape))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=500000.0,
                                                                       **shape))
    model.save_pretrained(folder)
    with open(gen_path, "wb") as f:
        f.write(gen)
    return folder
