"""rl.experience.math_reward on a hand-written table of GSM8K / MATH style responses and references (the expected
verdicts are written by hand), with and without math-verify; the plug-in path of rl.experience.rewards."""

from __future__ import annotations

import pytest

import rl.experience.math_reward as mr
from core.tokenizer import DATA_DIR
from rl.experience.math_reward import FormatReward, MathReward, answers_match, extract_answer, math_reward
from rl.experience.prompts import read_records
from rl.experience.rewards import CombinedReward, load_reward_fn, score_responses

GSM_GOLD = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
            "altogether in April and May.\n#### 72")

EXTRACT = [
    (GSM_GOLD, "72"),
    ("So the total is 5.\n#### 1,080", "1,080"),
    ("#### 3\nwait, more thinking\n#### 4", "4"),
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("first \\boxed{1} then \\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ("\\boxed 5 is it", "5"),
    ("\\fbox{7}", "7"),
    ("\\boxed{\\frac{1}{2}", "2"),  # unbalanced box: falls back to the last number
    ("She pays $1,234.50 in total.", "1,234.50"),
    ("temperatures 5-3 and then x = -4", "-4"),
    ("values 1,2,3", "3"),
    ("ratio 7/2 overall", "7/2"),
    ("no digits here", None),
    ("####   \nthe answer is 12", "12"),
]


@pytest.mark.parametrize("text, want", EXTRACT)
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_strict_extraction_needs_a_marker():
    assert extract_answer("the answer is 12", fallback_last_number=False) is None
    assert extract_answer("so \\boxed{12}", fallback_last_number=False) == "12"


# (response, reference answer, expected reward): the verdicts of a careful human grader
TABLE = [
    ("Janet has 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", "Janet sells 9 * 2 = $<<9*2=18>>18\n#### 18", 1.0),
    ("#### 18.00", "#### 18", 1.0),
    ("#### $18", "#### 18", 1.0),
    ("#### 18 dollars", "#### 18", 1.0),
    ("#### 1,000", "#### 1000", 1.0),
    ("#### 1000", "#### 1,000", 1.0),
    ("#### 17", "#### 18", 0.0),
    ("#### 180", "#### 18", 0.0),
    ("#### -5", "#### 5", 0.0),
    ("#### 25%", "#### 25", 1.0),
    ("#### 0.25", "#### 25%", 1.0),
    ("The answer is 72.", GSM_GOLD, 1.0),
    ("72 clips, or maybe 73", GSM_GOLD, 0.0),  # the last number counts
    ("\\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
    ("\\boxed{0.5}", "\\dfrac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\tfrac{1}{2}", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{\\frac{3}{4}}", "-0.75", 0.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{10\\text{ inches}}", "10", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\text{(C)}}", "(C)", 1.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})", 1.0),
    ("\\boxed{(3, \\frac{\\pi}{2})}", "(3,\\frac{\\pi}{3})", 0.0),
    ("\\boxed{Yes}", "yes", 1.0),
    ("\\boxed{2\\sqrt{2}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{\\$5.50}", "5.5", 1.0),
    ("I cannot solve this.", "#### 4", 0.0),
    ("", "#### 0", 0.0),
    ("#### 7/2", "3.5", 1.0),
    ("#### 3.333", "10/3", 0.0),  # exact comparison: a rounded decimal is not 10/3
]


@pytest.mark.parametrize("response, reference, want", TABLE)
def test_math_reward_table_builtin(monkeypatch, response, reference, want):
    monkeypatch.setattr(mr, "_mv_parse", None)
    assert math_reward({"answer": reference}, response) == want


@pytest.mark.parametrize("response, reference, want", TABLE)
def test_math_reward_table_with_math_verify(response, reference, want):
    if mr._mv_parse is None:
        pytest.skip("math-verify not installed (optional extra: pip install math-verify)")
    assert math_reward({"answer": reference}, response) == want


def test_symbolic_equality_needs_math_verify():
    """Equal values written differently: only math-verify can tell, the normaliser says 'different'."""
    assert not answers_match("\\sqrt{8}", "2\\sqrt{2}", use_math_verify=False)
    if mr._mv_parse is not None:
        assert answers_match("\\sqrt{8}", "2\\sqrt{2}")


def test_missing_answer_raises_and_is_reported():
    with pytest.raises(KeyError, match="meta has no 'answer'"):
        math_reward({"prompt": "x"}, "#### 1")
    with pytest.raises(KeyError, match="'solution'"):
        MathReward(answer_key="solution")({"answer": "1"}, "#### 1")


@pytest.mark.parametrize("style, response, want", [
    ("gsm8k", "step 1\nstep 2\n#### 42", 1.0),
    ("gsm8k", "#### 42\nand then some text", 0.0),
    ("gsm8k", "the answer is 42", 0.0),
    ("gsm8k", "####", 0.0),
    ("boxed", "so \\boxed{\\frac{1}{2}}.", 1.0),
    ("boxed", "so \\boxed{\\frac{1}{2}", 0.0),
    ("boxed", "\\boxed{}", 0.0),
    ("any", "#### 3", 1.0),
    ("any", "\\boxed{3}", 1.0),
    ("any", "3", 0.0),
])
def test_format_reward(style, response, want):
    assert FormatReward(style)({}, response) == want


def test_format_reward_bad_style():
    with pytest.raises(ValueError, match="style must be"):
        FormatReward("json")


def test_shipped_gold_answers_score_one():
    """Each shipped solution, given as the response, earns 1.0 against itself; a wrong final answer 0.0."""
    for _, r in read_records(f"{DATA_DIR}/arith_word_test.jsonl"):
        assert math_reward({"answer": r["answer"]}, r["answer"]) == 1.0
        wrong = r["answer"].rsplit("#### ", 1)[0] + f"#### {int(extract_answer(r['answer'])) + 1}"
        assert math_reward({"answer": r["answer"]}, wrong) == 0.0


def test_plugins_combine_through_rl_rewards():
    fn = CombinedReward(["rl.experience.math_reward:math_reward", "rl.experience.math_reward:gsm8k_format_reward"],
                        "mean")
    metas = [{"answer": "#### 6"}, {"answer": "#### 10"}]
    responses = ["#### 6", "it is 6", "\\boxed{10}", "#### 11"]
    assert score_responses(fn, metas, responses, 2).tolist() == [1.0, 0.5, 0.5, 0.5]
    assert callable(load_reward_fn("rl.experience.math_reward:boxed_format_reward"))
