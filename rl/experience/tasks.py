"""Built-in verifiable tasks small enough for a tiny model and a tiny tokenizer.

Task API (anything with these two methods can be a task):

    task.sample_prompts(n, rng: random.Random) -> list[(prompt_text, meta)]
    task.reward(meta, response_text) -> float

`meta` is a dict holding at least {"prompt": prompt_text, "answer": answer_text}, so the prompt
plus answer is a supervised example (`sft_text`). Prompts and answers use only `CHARSET` (digits,
lowercase a-z, "+-=:" and space; string-task operands default to a-h), so a sentencepiece model
of a few dozen pieces covers them.

The response is compared after cutting it at the first newline and stripping spaces (the
tokenizer's EOS normally ends it already). Rewards:
  1.0  exact match with the answer;
  partial_credit (default 0.0, e.g. 0.1)  wrong, but well-formed: the right kind of characters
       and the answer's length (arithmetic: an optionally signed integer with the right number
       of digits; string tasks: letters from the task's alphabet, right length);
  0.0  otherwise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rl.envs.guess import GuessTask

CHARSET = "0123456789abcdefghijklmnopqrstuvwxyz+-=: "


def _clean(response: str) -> str:
    return response.split("\n", 1)[0].strip()


@dataclass
class ArithmeticTask:
    """'a+b=' or 'a-b=' with operands in [0, max_operand]; the answer is the decimal result."""

    max_operand: int = 99
    ops: str = "+-"
    partial_credit: float = 0.0
    name: str = "arithmetic"

    def __post_init__(self):
        if self.max_operand < 0 or not self.ops or set(self.ops) - set("+-"):
            raise ValueError(f"ArithmeticTask: need max_operand >= 0 and ops from '+-', got "
                             f"{self.max_operand}, {self.ops!r}")

    def sample_prompts(self, n: int, rng: random.Random) -> list[tuple[str, dict]]:
        out = []
        for _ in range(n):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            op = rng.choice(self.ops)
            prompt = f"{a}{op}{b}="
            out.append((prompt, {"prompt": prompt, "answer": str(a + b if op == "+" else a - b)}))
        return out

    def reward(self, meta: dict, response: str) -> float:
        got, want = _clean(response), meta["answer"]
        if got == want:
            return 1.0
        digits = got[1:] if got.startswith("-") else got
        if digits.isdigit() and digits.isascii() and len(got) == len(want):
            return self.partial_credit
        return 0.0


@dataclass
class StringTask:
    """'rev:cab=' -> 'bac' (op 'rev'), 'sort:cab=' -> 'abc' ('sort'), 'copy:cab=' -> 'cab' ('copy')."""

    op: str = "rev"
    alphabet: str = "abcdefgh"
    min_len: int = 2
    max_len: int = 6
    partial_credit: float = 0.0
    name: str = "string"

    def __post_init__(self):
        if self.op not in ("rev", "sort", "copy"):
            raise ValueError(f"StringTask: op must be 'rev', 'sort' or 'copy', got {self.op!r}")
        if not self.alphabet or set(self.alphabet) - set("abcdefghijklmnopqrstuvwxyz"):
            raise ValueError(f"StringTask: alphabet must use lowercase letters, got {self.alphabet!r}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"StringTask: need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")

    def _answer(self, s: str) -> str:
        return s[::-1] if self.op == "rev" else "".join(sorted(s)) if self.op == "sort" else s

    def sample_prompts(self, n: int, rng: random.Random) -> list[tuple[str, dict]]:
        out = []
        for _ in range(n):
            s = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
            prompt = f"{self.op}:{s}="
            out.append((prompt, {"prompt": prompt, "answer": self._answer(s)}))
        return out

    def reward(self, meta: dict, response: str) -> float:
        got, want = _clean(response), meta["answer"]
        if got == want:
            return 1.0
        if len(got) == len(want) and got and set(got) <= set(self.alphabet):
            return self.partial_credit
        return 0.0


TASKS = {"arithmetic": ArithmeticTask, "rev": StringTask, "sort": StringTask, "copy": StringTask}


def make_task(name: str, **kwargs):
    """A built-in task by name: 'arithmetic', 'rev', 'sort', 'copy' or 'guess' (the guessing game's
    prompts, rl/envs/guess.py) (kwargs go to the dataclass)."""
    if name == "guess":
        return GuessTask(name=name, **kwargs)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    if TASKS[name] is StringTask:
        kwargs = {"op": name, **kwargs}
    return TASKS[name](name=name, **kwargs)


def sft_text(meta: dict) -> str:
    """Prompt followed by its answer: a supervised example (or tokenizer training line)."""
    return meta["prompt"] + meta["answer"]
