"""The built-in "arithmetic" task: two-digit addition, "12+34=" -> "46"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import final

from rlbench.models.arithmetic_data import answer, arithmetic_split, prompt


def _example(a: int, b: int) -> dict:
    return {"prompt": prompt(a, b), "answer": answer(a, b), "a": a, "b": b}


@final
@dataclass(frozen=True, eq=False)
class Arithmetic:
    """All 8100 sums of two operands in 10..99; the same 200 are held out in every run.

    Reward 1.0 for exactly the answer (nothing before or after it), else 0.0. A completion cut off
    at max_new_tokens scores `truncated_reward` = 0.0, so a reward of 1 means "the answer, then EOS".
    The split is the one the tiny-arith model was warm-started on (`rlbench.models.arithmetic_data`).
    """

    name: str = "arithmetic"
    truncated_reward: float | None = 0.0
    train: tuple[dict, ...] = field(init=False, repr=False)
    test: tuple[dict, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        train_pairs, heldout_pairs = arithmetic_split()
        object.__setattr__(self, "train", tuple(_example(a, b) for a, b in train_pairs))
        object.__setattr__(self, "test", tuple(_example(a, b) for a, b in heldout_pairs))

    def reward(self, completion: str, example: dict) -> float:
        return 1.0 if completion == example["answer"] else 0.0
