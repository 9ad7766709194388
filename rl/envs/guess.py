"""A guessing game with feedback: the prompt 'guess 0-15:' hides a number; each turn the model
writes a number and hears 'higher', 'lower' (or 'bad' for anything else) until it is right (reward
1, done) or the turns run out (0). `GuessTask` draws the prompts (make_task('guess'))."""

from __future__ import annotations

import random
from dataclasses import dataclass

from rl.envs.base import Turn


@dataclass
class GuessTask:
    """Prompts 'guess lo-hi:' with a secret uniform in [lo, hi]; single-turn reward: exact guess."""

    lo: int = 0
    hi: int = 15
    name: str = "guess"

    def __post_init__(self):
        if not 0 <= self.lo < self.hi:
            raise ValueError(f"GuessTask: need 0 <= lo < hi, got {self.lo}, {self.hi}")

    def sample_prompts(self, n: int, rng: random.Random) -> list[tuple[str, dict]]:
        prompt = f"guess {self.lo}-{self.hi}:"
        return [(prompt, {"prompt": prompt, "answer": str(rng.randint(self.lo, self.hi))}) for _ in range(n)]

    def reward(self, meta: dict, response: str) -> float:
        return 1.0 if response.split("\n", 1)[0].strip() == meta["answer"] else 0.0


class GuessEpisode:
    def __init__(self, meta: dict):
        self.secret = int(meta["answer"])

    def step(self, text: str, ids: list[int]) -> Turn:
        t = text.split("\n", 1)[0].strip()
        if not (t.isdigit() and t.isascii() and len(t) <= 6):
            return Turn("bad", 0.0, done=False)
        g = int(t)
        if g == self.secret:
            return Turn("", 1.0, done=True)
        return Turn("higher" if g < self.secret else "lower", 0.0, done=False)


def guess_env(meta: dict) -> GuessEpisode:
    return GuessEpisode(meta)
