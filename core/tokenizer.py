"""The sentencepiece tokenizer wrapper and its fingerprint.

`Tokenizer.fingerprint` is the sha256 (hex) of the serialized sentencepiece model proto: two
tokenizers with the same fingerprint map every string to the same ids. Checkpoints record it so
that a policy and its reference (or a resumed run) can refuse a different tokenizer.

The shipped default (`core/data/tokenizer.model`, built by `tools.train_tokenizer` from
`core/data/corpus.txt`) has ids pad=0, bos=1, eos=2, unk=3, splits digits, applies no Unicode
normalisation and adds no dummy-prefix space, so `decode(encode(a) + encode(b)) == a + b` for text
made of the characters in the corpus (all the built-in tasks use).
"""

from __future__ import annotations

import hashlib
import os

import sentencepiece as spm

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEFAULT_TOKENIZER = os.path.join(DATA_DIR, "tokenizer.model")
DEFAULT_CORPUS = os.path.join(DATA_DIR, "corpus.txt")


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message names the file."""


class Tokenizer:
    """A loaded sentencepiece model. `path` is kept for messages only."""

    def __init__(self, model_proto: bytes, path: str = "<memory>"):
        self.path = path
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_proto)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError on a bad proto
            raise TokenizerError(f"{path}: not a valid sentencepiece model ({e})") from e
        self._proto = self._sp.serialized_model_proto()
        self.fingerprint = hashlib.sha256(self._proto).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = list(self._sp.encode(text))
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids) -> str:
        """Text of `ids` (a list of ints or a 1-D tensor); bos/eos/pad ids are dropped."""
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"decode: id {bad[0]} is outside the vocabulary [0, {n})")
        return self._sp.decode(ids)

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def serialized_model_proto(self) -> bytes:
        return self._proto

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, fingerprint={self.fingerprint[:12]})"


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """Load a sentencepiece `.model` file; None loads the shipped default."""
    path = DEFAULT_TOKENIZER if path is None else path
    try:
        with open(path, "rb") as f:
            proto = f.read()
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file {path}: {e}") from e
    return Tokenizer(proto, path)
