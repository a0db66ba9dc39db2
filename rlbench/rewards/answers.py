"""Graders of final answers: GSM8K's "####" numbers, MATH's boxed LaTeX (through `math-verify`), DAPO's "Answer:".

Each `*_reward(completion, example)` reads the reference from verl's `example["reward_model"]["ground_truth"]`
(or `example["answer"]`) and returns {"score", "acc"}: "acc" is 1 for a correct answer, 0 otherwise.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation

# ----------------------------------------------------------------------------------------------- GSM8K
_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+")


def ground_truth(example: dict):
    """The reference answer: verl's `reward_model.ground_truth`, else the example's "answer"."""
    reward_model = example.get("reward_model") or {}
    return reward_model["ground_truth"] if "ground_truth" in reward_model else example["answer"]


def extract_gsm8k(completion: str, method: str = "strict") -> str | None:
    """The final number of a GSM8K solution, commas and "$" removed, or None.

    "strict": the number after the last "####" (verl's rule: the model must keep GSM8K's format);
    "flexible": the last number anywhere in the completion.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    found = _STRICT.findall(completion) if method == "strict" else _NUMBER.findall(completion)
    return found[-1].replace(",", "") if found else None


def same_number(a: str, b: str) -> bool:
    """Equal as decimal numbers ("18.00" == "18", "1,000" == "1000"); False when either is not a number."""
    try:
        return Decimal(a.replace(",", "")) == Decimal(b.replace(",", ""))
    except InvalidOperation:
        return False


def gsm8k_reward(completion: str, example: dict, *, method: str = "strict", format_score: float = 0.0) -> dict:
    """1 when the extracted number equals the ground truth, `format_score` when one was found but is wrong."""
    answer = extract_gsm8k(completion, method)
    correct = answer is not None and same_number(answer, str(ground_truth(example)))
    return {"score": 1.0 if correct else (format_score if answer is not None else 0.0), "acc": float(correct)}


# ----------------------------------------------------------------------------------------- MATH (math-verify)
def math_equal(completion: str, reference: str, *, timeout_s: int = 5) -> bool:
    """Whether the completion's final answer (its last \\boxed{} or LaTeX/number) equals `reference`.

    Uses `math-verify`, which compares symbolically: "\\frac12" = "0.5", "\\left(1,2\\right]" = "(1,2]",
    "x=3" = "3". Its own time limit (SIGALRM) works only in the main thread; in a worker thread the
    reward runner's per-sample timeout is the limit.
    """
    from math_verify import parse, verify

    limit = timeout_s if threading.current_thread() is threading.main_thread() else None
    gold = parse(reference if "$" in reference or "\\boxed" in reference else f"${reference}$",
                 parsing_timeout=limit)
    return bool(gold) and bool(verify(gold, parse(completion, parsing_timeout=limit), timeout_seconds=limit))


def math_reward(completion: str, example: dict, *, timeout_s: int = 5) -> dict:
    """1 when `math_equal(completion, ground truth)`, else 0."""
    correct = math_equal(completion, str(ground_truth(example)), timeout_s=timeout_s)
    return {"score": float(correct), "acc": float(correct)}


_DAPO_ANSWER = re.compile(r"Answer\s*:\s*(.+)")


def dapo_math_reward(completion: str, example: dict, *, timeout_s: int = 5) -> dict:
    """DAPO-Math's rule: the text after the last "Answer:" must equal the ground truth; score 1, else -1."""
    found = _DAPO_ANSWER.findall(completion)
    correct = bool(found) and math_equal(f"${found[-1].strip().strip('$')}$", str(ground_truth(example)),
                                         timeout_s=timeout_s)
    return {"score": 1.0 if correct else -1.0, "acc": float(correct)}


_THINK_THEN_BOXED = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def geo3k_reward(completion: str, example: dict, *, format_score: float = 0.1, timeout_s: int = 5) -> dict:
    """Geometry3K's rule in verl's example: `(1 - format_score) · acc + format_score · format`, where acc is
    whether the last \\boxed{} answer equals the ground truth (`math_equal`) and format whether the completion is
    "<think>...</think>" then a \\boxed{} answer."""
    correct = math_equal(completion, str(ground_truth(example)), timeout_s=timeout_s)
    formatted = _THINK_THEN_BOXED.fullmatch(completion) is not None
    return {"score": (1 - format_score) * float(correct) + format_score * float(formatted), "acc": float(correct),
            "format": float(formatted)}

