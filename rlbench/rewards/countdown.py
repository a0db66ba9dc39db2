"""Countdown: reach a target with given numbers, each used exactly once, with + - * / and brackets.

The exact checker, `check_countdown`, is defined with the countdown problem set
(`rlbench.models.synthetic_data`, which the tiny-mix warm start also uses); it never calls `eval`.
"""

from __future__ import annotations

import re

from rlbench.models.synthetic_data import check_countdown

__all__ = ["check_countdown", "countdown_reward"]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def countdown_reward(completion: str, example: dict, *, format_score: float = 0.1) -> dict:
    """TinyZero's countdown reward: the last `<answer>...</answer>` must reach the target.

    The ground truth (verl's `reward_model.ground_truth`, or the example itself) holds "target" and
    "numbers". Score 1 when correct, `format_score` for a wrong answer in the tags, 0 without tags;
    "acc" is 1 only when correct.
    """
    truth = (example.get("reward_model") or {}).get("ground_truth") or example
    answers = _ANSWER.findall(completion)
    if not answers:
        return {"score": 0.0, "acc": 0.0}
    ok, _ = check_countdown(answers[-1], truth["numbers"], truth["target"])
    return {"score": 1.0 if ok else format_score, "acc": float(ok)}
