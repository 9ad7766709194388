"""Verifiable math rewards (reward plug-ins, `fn(meta, response) -> float`, see rl.experience.rewards).

`math_reward` compares the final answer of the response with meta["answer"] (1.0 equal, 0.0 not);
`format_reward` scores whether the response states a final answer in the expected form.
The reference's final answer is its "####" / \boxed{} answer, else the whole reference (a bare answer).

Final answer (`extract_answer`), of a response and of a reference alike, first found of:
  1. GSM8K: the text after the last "####", to the end of its line;
  2. the contents of the last \\boxed{...} or \\fbox{...} (nested braces matched; also "\\boxed 5");
  3. the last number in the text (`fallback_last_number=True`; 1,234.5 with thousands commas, -3, 7/2).

Equality (`answers_match`): the built-in normaliser first --
  numbers: "$1,000" and "1000.0" equal 1000 (no scientific notation); "\\frac{3}{4}", "\\dfrac34",
  "3/4" and "0.75" are one exact Fraction; "25%" and "25\\%" equal 25 and 0.25; "x = 5", "5 cm" and
  "5\\text{ cm}" equal 5;
  otherwise strings with spaces, "\\left"/"\\right", "\\!"/"\\,", "^\\circ", "\\text{}" wrappers, outer
  "$" and a trailing "." removed ("dfrac"/"tfrac" read as "frac"; plain words compared lowercased) --
then, only when that says "different" and `math-verify` is installed (optional extra), its symbolic
`verify(parse(gold), parse(answer))` (e.g. "\\sqrt{8}" vs "2\\sqrt{2}"), each parse and the comparison
limited to MV_TIMEOUT_S seconds in the main thread (past it: "not equal"; "\\boxed{10^{10^{10}}}" would
otherwise compute for hours). A number of more digits than Python converts (4,300) is compared as text.
A missing meta["answer"] raises KeyError naming the key: a reward is never silently 0 for bad data.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

try:  # optional: pip install math-verify
    from math_verify import parse as _mv_parse
    from math_verify import verify as _mv_verify
except ImportError:  # pragma: no cover - depends on the environment
    _mv_parse = _mv_verify = None

_GSM8K_RE = re.compile(r"####[ \t]*([^\n]*)")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\b\s*")
_NUMBER_RE = re.compile(r"(?:(?<![\w)\]}.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_SPACES = ("\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\left", "\\right")


def _boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} (braces balanced), or the token after "\\boxed "; None if absent
    or unbalanced."""
    matches = list(_BOXED_RE.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    if i < len(text) and text[i] != "{":
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str, fallback_last_number: bool = True) -> str | None:
    """The final answer stated in `text` (see the module docstring), stripped; None if there is none."""
    hits = _GSM8K_RE.findall(text)
    if hits and hits[-1].strip():
        return hits[-1].strip()
    boxed = _boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    if fallback_last_number:
        nums = _NUMBER_RE.findall(text)
        if nums:
            return nums[-1]
    return None


def _unwrap(s: str, command: str) -> str:
    """"\\text{abc}" -> "abc" for every (non-nested) occurrence of \\command{...}."""
    return re.sub(r"\\" + command + r"\s*\{([^{}]*)\}", r"\1", s)


def _strip_outer(s: str) -> str:
    s = s.strip()
    for cmd in ("text", "textbf", "mathrm", "mbox", "mathbf"):
        s = _unwrap(s, cmd)
    for tok in _SPACES:
        s = s.replace(tok, " " if tok == "\\ " else "")
    s = s.replace("\\$", "$").replace("\\%", "%").replace("dfrac", "frac").replace("tfrac", "frac")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s)
    s = s.strip().strip("$").strip()
    s = re.sub(r"^[A-Za-z]\s*=\s*", "", s)  # "x = 5" -> "5"
    return s.rstrip(".").strip()


def parse_number(answer: str) -> tuple[Fraction, bool] | None:
    """(exact value, was a percentage) of a numeric answer, or None if it is not a plain number."""
    s = _strip_outer(answer)
    pct = s.endswith("%")
    s = s.rstrip("%").strip().lstrip("$").strip()
    s = re.sub(r"^(-?)\\frac\s*\{([^{}]+)\}\s*\{([^{}]+)\}$", r"\1\2/\3", s)
    s = re.sub(r"^(-?)\\frac\s*(\d)(\d)$", r"\1\2/\3", s)
    m = re.match(r"^(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+)(?:\s*/\s*(-?\d+))?(?:\s+[A-Za-z][A-Za-z ]*)?$", s)
    if not m:
        return None
    try:
        value = Fraction(m.group(1).replace(",", ""))
        if m.group(2) is not None:
            value /= Fraction(m.group(2))
    except (ZeroDivisionError, ValueError):  # ValueError: more digits than int() converts (sys.int_info)
        return None
    return value, pct


def normalize_answer(answer: str) -> str:
    """The string form compared when an answer is not a number."""
    s = re.sub(r"\s+", "", _strip_outer(answer))
    return s if "\\" in s else s.lower()


MV_TIMEOUT_S = 5  # math-verify's own (SIGALRM) limit per parse and per comparison: past it, "not equal"


def _math_verify_equal(gold: str, answer: str) -> bool:
    if _mv_parse is None:
        return False
    # math-verify's timeouts use SIGALRM, which only the main thread may set: on (a rank's reward worker,
    # rl.experience.reward_worker, runs plug-ins in its main thread); off elsewhere (reward.timeout_s bounds it)
    t = MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        g = _mv_parse(f"${gold}$", parsing_timeout=t)
        a = _mv_parse(f"${answer}$", parsing_timeout=t)
        return bool(g and a and _mv_verify(g, a, timeout_seconds=t))
    except Exception:  # noqa: BLE001 - math-verify's parser raises many types on odd LaTeX: "not equal"
        return False


def answers_match(answer: str | None, gold: str, use_math_verify: bool = True) -> bool:
    """Whether the extracted `answer` equals the reference final answer `gold`."""
    if answer is None:
        return False
    a, g = parse_number(answer), parse_number(gold)
    if a is not None and g is not None:
        (av, ap), (gv, gp) = a, g
        if av == gv or (ap and av / 100 == gv) or (gp and gv / 100 == av):
            return True
    elif normalize_answer(answer) == normalize_answer(gold):
        return True
    return use_math_verify and _math_verify_equal(gold, answer)


class MathReward:
    """1.0 if the response's final answer equals meta[answer_key]'s final answer, else 0.0."""

    def __init__(self, answer_key: str = "answer", fallback_last_number: bool = True, use_math_verify: bool = True):
        self.answer_key, self.fallback, self.use_mv = answer_key, fallback_last_number, use_math_verify

    def __call__(self, meta: dict, response: str) -> float:
        if self.answer_key not in meta:
            raise KeyError(f"math reward: meta has no {self.answer_key!r} (keys: {sorted(meta)})")
        reference = str(meta[self.answer_key])
        gold = extract_answer(reference, fallback_last_number=False) or reference.strip()  # a bare answer as is
        return float(answers_match(extract_answer(response, self.fallback), gold, self.use_mv))


class FormatReward:
    """1.0 if the response states its final answer as `style` asks, else 0.0.
    "gsm8k": its last non-empty line is "#### <answer>"; "boxed": it holds a complete \\boxed{...};
    "any": either."""

    def __init__(self, style: str = "any"):
        if style not in ("gsm8k", "boxed", "any"):
            raise ValueError(f"FormatReward: style must be 'gsm8k', 'boxed' or 'any', got {style!r}")
        self.style = style

    def __call__(self, meta: dict, response: str) -> float:
        lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
        gsm = bool(lines) and re.fullmatch(r"####\s*\S.*", lines[-1]) is not None
        boxed = bool((_boxed(response) or "").strip())
        ok = {"gsm8k": gsm, "boxed": boxed, "any": gsm or boxed}[self.style]
        return float(ok)


# Plug-in names for rl.experience.rewards ("rl.experience.math_reward:math_reward", ...).
math_reward = MathReward()
math_reward_strict = MathReward(fallback_last_number=False)
format_reward = FormatReward("any")
gsm8k_format_reward = FormatReward("gsm8k")
boxed_format_reward = FormatReward("boxed")
