"""Tokenizers: one `Tokenizer` type over a sentencepiece model or a Hugging Face `tokenizer.json`.

`load_tokenizer(path)` accepts None (the shipped tiny sentencepiece model), a file (`*.json`: an HF
tokenizer.json; anything else: a sentencepiece model), or a folder (a checkpoint: `tokenizer.json` if
present -- read with the `tokenizers` library, as transformers does -- else `tokenizer.model`). Beside
the tokenizer, a folder's `tokenizer_config.json` (chat_template, bos/eos/pad/unk tokens) and
`generation_config.json` (eos_token_id, a list for Llama 3 / Qwen2 Instruct) are read when present.

| attribute        | sentencepiece                          | tokenizer.json                               |
|------------------|----------------------------------------|----------------------------------------------|
| encode(text)     | sp pieces; "</s>" in text is plain text | added/special-token strings in the text map  |
|                  |                                        | to their ids (= AutoTokenizer.encode(text,   |
|                  |                                        | add_special_tokens=False))                   |
| decode(ids)      | bos/eos/pad (control) ids decode to "" | every id decodes, special tokens included    |
|                  |                                        | (= AutoTokenizer.decode(ids))                |
| bos_id           | the model's bos                        | tokenizer_config's bos_token, else None      |
| eos_ids          | [model eos] + generation_config's      | [tokenizer_config eos_token] + generation_   |
|                  |                                        | config's eos_token_id, in order, no repeats  |
| pad_id           | the model's pad                        | pad_token, else generation_config's, or None |
| adds_bos         | True (kltron prompts start with bos)   | whether the post-processor prepends bos      |
| vocab_size       | piece count                            | largest id + 1 (added tokens included)       |
| fingerprint      | sha256 of the serialized model proto   | sha256 over "name\\0sha256(file)\\n" of the  |
|                  | (unchanged: older checkpoints match)   | tokenizer files present (TOKENIZER_FILES)    |

`vocab_size` is the tokenizer's; the model's embedding may be larger (padded rows). Chat rendering
(core.chat_template) follows transformers' Jinja environment; `render_chat` then `encode` gives the
ids of `apply_chat_template(..., tokenize=True)`. Every error names the file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence

import sentencepiece as spm

from core.chat_template import ChatTemplateError, render_chat_template

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEFAULT_TOKENIZER = os.path.join(DATA_DIR, "tokenizer.model")
DEFAULT_CORPUS = os.path.join(DATA_DIR, "corpus.txt")
# The files that travel with a checkpoint (tools.convert_hf copies them); the first three are hashed
# into an HF tokenizer's fingerprint when present (the tokenizer file given counts as tokenizer.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message names the file."""


class _SentencePiece:
    def __init__(self, proto: bytes, path: str):
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(proto)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError on a bad proto
            raise TokenizerError(f"{path}: not a valid sentencepiece model ({e})") from e
        self.proto = self._sp.serialized_model_proto()
        self.size = self._sp.get_piece_size()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(x) for x in self._sp.encode(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return list(self._sp.decode(batch)) if batch else []

    def id_to_piece(self, i: int) -> str | None:
        return self._sp.id_to_piece(i)

    def piece_to_id(self, piece: str) -> int | None:
        i = self._sp.piece_to_id(piece)
        return None if i == self._sp.unk_id() and piece != self._sp.id_to_piece(i) else i


class _HFTokenizers:
    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(path)
        except Exception as e:  # tokenizers raises a plain Exception on a malformed file
            raise TokenizerError(f"{path}: not a valid Hugging Face tokenizer.json ({e})") from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.size = max(vocab.values()) + 1 if vocab else 0
        bos_probe = self._tok.encode("a", add_special_tokens=True).ids
        plain = self._tok.encode("a", add_special_tokens=False).ids
        self.prepended = bos_probe[0] if len(bos_probe) > len(plain) and bos_probe[1:] == plain else None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return self._tok.decode_batch(batch, skip_special_tokens=False) if batch else []

    def id_to_piece(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def piece_to_id(self, piece: str) -> int | None:
        return self._tok.token_to_id(piece)


class Tokenizer:
    """A loaded tokenizer (see the module table). `path` names it in messages."""

    def __init__(self, backend, path: str, fingerprint: str, *, bos_id: int | None, eos_ids: list[int],
                 pad_id: int | None, unk_id: int | None, adds_bos: bool, chat_template: str | None = None,
                 special_tokens: dict | None = None, config_path: str | None = None):
        self._b, self.path, self.fingerprint = backend, path, fingerprint
        self.bos_id, self.eos_ids, self.pad_id, self.unk_id = bos_id, list(eos_ids), pad_id, unk_id
        self.adds_bos, self.chat_template = adds_bos, chat_template
        self.special_tokens = dict(special_tokens or {})  # {"bos_token": "<s>", ...}: chat template variables
        self._config_path = config_path or os.path.join(os.path.dirname(path), "tokenizer_config.json")

    @classmethod
    def from_sentencepiece(cls, model_proto: bytes, path: str = "<memory>") -> Tokenizer:
        b = _SentencePiece(model_proto, path)
        sp = b._sp
        ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id(), "unk": sp.unk_id()}
        ids = {k: (v if v >= 0 else None) for k, v in ids.items()}  # sentencepiece says -1 for "none"
        return cls(b, path, hashlib.sha256(b.proto).hexdigest(), bos_id=ids["bos"],
                   eos_ids=[ids["eos"]] if ids["eos"] is not None else [], pad_id=ids["pad"], unk_id=ids["unk"],
                   adds_bos=ids["bos"] is not None,
                   special_tokens={f"{k}_token": sp.id_to_piece(v) for k, v in ids.items() if v is not None})

    @property
    def vocab_size(self) -> int:
        return self._b.size

    @property
    def eos_id(self) -> int | None:
        """The first EOS id (the tokenizer_config's eos_token); generation stops on any of `eos_ids`."""
        return self.eos_ids[0] if self.eos_ids else None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of `text`, no special tokens added; `bos`/`eos` prepend bos_id / append eos_id."""
        return self.encode_batch([text], bos=bos, eos=eos)[0]

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        """`encode` over many texts in one call (the backend batches; use it for a step's prompts)."""
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"encode expects str, got {type(t).__name__}")
        if bos and self.bos_id is None:
            raise TokenizerError(f"{self.path}: bos requested but the tokenizer has no bos token")
        if eos and self.eos_id is None:
            raise TokenizerError(f"{self.path}: eos requested but the tokenizer has no eos token")
        out = self._b.encode_batch(texts) if texts else []
        if bos or eos:
            out = [([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else []) for ids in out]
        return out

    def decode(self, ids) -> str:
        """Text of `ids` (a list of ints or a 1-D tensor). An id the tokenizer does not have (e.g. a
        padded embedding row, id >= vocab_size) raises ValueError."""
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size or self._b.id_to_piece(i) is None]
        if bad:
            raise ValueError(f"decode: id {bad[0]} is outside the vocabulary [0, {self.vocab_size}) of {self.path}")
        return self._b.decode(ids)

    def decode_batch(self, batch: Sequence[list[int]]) -> list[str]:
        """`decode` of each list of ids, in one backend call (a rollout decodes every response)."""
        batch = [[int(i) for i in ids] for ids in batch]
        V, holes = self.vocab_size, self._holes
        for ids in batch:
            bad = [i for i in ids if not 0 <= i < V or i in holes]
            if bad:
                raise ValueError(f"decode: id {bad[0]} is outside the vocabulary [0, {V}) of "
                                 f"{self.path}")
        return self._b.decode_batch(batch)

    @functools.cached_property
    def _holes(self) -> frozenset:
        """Ids below vocab_size without a piece (a Hugging Face vocabulary can skip ids): looked up once."""
        return frozenset(i for i in range(self.vocab_size) if self._b.id_to_piece(i) is None)

    def id_to_piece(self, i: int) -> str:
        return self._b.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int | None:
        return self._b.piece_to_id(piece)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
                    documents: list[dict] | None = None, **kwargs) -> str:
        """The chat_template rendered for `messages` ([{"role": ..., "content": ...}, ...]; an assistant
        turn's reasoning under "reasoning_content" or "thinking"), with `tools` (JSON-schema dicts) and
        `documents` ({"title", "text"} dicts) when the template reads them and any extra template
        variable as a keyword (e.g. enable_thinking=False), as transformers'
        `apply_chat_template(messages, tokenize=False, ...)`."""
        if self.chat_template is None:
            raise TokenizerError(f"{self._config_path}: no chat_template (tokenizer {self.path})")
        try:
            return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, documents=documents, special_tokens=self.special_tokens,
                                        where=self._config_path, **kwargs)
        except ChatTemplateError as e:
            raise TokenizerError(str(e)) from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Ids of `render_chat(...)` (= apply_chat_template(..., tokenize=True)); takes its keywords."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs))

    def serialized_model_proto(self) -> bytes:
        if not isinstance(self._b, _SentencePiece):
            raise TokenizerError(f"{self.path}: not a sentencepiece tokenizer")
        return self._b.proto

    def __repr__(self) -> str:
        return (f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, "
                f"fingerprint={self.fingerprint[:12]})")


# ---------------------------------------------------------------------------------------------
# loading


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from e
    if not isinstance(obj, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return obj


def _token_str(v, where: str, key: str) -> str | None:
    """A special token as tokenizer_config writes it: a string, an AddedToken dict, or null."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    raise TokenizerError(f"{where}: key '{key}' is {v!r}; expected a string, an AddedToken object or null")


def _id_of(tok_backend, token: str | None, where: str, key: str) -> int | None:
    if token is None:
        return None
    i = tok_backend.piece_to_id(token)
    if i is None:
        raise TokenizerError(f"{where}: key '{key}' names {token!r}, which is not in the vocabulary")
    return i


def _sidecars(folder: str, backend) -> dict:
    """What tokenizer_config.json and generation_config.json add: special tokens, eos ids, template."""
    cpath, gpath = os.path.join(folder, "tokenizer_config.json"), os.path.join(folder, "generation_config.json")
    cfg, gen = _read_json(cpath) or {}, _read_json(gpath) or {}
    tokens = {k: _token_str(cfg.get(k), cpath, k) for k in _NAMED_TOKENS}
    ids = {k: _id_of(backend, t, cpath, k) for k, t in tokens.items()}
    gen_eos = gen.get("eos_token_id")
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else (gen_eos or [])
    if not isinstance(gen_eos, list) or not all(isinstance(i, int) and 0 <= i < backend.size for i in gen_eos):
        raise TokenizerError(f"{gpath}: key 'eos_token_id' is {gen.get('eos_token_id')!r}; expected ids in "
                             f"[0, {backend.size})")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # several named templates: transformers uses the one named "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise TokenizerError(f"{cpath}: key 'chat_template' is a list without a 'default' entry")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{cpath}: key 'chat_template' is a {type(template).__name__}, expected a string")
    pad = ids["pad_token"] if ids["pad_token"] is not None else gen.get("pad_token_id")
    return {"tokens": {k: v for k, v in tokens.items() if v is not None}, "ids": ids, "gen_eos": gen_eos,
            "template": template, "pad": pad, "config_path": cpath}


def _fingerprint(files: Sequence[tuple[str, str]]) -> str:
    """sha256 over "name\0sha256(content)\n" of the (name, path) pairs whose file exists."""
    h = hashlib.sha256()
    for name, p in files:
        if os.path.isfile(p):
            with open(p, "rb") as f:
                h.update(f"{name}\0{hashlib.sha256(f.read()).hexdigest()}\n".encode())
    return h.hexdigest()


def _load_hf(path: str) -> Tokenizer:
    folder = os.path.dirname(os.path.abspath(path))
    b = _HFTokenizers(path)
    s = _sidecars(folder, b)
    eos = [i for i in (s["ids"]["eos_token"], *s["gen_eos"]) if i is not None]
    fp = _fingerprint([("tokenizer.json", path)] + [(n, os.path.join(folder, n)) for n in TOKENIZER_FILES[1:3]])
    return Tokenizer(b, path, fp, bos_id=s["ids"]["bos_token"], eos_ids=list(dict.fromkeys(eos)), pad_id=s["pad"],
                     unk_id=s["ids"]["unk_token"], adds_bos=b.prepended is not None, chat_template=s["template"],
                     special_tokens=s["tokens"], config_path=s["config_path"])


def _load_sentencepiece(path: str) -> Tokenizer:
    try:
        with open(path, "rb") as f:
            proto = f.read()
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file {path}: {e}") from e
    tok = Tokenizer.from_sentencepiece(proto, path)
    folder = os.path.dirname(os.path.abspath(path))
    if path != DEFAULT_TOKENIZER and any(os.path.isfile(os.path.join(folder, n))
                                         for n in ("tokenizer_config.json", "generation_config.json")):
        s = _sidecars(folder, tok._b)  # e.g. a Llama 2 checkpoint: tokenizer.model + its chat template
        tok.chat_template, tok._config_path = s["template"], s["config_path"]
        tok.special_tokens.update(s["tokens"])
        tok.eos_ids = list(dict.fromkeys(tok.eos_ids + s["gen_eos"]))
    return tok


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """Load the tokenizer at `path` (a checkpoint folder or a file; None: the shipped default)."""
    path = DEFAULT_TOKENIZER if path is None else os.fspath(path)
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(path, name)):
                return load_tokenizer(os.path.join(path, name))
        raise TokenizerError(f"{path}: a folder without tokenizer.json or tokenizer.model")
    if path.endswith(".json"):
        if not os.path.isfile(path):
            raise TokenizerError(f"cannot read tokenizer file {path}: not found")
        return _load_hf(path)
    return _load_sentencepiece(path)
