"""The two-digit addition problem set, defined once.

It lives in the ground floor because the tiny model's warm start trains on it; the "arithmetic" task
(`rlbench.tasks.arithmetic`) imports it from here.
"""

from __future__ import annotations

import functools
import random

OPERANDS = range(10, 100)
HELDOUT_SIZE = 200
HELDOUT_SEED = 1234
"""Fixed, and independent of any session seed: every run holds out the same 200 pairs."""

Pair = tuple[int, int]


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer(a: int, b: int) -> str:
    return str(a + b)


@functools.cache
def arithmetic_split() -> tuple[tuple[Pair, ...], tuple[Pair, ...]]:
    """(train_pairs, heldout_pairs): all 90 x 90 operand pairs, 200 of them held out, both sorted."""
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS]
    heldout = sorted(random.Random(HELDOUT_SEED).sample(pairs, HELDOUT_SIZE))
    held = set(heldout)
    return tuple(p for p in pairs if p not in held), tuple(heldout)
