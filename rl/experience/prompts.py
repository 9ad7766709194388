"""Prompt data sets for RL: records from JSONL (or Parquet, with pyarrow), tokenized once, in one
global order that every DP/TP layout shares.

A record is a JSON object per line (blank lines skipped). `prompt_field` holds either a string or
a list of chat messages ({"role": str, "content": str}); `answer_field` (None: no answer) goes to the
reward as meta["answer"]. The text fed to the model is:
  apply_chat_template=True:  tokenizer.render_chat([system_prompt?] + messages, add_generation_prompt=True)
                             (a string prompt is one user message); no bos added (the template has it);
  apply_chat_template=False: prompt_template.format(prompt=...) of a string prompt, with bos prepended
                             when the tokenizer adds one (tokenizer.adds_bos).
Prompts of more than `max_prompt_tokens` tokens are dropped; `PromptSet.n_dropped` counts them.

Order (`PromptSampler`): epoch e is the permutation numpy.random.default_rng([seed, e]) of the
prompts (identity when shuffle=False); the epochs are concatenated and step s takes positions
[s*B, (s+1)*B) of that stream (B = prompts_per_step, global). DP rank r of dp takes the r-th of dp
equal contiguous slices of the step's B prompts. So the global batch of a step depends only on
(data, seed, B), never on dp or tp, and a resumed run continues from its step alone.

Eval: `eval_file`, or `eval_holdout` records held out of the training file (a seeded choice).
Every bad input raises PromptDataError naming the file, the line (Parquet: the row) and the field.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np


class PromptDataError(ValueError):
    """A prompt file that cannot be used; the message names the file, the line and the field."""


@dataclass
class PromptDataConfig:
    """The `data` section of an RL config (prompts from a file instead of a built-in task)."""

    train_file: str = ""  # .jsonl / .json lines, or .parquet (needs pyarrow)
    eval_file: str | None = None  # held-out prompts scored greedily (same fields)
    eval_holdout: int = 0  # or: hold out this many training records (seeded), when eval_file is None
    prompt_field: str = "prompt"  # a string, or a list of {"role", "content"} messages
    answer_field: str | None = "answer"  # meta["answer"] for the reward; None: records need no answer
    system_prompt: str | None = None  # chat only: prepended unless the messages start with a system turn
    apply_chat_template: bool = True
    prompt_template: str = "{prompt}"  # apply_chat_template=False: the text around a string prompt
    max_prompt_tokens: int | None = None  # longer prompts are dropped and counted
    shuffle: bool = True
    seed: int = 0
    epochs: int = 1

    def __post_init__(self):
        if not self.train_file:
            raise PromptDataError("data.train_file is required")
        if self.system_prompt is not None and not self.apply_chat_template:
            raise PromptDataError("data.system_prompt needs data.apply_chat_template=true")
        if "{prompt}" not in self.prompt_template:
            raise PromptDataError(f"data.prompt_template must contain '{{prompt}}', got {self.prompt_template!r}")
        if self.epochs < 1 or self.eval_holdout < 0 or (self.max_prompt_tokens is not None and
                                                        self.max_prompt_tokens < 1):
            raise PromptDataError(f"data: need epochs >= 1, eval_holdout >= 0, max_prompt_tokens >= 1 or null; "
                                  f"got {self.epochs}, {self.eval_holdout}, {self.max_prompt_tokens}")
        if self.eval_file is not None and self.eval_holdout:
            raise PromptDataError("data: set eval_file or eval_holdout, not both")


@dataclass
class Prompt:
    """One usable prompt: `ids` is what the model is given (bos included when there is one)."""

    index: int  # position among the file's kept records: the global order refers to it
    text: str
    ids: list[int]
    meta: dict = field(default_factory=dict)  # the record's other fields, "answer", "source": "file:line"


@dataclass
class PromptSet:
    path: str
    prompts: list[Prompt]
    n_read: int  # records read from the file
    n_dropped: int  # of those, dropped by max_prompt_tokens

    def summary(self) -> str:
        return (f"{self.path}: {len(self.prompts)} prompts ({self.n_read} read, {self.n_dropped} dropped as longer "
                f"than max_prompt_tokens)")


def read_records(path: str) -> list[tuple[int, dict]]:
    """[(line number from 1 (Parquet: row from 1), record dict)] of a JSONL or Parquet file."""
    if path.endswith(".parquet"):
        return _read_parquet(path)
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PromptDataError(f"{path}:{n}: malformed JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(rec, dict):
                    raise PromptDataError(f"{path}:{n}: expected a JSON object, found {type(rec).__name__}")
                out.append((n, rec))
    except (OSError, UnicodeDecodeError) as e:
        raise PromptDataError(f"{path}: cannot read ({e})") from e
    if not out:
        raise PromptDataError(f"{path}: no records (the file is empty)")
    return out


def _read_parquet(path: str) -> list[tuple[int, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptDataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise PromptDataError(f"{path}: cannot read as Parquet ({type(e).__name__}: {e})") from e
    if not rows:
        raise PromptDataError(f"{path}: no records (the file is empty)")
    return list(enumerate(rows, 1))


def _messages(cfg: PromptDataConfig, value, where: str) -> list[dict]:
    if isinstance(value, str):
        msgs = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        msgs = [{"role": m["role"], "content": m["content"]} for m in value]
    else:
        raise PromptDataError(f"{where}: field '{cfg.prompt_field}' must be a string or a non-empty list of "
                              f"{{\"role\": str, \"content\": str}} messages, found {value!r:.80}")
    if cfg.system_prompt is not None and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": cfg.system_prompt})
    return msgs


def _prompt_input(cfg: PromptDataConfig, rec: dict, where: str) -> list[dict] | str:
    """The chat messages (apply_chat_template) or the plain text of a record, checked."""
    if cfg.prompt_field not in rec:
        raise PromptDataError(f"{where}: missing field '{cfg.prompt_field}' (fields: {sorted(rec)})")
    value = rec[cfg.prompt_field]
    if isinstance(value, str) and not value.strip():
        raise PromptDataError(f"{where}: field '{cfg.prompt_field}' is empty")
    if isinstance(value, list) and any(isinstance(m, dict) and m.get("content") == "" for m in value):
        raise PromptDataError(f"{where}: field '{cfg.prompt_field}' holds a message with empty content")
    if cfg.apply_chat_template:
        return _messages(cfg, value, where)
    if not isinstance(value, str):
        raise PromptDataError(f"{where}: field '{cfg.prompt_field}' is a {type(value).__name__}; chat messages "
                              f"need data.apply_chat_template=true")
    return cfg.prompt_template.format(prompt=value)


def _meta(cfg: PromptDataConfig, rec: dict, where: str) -> dict:
    meta = {k: v for k, v in rec.items() if k != cfg.prompt_field}
    if cfg.answer_field is not None:
        if cfg.answer_field not in rec or rec[cfg.answer_field] is None:
            raise PromptDataError(f"{where}: missing field '{cfg.answer_field}' (the answer; fields: {sorted(rec)})")
        meta["answer"] = rec[cfg.answer_field] if isinstance(rec[cfg.answer_field], str) else str(rec[cfg.answer_field])
    meta["source"] = where
    return meta


def load_prompt_set(path: str, cfg: PromptDataConfig, tokenizer, records=None) -> PromptSet:
    """Read, render and tokenize (one batched call) the prompts of `path`; drop the over-long ones."""
    records = read_records(path) if records is None else records
    if cfg.apply_chat_template and tokenizer.chat_template is None:
        raise PromptDataError(f"{path}: data.apply_chat_template is true but the tokenizer {tokenizer.path} has no "
                              f"chat_template (set data.apply_chat_template=false for plain prompts)")
    inputs = [_prompt_input(cfg, rec, f"{path}:{n}") for n, rec in records]  # every record checked first
    metas = [_meta(cfg, rec, f"{path}:{n}") for n, rec in records]
    texts = [tokenizer.render_chat(x, add_generation_prompt=True) if cfg.apply_chat_template else x for x in inputs]
    bos = not cfg.apply_chat_template and tokenizer.adds_bos
    ids = tokenizer.encode_batch(texts, bos=bos)
    keep = [i for i, x in enumerate(ids) if cfg.max_prompt_tokens is None or len(x) <= cfg.max_prompt_tokens]
    if not keep:
        raise PromptDataError(f"{path}: all {len(ids)} prompts are longer than max_prompt_tokens="
                              f"{cfg.max_prompt_tokens} (shortest: {min(map(len, ids))} tokens)")
    prompts = [Prompt(k, texts[i], ids[i], {**metas[i], "prompt": texts[i]}) for k, i in enumerate(keep)]
    return PromptSet(path, prompts, len(ids), len(ids) - len(keep))


def load_prompt_data(cfg: PromptDataConfig, tokenizer) -> tuple[PromptSet, PromptSet | None]:
    """(train set, eval set or None) as `cfg` says. A file that is not there is named with its key."""
    for key, path in (("data.train_file", cfg.train_file), ("data.eval_file", cfg.eval_file)):
        if path is not None and not os.path.isfile(path):
            hint = "; set it to an existing file, or data.eval_file=null for no eval" if key == "data.eval_file" else ""
            raise PromptDataError(f"{key}={path}: no such file{hint}")
    if cfg.eval_file is not None:
        return load_prompt_set(cfg.train_file, cfg, tokenizer), load_prompt_set(cfg.eval_file, cfg, tokenizer)
    records = read_records(cfg.train_file)
    if not cfg.eval_holdout:
        return load_prompt_set(cfg.train_file, cfg, tokenizer, records), None
    if cfg.eval_holdout >= len(records):
        raise PromptDataError(f"{cfg.train_file}: eval_holdout={cfg.eval_holdout} leaves no training records "
                              f"(the file has {len(records)})")
    held = set(np.random.default_rng([cfg.seed, len(records)]).choice(len(records), cfg.eval_holdout,
                                                                       replace=False).tolist())
    train = [r for i, r in enumerate(records) if i not in held]
    evals = [r for i, r in enumerate(records) if i in held]
    return (load_prompt_set(cfg.train_file, cfg, tokenizer, train),
            load_prompt_set(cfg.train_file, cfg, tokenizer, evals))


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_hashes(cfg: PromptDataConfig) -> dict:
    """{path: sha256 of its bytes} of the training (and eval) file: a resume compares them."""
    paths = [cfg.train_file] + ([cfg.eval_file] if cfg.eval_file is not None else [])
    try:
        return {p: file_sha256(p) for p in paths}
    except OSError as e:
        raise PromptDataError(f"{e.filename}: cannot read ({e.strerror})") from e


class PromptSampler:
    """The global prompt order (see the module docstring) and each DP rank's slice of a step.
    `files`: `data_hashes` of the data set, carried by the state so that a resume on a replaced file
    (same number of records or not) is refused by name."""

    def __init__(self, n_prompts: int, prompts_per_step: int, *, seed: int = 0, shuffle: bool = True,
                 epochs: int = 1, files: dict | None = None):
        if n_prompts < 1 or prompts_per_step < 1:
            raise PromptDataError(f"PromptSampler: need prompts and prompts_per_step >= 1, got {n_prompts}, "
                                  f"{prompts_per_step}")
        self.n, self.B, self.seed, self.shuffle, self.epochs = n_prompts, prompts_per_step, seed, shuffle, epochs
        self.files = dict(files or {})
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_steps(self) -> int:
        """Steps until `epochs` passes are used up (a last partial batch is not drawn)."""
        return self.epochs * self.n // self.B

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: (np.random.default_rng([self.seed, epoch]).permutation(self.n) if self.shuffle
                                   else np.arange(self.n))}
        return self._perms[epoch]

    def global_indices(self, step: int) -> list[int]:
        """The B prompt indices of `step`, in order; the same for every DP/TP layout."""
        if not 0 <= step < self.num_steps:
            raise PromptDataError(f"step {step} is past the data: {self.epochs} epoch(s) of {self.n} prompts give "
                                  f"{self.num_steps} steps of {self.B}")
        pos = range(step * self.B, (step + 1) * self.B)
        return [int(self._perm(p // self.n)[p % self.n]) for p in pos]

    def rank_indices(self, step: int, dp_rank: int, dp: int) -> list[int]:
        """DP rank `dp_rank`'s contiguous B/dp slice of `global_indices(step)`."""
        if self.B % dp or not 0 <= dp_rank < dp:
            raise PromptDataError(f"prompts_per_step={self.B} must be a multiple of dp={dp} (rank {dp_rank})")
        k = self.B // dp
        return self.global_indices(step)[dp_rank * k:(dp_rank + 1) * k]

    def state_dict(self) -> dict:
        out = {"n": self.n, "prompts_per_step": self.B, "seed": self.seed, "shuffle": self.shuffle}
        return {**out, "files": self.files} if self.files else out

    def check_state(self, state: dict) -> None:
        """Refuse resuming with other data or order settings (the step alone then says where we are):
        a data file whose sha256 differs from the checkpoint's is named (by position: the training file
        first, then the eval file; a moved but unchanged file is accepted)."""
        state = dict(state)
        old = state.pop("files", None)
        if old is not None and self.files:
            for (old_path, old_sha), (path, sha) in zip(old.items(), self.files.items()):
                if old_sha != sha:
                    raise PromptDataError(f"resume: {path} is not the file this run was trained on (sha256 "
                                          f"{sha[:12]}..., the checkpoint's {old_path} had {old_sha[:12]}...); "
                                          "restore that file, or start a new run with a new train.out_dir=...")
        mine = {k: v for k, v in self.state_dict().items() if k != "files"}
        if state != mine:
            raise PromptDataError(f"resume: the prompt order was {state}, now {mine}; the data set, "
                                  f"prompts_per_step, seed or shuffle changed")


def eval_rank_indices(n_prompts: int, dp_rank: int, dp: int) -> list[int]:
    """DP rank `dp_rank`'s contiguous share of an eval set of `n_prompts` (shares differ by at most one)."""
    lo, hi = n_prompts * dp_rank // dp, n_prompts * (dp_rank + 1) // dp
    return list(range(lo, hi))
