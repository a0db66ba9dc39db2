"""Built-in synthetic tasks harder than addition, with exact verifiers and a difficulty knob each.

    multiplication  "47*6=" -> "282"               a_digits, b_digits
    sort            "sort 3 9 1 4=" -> "1 3 4 9"   length, max_value
    reverse         "rev 3 9 1 4=" -> "4 1 9 3"    length, max_value
    countdown       "3 5 7 to 22=" -> "3*5+7"      count (of numbers), max_number, max_target

The problem sets (and their fixed held-out problems) are `rlbench.models.synthetic_data`, which the
tiny-mix model was warm-started on. As in "arithmetic", a completion scores 1.0 only if it is exactly
the answer (countdown: any expression that uses each number once and reaches the target), then EOS; a
completion cut at max_new_tokens scores `truncated_reward` = 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import final

from rlbench.models import synthetic_data as data


def _exact(completion: str, example: dict) -> float:
    return 1.0 if completion == example["answer"] else 0.0


@final
@dataclass(frozen=True, eq=False)
class Multiplication:
    """`a_digits`-digit times `b_digits`-digit numbers (the second at least 2)."""

    a_digits: int = 2
    b_digits: int = 1
    name: str = "multiplication"
    truncated_reward: float | None = 0.0
    train: tuple[dict, ...] = field(init=False, repr=False)
    test: tuple[dict, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        train, test = data.multiplication_split(self.a_digits, self.b_digits)
        object.__setattr__(self, "train", tuple(_product(a, b) for a, b in train))
        object.__setattr__(self, "test", tuple(_product(a, b) for a, b in test))

    def reward(self, completion: str, example: dict) -> float:
        return _exact(completion, example)


def _product(a: int, b: int) -> dict:
    return {"prompt": data.multiplication_prompt(a, b), "answer": str(a * b), "a": a, "b": b}


@final
@dataclass(frozen=True, eq=False)
class ListTask:
    """Sort (`verb="sort"`) or reverse (`verb="rev"`) `length` integers in 0..max_value."""

    verb: str = "sort"
    length: int = 4
    max_value: int = 9
    name: str = ""
    truncated_reward: float | None = 0.0
    train: tuple[dict, ...] = field(init=False, repr=False)
    test: tuple[dict, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.verb not in ("sort", "rev"):
            raise ValueError(f"verb must be 'sort' or 'rev', got {self.verb!r}")
        train, test = data.list_split(self.length, self.max_value)
        object.__setattr__(self, "name", self.name or {"sort": "sort", "rev": "reverse"}[self.verb])
        object.__setattr__(self, "train", tuple(self._example(items) for items in train))
        object.__setattr__(self, "test", tuple(self._example(items) for items in test))

    def _example(self, items: tuple[int, ...]) -> dict:
        return {"prompt": data.list_prompt(self.verb, items), "answer": data.list_answer(self.verb, items),
                "items": list(items)}

    def reward(self, completion: str, example: dict) -> float:
        return _exact(completion, example)


def Sort(length: int = 4, max_value: int = 9) -> ListTask:  # noqa: N802 (a task factory, named like one)
    """The "sort" task: `length` integers in 0..max_value, ascending."""
    return ListTask("sort", length, max_value)


def Reverse(length: int = 4, max_value: int = 9) -> ListTask:  # noqa: N802
    """The "reverse" task: `length` integers in 0..max_value, back to front."""
    return ListTask("rev", length, max_value)


@final
@dataclass(frozen=True, eq=False)
class Countdown:
    """`count` numbers in 1..max_number and a target in 1..max_target reachable with + - * from all of them.

    Any expression (with + - * / and brackets) that uses each number exactly once and equals the target
    scores 1.0; "answer" is one such expression (the one the problem was made from).
    """

    count: int = 3
    max_number: int = 9
    max_target: int = 99
    name: str = "countdown"
    truncated_reward: float | None = 0.0
    train: tuple[dict, ...] = field(init=False, repr=False)
    test: tuple[dict, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        train, test = data.countdown_split(self.count, self.max_number, self.max_target)
        object.__setattr__(self, "train", tuple(_countdown(*p) for p in train))
        object.__setattr__(self, "test", tuple(_countdown(*p) for p in test))

    def reward(self, completion: str, example: dict) -> float:
        return 1.0 if data.check_countdown(completion, example["numbers"], example["target"])[0] else 0.0


def _countdown(numbers: tuple[int, ...], target: int, solution: str) -> dict:
    return {"prompt": data.countdown_prompt(numbers, target), "answer": solution, "numbers": list(numbers),
            "target": target}
