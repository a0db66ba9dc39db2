"""Scoring completions: every failure is recorded on its sample, never turned silently into a number."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


class RewardError(RuntimeError):
    """A reward function failed on a sample and the session was told to stop (`on_reward_error="raise"`)."""


@dataclass
class Scores:
    score: list[float]
    """One float per sample (0.0 where the reward failed)."""
    components: dict[str, list[float]] = field(default_factory=dict)
    """Named parts of dict rewards (e.g. "acc"), one float per sample."""
    error: list[str | None] = field(default_factory=list)
    """Why scoring sample i failed, or None."""


def score_all(reward: Callable[[str, dict], Any], completions: Sequence[str], examples: Sequence[dict], *,
              on_error: str = "raise") -> Scores:
    """Call `reward(completion, example)` on every sample.

    A reward returns a float (or int / bool), or a dict with a float "score" and other float
    components. An exception, a non-finite value or another return type is a failure: with
    `on_error="raise"` a RewardError names the sample; with "zero" the sample scores 0 and keeps the reason.
    """
    results = [_score_one(reward, c, e) for c, e in zip(completions, examples)]
    names = sorted({k for value, _ in results if isinstance(value, dict) for k in value if k != "score"})
    scores = Scores(score=[], components={k: [] for k in names}, error=[])
    for i, (value, error) in enumerate(results):
        if error is not None and on_error == "raise":
            raise RewardError(f"reward failed on sample {i} (completion {completions[i]!r}): {error}")
        parts = value if isinstance(value, dict) else {"score": value}
        scores.score.append(parts.get("score", 0.0) if error is None else 0.0)
        for k in names:
            scores.components[k].append(parts.get(k, 0.0) if error is None else 0.0)
        scores.error.append(error)
    return scores


def _score_one(reward, completion: str, example: dict) -> tuple[Any, str | None]:
    try:
        value = reward(completion, example)
    except Exception as e:  # a reward's bug is reported on the sample, with its type and message
        return None, f"{type(e).__name__}: {e}"
    parts = value if isinstance(value, dict) else {"score": value}
    if "score" not in parts:
        return None, f"a dict reward needs a 'score' key, got keys {sorted(parts)}"
    for name, v in parts.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None, f"reward {name!r} must be a number, got {type(v).__name__} {v!r}"
        if not math.isfinite(v):
            return None, f"reward {name!r} is {v}"
    return {k: float(v) for k, v in parts.items()}, None
