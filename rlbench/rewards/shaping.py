"""Rewards built from rewards: a required format, weighted sums, length penalties, DAPO's overlong shaping.

Each takes plain `(completion, example) -> float | dict` rewards and returns one, so they stack:

    reward = with_length_penalty(weighted(correct=(gsm8k_reward, 1.0), fmt=(format_reward, 0.1)), per_char=1e-4)
"""

from __future__ import annotations

import re
from collections.abc import Callable

from rlbench.algorithms import overlong_penalty

Reward = Callable[[str, dict], "float | dict"]

THINK_ANSWER = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
"""The R1-style format: reasoning in <think> tags, then the answer in <answer> tags, nothing else."""


def format_reward(completion: str, example: dict, *, pattern: str = THINK_ANSWER) -> float:
    """1.0 when the whole completion matches `pattern` (a regex, DOTALL), else 0.0."""
    return 1.0 if re.match(pattern, completion, re.S) else 0.0


def weighted(**parts: tuple[Reward, float]) -> Callable[[str, dict], dict]:
    """A reward whose score is the weighted sum of named parts: `weighted(correct=(f, 1.0), fmt=(g, 0.1))`.

    Each part's own score becomes a component of that name; the first part's "acc" that exists is the "acc".
    """
    def reward(completion: str, example: dict) -> dict:
        out, total = {}, 0.0
        for name, (part, weight) in parts.items():
            value = _as_dict(part(completion, example))
            out[name] = value["score"]
            if "acc" in value:
                out.setdefault("acc", value["acc"])
            total += weight * value["score"]
        return out | {"score": total}

    return reward


def with_length_penalty(reward: Reward, *, per_char: float, free_chars: int = 0) -> Callable[[str, dict], dict]:
    """Subtract `per_char` for every character beyond `free_chars` (component "length_penalty", <= 0)."""
    def penalized(completion: str, example: dict) -> dict:
        value = _as_dict(reward(completion, example))
        penalty = -per_char * max(0, len(completion) - free_chars)
        return value | {"score": value["score"] + penalty, "length_penalty": penalty}

    return penalized


def with_overlong_penalty(reward: Reward, *, max_len: int, buffer_len: float, factor: float = 1.0,
                          length: Callable[[str], int] = len) -> Callable[[str, dict], dict]:
    """DAPO's soft overlong punishment as a reward hook, on `length(completion)` (characters by default;
    pass `lambda c: len(tokenizer.encode(c))` for tokens). 0 up to `max_len - buffer`, then linear down to
    `-factor` at `max_len` (component "overlong_penalty"). The session's DAPO preset applies the same
    formula (`rl.algorithms.overlong_penalty`) on token counts itself; use this for other algorithms."""
    def penalized(completion: str, example: dict) -> dict:
        value = _as_dict(reward(completion, example))
        penalty = float(overlong_penalty([length(completion)], max_len, buffer_len, factor)[0])
        return value | {"score": value["score"] + penalty, "overlong_penalty": penalty}

    return penalized


def _as_dict(value) -> dict:
    return value if isinstance(value, dict) else {"score": value}
