"""Token stream for supervised next-token training: text -> fixed-length sequences, in a
deterministic order by seed, sharded over data-parallel ranks, with a resumable position.

The text file is read line by line; every non-empty line is tokenized and followed by EOS, and the
lines are concatenated into one token stream of N tokens. Sequence i is the window
`stream[i*S : i*S + S + 1]` (S = seq_len), giving `input_ids = window[:-1]` and
`targets = window[1:]`; there are (N - 1) // S of them. Each epoch visits every sequence once in the
order of `randperm(n_seq)` drawn from a generator seeded by (seed, epoch); an epoch's tail that
does not fill a global batch is dropped.

A global batch is `dp * micro_batch_size` consecutive entries of that order; DP rank r takes the
r-th block of `micro_batch_size`. The position (epoch, offset into the order) counts global
sequences, so it is the same on every rank and `state_dict()` / `load_state_dict()` resume
exactly -- also under a different dp, as long as the new global batch is what you want.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from core.tokenizer import DEFAULT_CORPUS, Tokenizer
from parallel.dims import derive_seed


class DataError(ValueError):
    """Data that cannot be used; the message names the file or the key."""


def tokenize_text_file(path: str | None, tokenizer: Tokenizer) -> torch.Tensor:
    """All non-empty lines of `path` (None: the shipped corpus), each as BOS line EOS -> int64 [N]
    (a line is a document, as a prompt is at sampling time)."""
    path = DEFAULT_CORPUS if path is None else path
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read data.text_file {path}: {e}") from e
    ids: list[int] = []
    for line in lines:
        if line.strip():
            ids.extend(tokenizer.encode(line, bos=True, eos=True))
    if not ids:
        raise DataError(f"data.text_file {path} holds no text")
    return torch.tensor(ids, dtype=torch.long, device="cpu")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [micro_batch_size, seq_len] int64
    targets: torch.Tensor  # [micro_batch_size, seq_len] int64, input_ids shifted left by one


class SequenceLoader:
    """Endless iterator of this DP rank's micro-batches from a token stream.

    tokens: [N] int64. Each `next()` returns a `Batch` of `micro_batch_size` sequences; every DP
    rank advances through the same global order in lock step."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, micro_batch_size: int, seed: int,
                 dp_rank: int = 0, dp: int = 1):
        if seq_len < 1 or micro_batch_size < 1:
            raise DataError(f"data.seq_len={seq_len} and data.micro_batch_size={micro_batch_size} "
                            "must be positive")
        self.tokens, self.seq_len, self.micro_batch_size = tokens, seq_len, micro_batch_size
        self.seed, self.dp_rank, self.dp = seed, dp_rank, dp
        self.n_seq = (tokens.numel() - 1) // seq_len
        if self.n_seq < self.global_batch:
            raise DataError(
                f"the text gives {self.n_seq} sequences of data.seq_len={seq_len} "
                f"({tokens.numel()} tokens), fewer than one global batch of dp={dp} x "
                f"data.micro_batch_size={micro_batch_size}; use a shorter seq_len or more text")
        # identifies the stream and its cut, so a resume with other data is refused
        self.fingerprint = hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16] + f":{seq_len}"
        self.epoch, self.offset = 0, 0
        self._order = self._epoch_order(0)

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch_size

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
        return torch.randperm(self.n_seq, generator=g, device="cpu")

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self.offset + self.global_batch > self.n_seq:  # drop the epoch's tail
            self.epoch, self.offset = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        start = self.offset + self.dp_rank * self.micro_batch_size
        idx = self._order[start:start + self.micro_batch_size]
        self.offset += self.global_batch
        S = self.seq_len
        windows = torch.stack([self.tokens[i * S:i * S + S + 1] for i in idx.tolist()])  # (mb, S+1)
        return Batch(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())

    def state_dict(self) -> dict:
        """Position in global sequences: {"epoch", "offset", "seed", "fingerprint"}."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "fingerprint": self.fingerprint}

    def load_state_dict(self, sd: dict) -> None:
        for key in ("epoch", "offset", "seed", "fingerprint"):
            if key not in sd:
                raise DataError(f"data loader state lacks '{key}'")
        if sd["fingerprint"] != self.fingerprint:
            raise DataError(f"data loader state was saved for another token stream or seq_len "
                            f"(fingerprint {sd['fingerprint']}, this data {self.fingerprint})")
        if sd["seed"] != self.seed:
            raise DataError(f"data loader state was saved with seed {sd['seed']}, this run has {self.seed}")
        self.epoch, self.offset = int(sd["epoch"]), int(sd["offset"])
        self._order = self._epoch_order(self.epoch)

