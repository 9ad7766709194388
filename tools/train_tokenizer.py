"""Build a tokenizer from a text file: a sentencepiece model, or a Hugging Face checkpoint tokenizer.

    python -m tools.train_tokenizer --input TEXT --vocab-size N --out PREFIX
    python -m tools.train_tokenizer --input TEXT --vocab-size N --hf-style qwen2|llama3 --out DIR

writes PREFIX.model (and PREFIX.vocab, one "piece<TAB>score" per line). Ids: pad=0, bos=1,
eos=2, unk=3. Every character of the input is covered (character_coverage=1.0); `--byte-fallback`
also maps unseen characters to byte pieces (needs --vocab-size above 260). No normalisation, no
dummy prefix, digits split, so encoding is reversible for the input's characters. Training is
single-threaded, in memory and deterministic: the same input and options give a byte-identical
model (so the same fingerprint) whatever the output path.

`--hf-style` instead writes into DIR what a Hugging Face chat checkpoint ships (`train_hf_tokenizer`):
a byte-level BPE `tokenizer.json` trained with the `tokenizers` library (the pre-tokenizer regex and
pipeline of Qwen2 or Llama 3), `tokenizer_config.json` with a `chat_template` (ChatML for qwen2, the
Llama 3 header format for llama3), `special_tokens_map.json` and `generation_config.json` with
several EOS ids -- the same files `transformers.AutoTokenizer` and `core.tokenizer.load_tokenizer` read.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys

import sentencepiece as spm


def train_tokenizer(input_path: str, vocab_size: int, out_prefix: str, byte_fallback: bool = False,
                    model_type: str = "bpe") -> str:
    """Train on the lines of `input_path`; returns the path of the written `.model` file."""
    with open(input_path, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    if not lines:
        raise ValueError(f"{input_path}: no non-empty lines to train on")
    if vocab_size < 8:
        raise ValueError(f"--vocab-size must be at least 8, got {vocab_size}")
    buf = io.BytesIO()  # in memory: the proto then records no output path, so it is path independent
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        byte_fallback=byte_fallback,
        split_digits=True,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3,
        num_threads=1,
        minloglevel=2,
    )
    proto = buf.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    _write_atomic(out_prefix + ".model", proto)
    _write_atomic(out_prefix + ".vocab", vocab.encode("utf-8"))
    return out_prefix + ".model"


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Hugging Face style: tokenizer.json + tokenizer_config.json (chat_template) + generation_config.json

# The pre-tokenizer regexes of Qwen2 and Llama 3 (GPT-4 style; Llama 3 groups digits by three).
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_REGEX = _QWEN2_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

# ChatML as Qwen2 Instruct uses it: a default system turn; no whitespace control, so the output
# depends on trim_blocks/lstrip_blocks being on, as transformers sets them.
QWEN2_CHAT_TEMPLATE = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

# The Llama 3 Instruct header format: bos_token first, contents trimmed, every turn ends in <|eot_id|>.
LLAMA3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' %}"
    "{%- if loop.index0 == 0 %}{%- set content = bos_token + content %}{%- endif %}"
    "{{- content }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

HF_STYLES = {
    "qwen2": dict(regex=_QWEN2_REGEX, nfc=True, template=QWEN2_CHAT_TEMPLATE, cls="Qwen2Tokenizer",
                  specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>",
                  pad="<|endoftext|>", gen_eos=["<|im_end|>", "<|endoftext|>"], cleanup=False),
    "llama3": dict(regex=_LLAMA3_REGEX, nfc=False, template=LLAMA3_CHAT_TEMPLATE, cls="PreTrainedTokenizerFast",
                   specials=["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                             "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eom_id|>", "<|eot_id|>"], bos="<|begin_of_text|>", eos="<|eot_id|>",
                   pad=None, gen_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], cleanup=True),
}


def _hf_pipeline(style: dict):
    """An untrained byte-level BPE `tokenizers.Tokenizer` with the style's normaliser and pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    if style["nfc"]:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(style["regex"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_hf_tokenizer(input_path: str, out_dir: str, vocab_size: int = 512, style: str = "qwen2") -> str:
    """Train a byte-level BPE of `vocab_size` pieces (ids 0..vocab_size-1, the 256 byte pieces first) on
    the lines of `input_path`, append the style's special tokens after them, and write tokenizer.json,
    tokenizer_config.json, special_tokens_map.json and generation_config.json into `out_dir`."""
    from tokenizers import AddedToken, pre_tokenizers, processors, trainers

    if style not in HF_STYLES:
        raise ValueError(f"--hf-style must be one of {sorted(HF_STYLES)}, got {style!r}")
    if vocab_size <= 256:
        raise ValueError(f"--vocab-size must exceed the 256 byte pieces of a byte-level BPE, got {vocab_size}")
    with open(input_path, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    if not lines:
        raise ValueError(f"{input_path}: no non-empty lines to train on")
    st = HF_STYLES[style]
    tok = _hf_pipeline(st)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in st["specials"]])
    ids = {t: tok.token_to_id(t) for t in st["specials"]}
    if st["bos"] is not None:  # Llama 3 prepends <|begin_of_text|> when asked for special tokens
        tok.post_processor = processors.TemplateProcessing(
            single=f"{st['bos']} $A", pair=f"{st['bos']} $A {st['bos']} $B",
            special_tokens=[(st["bos"], ids[st["bos"]])])
    os.makedirs(out_dir, exist_ok=True)
    _write_atomic(os.path.join(out_dir, "tokenizer.json"), tok.to_str(pretty=True).encode("utf-8"))
    named = {k: st[k] for k in ("bos", "eos", "pad") if st[k] is not None}
    config = {
        "tokenizer_class": st["cls"], "chat_template": st["template"], "model_max_length": 4096,
        "clean_up_tokenization_spaces": st["cleanup"], "errors": "replace", "split_special_tokens": False,
        **{f"{k}_token": st[k] for k in ("bos", "eos", "pad")},
        "added_tokens_decoder": {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                               "single_word": False, "special": True} for t in st["specials"]},
    }
    gen = {"bos_token_id": ids[st["bos"] or st["specials"][0]], "eos_token_id": [ids[t] for t in st["gen_eos"]],
           "pad_token_id": ids[st["pad"]] if st["pad"] else None, "do_sample": False}
    for name, obj in (("tokenizer_config.json", config), ("generation_config.json", gen),
                      ("special_tokens_map.json", {f"{k}_token": v for k, v in named.items()})):
        _write_atomic(os.path.join(out_dir, name), json.dumps(obj, indent=2, ensure_ascii=False).encode("utf-8"))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="UTF-8 text file, one example per line")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--out", required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab "
                    "(with --hf-style: an output folder)")
    ap.add_argument("--byte-fallback", action="store_true")
    ap.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    ap.add_argument("--hf-style", default=None, choices=sorted(HF_STYLES),
                    help="write a Hugging Face tokenizer folder (byte-level BPE + chat template) instead")
    args = ap.parse_args(argv)
    if args.hf_style:
        try:
            out = train_hf_tokenizer(args.input, args.out, args.vocab_size, args.hf_style)
        except (OSError, ValueError) as e:
            print(f"train_tokenizer: {e}", file=sys.stderr)
            return 1
        print(f"wrote {out}/tokenizer.json, tokenizer_config.json, generation_config.json, special_tokens_map.json")
        return 0
    try:
        path = train_tokenizer(args.input, args.vocab_size, args.out, args.byte_fallback, args.model_type)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"train_tokenizer: {e}", file=sys.stderr)
        return 1
    with open(path, "rb") as f:
        print(f"wrote {path} (sha256 {hashlib.sha256(f.read()).hexdigest()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
