"""Build a sentencepiece BPE tokenizer from a text file.

    python -m tools.train_tokenizer --input TEXT --vocab-size N --out PREFIX

writes PREFIX.model (and PREFIX.vocab, one "piece<TAB>score" per line). Ids: pad=0, bos=1,
eos=2, unk=3. Every character of the input is covered (character_coverage=1.0); `--byte-fallback`
also maps unseen characters to byte pieces (needs --vocab-size above 260). No normalisation, no
dummy prefix, digits split, so encoding is reversible for the input's characters. Training is
single-threaded, in memory and deterministic: the same input and options give a byte-identical
model (so the same fingerprint) whatever the output path.
"""

from __future__ import annotations

import argparse
import hashlib
import io
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="UTF-8 text file, one example per line")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--out", required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab")
    ap.add_argument("--byte-fallback", action="store_true")
    ap.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    args = ap.parse_args(argv)
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
