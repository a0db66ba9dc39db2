"""rlbench.rewards graders: GSM8K, math-verify, DAPO, countdown, format and shaping, data-source dispatch."""

import pytest
from floats import approx

from rlbench import rewards
from rlbench.rewards import check_countdown


def verl(ground_truth, data_source="openai/gsm8k"):
    return {"data_source": data_source, "prompt": [{"role": "user", "content": "q"}],
            "reward_model": {"style": "rule", "ground_truth": ground_truth}}


# --- GSM8K -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("completion", "strict", "flexible"), [
    ("She has 3 + 4 = 7 apples.\n#### 72", "72", "72"),
    ("The total is $1,250.\n#### $1,250", "1250", "1250"),
    ("#### 1,000 dollars", "1000", "1000"),            # units after the number
    ("#### -3", "-3", "-3"),
    ("#### 18.00", "18.00", "18.00"),
    ("So the answer is 72 cookies.", None, "72"),        # no "####": strict finds nothing
    ("I think 10, then 12, finally 1,234.", None, "1234"),
    ("No number here.", None, None),
    ("#### 5\nWait, actually #### 6", "6", "6"),         # the last one counts
])
def test_gsm8k_extraction(completion, strict, flexible):
    assert rewards.extract_gsm8k(completion, "strict") == strict
    assert rewards.extract_gsm8k(completion, "flexible") == flexible


@pytest.mark.parametrize(("completion", "truth", "strict", "flexible"), [
    ("48 / 2 = 24 in May, 48 + 24 = 72.\n#### 72", "72", 1.0, 1.0),
    ("The answer: #### 1,000", "1000", 1.0, 1.0),
    ("#### $18.00", "18", 1.0, 1.0),
    ("Total: 72 clips", "72", 0.0, 1.0),
    ("#### 71", "72", 0.0, 0.0),
    ("#### 72 ... no, 73 clips", "72", 1.0, 0.0),      # flexible takes the very last number
])
def test_gsm8k_reward(completion, truth, strict, flexible):
    example = verl(truth)
    assert rewards.gsm8k_reward(completion, example) == {"score": strict, "acc": strict}
    assert rewards.gsm8k_reward(completion, example, method="flexible")["acc"] == flexible


def test_gsm8k_format_score_and_bad_method():
    assert rewards.gsm8k_reward("#### 5", verl("6"), format_score=0.1) == {"score": 0.1, "acc": 0.0}
    assert rewards.gsm8k_reward("five", verl("6"), format_score=0.1) == {"score": 0.0, "acc": 0.0}
    with pytest.raises(ValueError, match="strict"):
        rewards.extract_gsm8k("#### 1", "lenient")


# --- MATH through math-verify ------------------------------------------------------------------------------
@pytest.mark.parametrize(("completion", "truth"), [
    ("So the answer is $\\boxed{0.5}$.", "\\frac{1}{2}"),
    ("$\\boxed{\\dfrac12}$", "\\frac{1}{2}"),
    ("Hence $x \\in \\left(1, 2\\right]$.", "(1,2]"),
    ("$\\boxed{\\frac{\\sqrt2}{2}}$", "\\frac{\\sqrt{2}}{2}"),
    ("The final answer is $\\boxed{x=3}$", "3"),
    ("$\\boxed{\\{2,1\\}}$", "\\{1,2\\}"),
    ("$\\boxed{[2,5)\\cup(5,\\infty)}$", "[2,5)\\cup(5,\\infty)"),
    ("$\\boxed{9\\pi}$", "9\\pi"),
    ("the answer is $\\boxed{720}$", "720^\\circ"),
])
def test_math_equal_answers_written_differently(completion, truth):
    assert rewards.math_reward(completion, verl(truth, "lighteval/MATH")) == {"score": 1.0, "acc": 1.0}


@pytest.mark.parametrize(("completion", "truth"), [
    ("$\\boxed{[1,2]}$", "(1,2]"),                  # closed is not half-open
    ("$\\boxed{3.14}$", "\\pi"),
    ("$\\boxed{3}$", "2"),
    ("I do not know.", "2"),
])
def test_math_unequal_answers(completion, truth):
    assert rewards.math_reward(completion, verl(truth, "lighteval/MATH"))["acc"] == 0.0


def test_math_verify_works_in_a_worker_thread():
    """math-verify's own timeout needs the main thread; in a thread the runner's timeout applies instead."""
    scores = rewards.score_all(rewards.math_reward, ["$\\boxed{\\frac{1}{2}}$"] * 2,
                               [verl("0.5", "lighteval/MATH")] * 2, workers=2, timeout_s=30)
    assert scores.score == [1.0, 1.0] and scores.error == [None, None]


def test_dapo_math_reward():
    example = verl("34", "math_dapo")
    assert rewards.dapo_math_reward("Let me compute...\nAnswer: 34", example) == {"score": 1.0, "acc": 1.0}
    assert rewards.dapo_math_reward("Answer: $34$", example)["acc"] == 1.0
    assert rewards.dapo_math_reward("Answer: 35", example) == {"score": -1.0, "acc": 0.0}
    assert rewards.dapo_math_reward("34", example)["score"] == -1.0   # no "Answer:" line


# --- countdown -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("expression", "ok", "why"), [
    ("3*5+7", True, ""),
    ("(7 + 5) * 3 - 14", False, "uses"),               # 14 is not one of the numbers
    ("7 + 3 * 5", True, ""),
    ("3*5+7+7", False, "uses"),                        # 7 used twice
    ("3*5", False, "uses"),                            # 7 unused
    ("3*5+8", False, "uses"),
    ("5*3-7", False, "equals 8"),                      # right numbers, wrong value
    ("3**5+7", False, "not a countdown"),              # powers are refused (and never evaluated)
    ("-3+5+7", False, "not a countdown"),              # no unary minus
    ("__import__('os')", False, "not a countdown"),
    ("3 5 7", False, "not a countdown"),
    ("7/(5-5)+3", False, "not a countdown"),           # division by zero, and 5 twice
])
def test_check_countdown(expression, ok, why):
    result, reason = check_countdown(expression, [3, 5, 7], 22)
    assert result is ok and why in reason


def test_countdown_exact_division():
    assert check_countdown("(8/3)*3", [8, 3, 3], 8)[0]
    assert check_countdown("8/3", [8, 3], 2) == (False, "equals 8/3, not 2")


def test_countdown_reward_tinyzero_format():
    example = verl({"target": 24, "numbers": [3, 7, 8, 2]}, "countdown")
    solved = "<think>8-2=6 and 7-3=4, 6*4=24</think> <answer>(7 - 3) * (8 - 2)</answer>"
    assert rewards.countdown_reward(solved, example) == {"score": 1.0, "acc": 1.0}
    first_try = "<answer>(7 - 2 - 5 + 8) * 3</answer> no wait <answer>(7-3)*(8-2)</answer>"
    assert rewards.countdown_reward(first_try, example)["acc"] == 1.0  # the last answer counts
    assert rewards.countdown_reward("<answer>(7 - 2 - 5 + 8) * 3</answer>", example)["acc"] == 0.0  # 5 not given
    assert rewards.countdown_reward("<answer>8 * 3 + 7 - 2</answer>", example) == {"score": 0.1, "acc": 0.0}
    assert rewards.countdown_reward("8*3*(7-2)/5", example) == {"score": 0.0, "acc": 0.0}  # no tags


# --- format and shaping -----------------------------------------------------------------------------------
def test_format_reward():
    assert rewards.format_reward("<think>a\nb</think>\n<answer>3</answer>", {}) == 1.0
    assert rewards.format_reward("<answer>3</answer>", {}) == 0.0
    assert rewards.format_reward("<think>a</think><answer>3</answer> extra", {}) == 0.0
    assert rewards.format_reward("Answer: 3", {}, pattern=r".*Answer: \d+$") == 1.0


def test_weighted_sum_of_named_parts():
    reward = rewards.weighted(correct=(rewards.gsm8k_reward, 1.0),
                              fmt=(lambda c, e: rewards.format_reward(c, e, pattern=r".*####"), 0.1))
    assert reward("#### 72", verl("72")) == approx({"correct": 1.0, "acc": 1.0, "fmt": 1.0, "score": 1.1})
    assert reward("72", verl("72")) == {"correct": 0.0, "acc": 0.0, "fmt": 0.0, "score": 0.0}


def test_length_penalty():
    reward = rewards.with_length_penalty(lambda c, e: 1.0, per_char=0.01, free_chars=10)
    assert reward("x" * 10, {}) == {"score": 1.0, "length_penalty": -0.0}
    assert reward("x" * 30, {}) == approx({"score": 0.8, "length_penalty": -0.2})


def test_overlong_penalty_hook_matches_dapo():
    # max 20, buffer 10: no penalty up to 10, then linear to -1 at 20 (15 -> -0.5), beyond -> -1 * factor
    reward = rewards.with_overlong_penalty(lambda c, e: {"score": 1.0, "acc": 1.0}, max_len=20, buffer_len=10)
    assert reward("x" * 10, {})["score"] == 1.0
    assert reward("x" * 15, {}) == approx({"score": 0.5, "acc": 1.0, "overlong_penalty": -0.5})
    assert reward("x" * 20, {})["overlong_penalty"] == approx(-1.0)
    by_words = rewards.with_overlong_penalty(lambda c, e: 0.0, max_len=4, buffer_len=2, length=lambda c: len(c.split()))
    assert by_words("a b c", {})["score"] == approx(-0.5)


# --- dispatch by data_source --------------------------------------------------------------------------------
def test_by_data_source():
    assert rewards.by_data_source("#### 72", verl("72"))["acc"] == 1.0
    assert rewards.by_data_source("$\\boxed{\\frac12}$", verl("0.5", "HuggingFaceH4/MATH-500"))["acc"] == 1.0
    assert rewards.by_data_source("Answer: 2", verl("2", "math_dapo"))["score"] == 1.0
    with pytest.raises(KeyError, match="known: openai/gsm8k"):
        rewards.by_data_source("x", verl("1", "my/dataset"))
