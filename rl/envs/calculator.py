"""A calculator tool for the arithmetic task: the model may call `calc(12+30)` (or, in the built-in
tasks' character set, which has no parentheses, `calc:12+30=`), the environment answers with the
result; any other turn is the final answer, scored by exact match. Per-turn reward 0, final 1 or 0."""

from __future__ import annotations

import re

from rl.envs.base import Turn

_CALL = re.compile(r"^\s*calc\s*[(:]\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*[)=]?\s*$")
MAX_DIGITS = 12  # operands longer than this are a failed call, not a huge product


class CalculatorEpisode:
    def __init__(self, meta: dict):
        self.answer = str(meta["answer"]).strip()

    def step(self, text: str, ids: list[int]) -> Turn:
        t = text.split("\n", 1)[0].strip()
        if t.startswith("calc"):
            m = _CALL.match(t)
            if m is None or len(m.group(1)) > MAX_DIGITS or len(m.group(3)) > MAX_DIGITS:
                return Turn("error", 0.0, done=False, tool_call=True, tool_ok=False)
            a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
            value = a + b if op == "+" else a - b if op == "-" else a * b
            return Turn(str(value), 0.0, done=False, tool_call=True, tool_ok=True)
        return Turn("", 1.0 if t == self.answer else 0.0, done=True)


def calculator_env(meta: dict) -> CalculatorEpisode:
    return CalculatorEpisode(meta)
