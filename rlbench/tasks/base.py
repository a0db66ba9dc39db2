"""The Task protocol: where prompts come from and how completions are scored."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Task(Protocol):
    """A prompt source with its reward. Any object with these members is a Task (no base class).

    An example is a dict with at least "prompt" (a str, or a list of chat messages, each a dict with
    "role" and "content"), plus whatever the reward needs (an answer, test cases, ...).
    """

    name: str
    """Short name, used in logs and metrics."""
    train: Sequence[dict]
    """Training examples."""
    test: Sequence[dict]
    """Held-out examples, for evaluation only."""
    truncated_reward: float | None
    """Score of a completion that hit max_new_tokens without EOS; None scores it like any other."""
    # optional: `settings`, a dict of Session settings the task needs ({"max_new_tokens": 64}), used where the
    # session is not given them (`rlbench.tasks.settings_of`); a task without it needs none

    def reward(self, completion: str, example: dict) -> float | dict:
        """Score `completion` (the decoded response, without EOS) for `example`.

        Returns a float, or a dict with "score" (a float) and other named components; an "acc"
        component, when present, is what accuracy metrics use (otherwise the score).
        """
        ...
