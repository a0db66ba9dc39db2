"""The synthetic problem sets beyond addition, defined once: multiplication, sorting, reversing, countdown.

They live in the ground floor, like `arithmetic_data`, because the tiny-mix model's warm start trains
on them; the tasks of the same names (`rlbench.tasks.synthetic`) import them from here. Every problem
set is deterministic: its held-out problems depend only on its difficulty settings, never on a run's seed.

Prompts are short ASCII strings (the tiny models' context is 64 tokens) and answers are exact:

    multiplication  "47*6="          -> "282"
    sort            "sort 3 9 1 4="  -> "1 3 4 9"
    reverse         "rev 3 9 1 4="   -> "4 1 9 3"
    countdown       "3 5 7 to 22="   -> "3*5+7" (any expression using each number once, equal to 22)
"""

from __future__ import annotations

import ast
import functools
import itertools
import operator
import random
from collections import Counter
from collections.abc import Hashable
from fractions import Fraction

HELDOUT_SIZE = 200
HELDOUT_SEED = 4321
"""Fixed, and independent of any session seed: every run holds out the same problems."""
TRAIN_SIZE = 20_000
"""At most this many training problems per problem set (all the rest, when there are fewer)."""


# --------------------------------------------------------------------------------- multiplication
def multiplication_prompt(a: int, b: int) -> str:
    return f"{a}*{b}="


@functools.cache
def multiplication_split(a_digits: int = 2, b_digits: int = 1) -> tuple[tuple, tuple]:
    """(train, heldout) pairs (a, b) with `a_digits`- and `b_digits`-digit operands (b >= 2)."""
    b_range = range(max(2, 10 ** (b_digits - 1)), 10**b_digits)
    return _split(list(itertools.product(_digits(a_digits), b_range)), key=("multiplication", a_digits, b_digits))


# ------------------------------------------------------------------------------- sort and reverse
def list_prompt(verb: str, items: tuple[int, ...]) -> str:
    """`verb` is "sort" or "rev"."""
    return f"{verb} {' '.join(map(str, items))}="


def list_answer(verb: str, items: tuple[int, ...]) -> str:
    ordered = sorted(items) if verb == "sort" else reversed(items)
    return " ".join(map(str, ordered))


@functools.cache
def list_split(length: int = 4, max_value: int = 9) -> tuple[tuple, tuple]:
    """(train, heldout) tuples of `length` integers in 0..max_value (repeats allowed)."""
    values = range(max_value + 1)
    if len(values) ** length <= 10 * (HELDOUT_SIZE + TRAIN_SIZE):
        return _split(list(itertools.product(values, repeat=length)), key=("list", length, max_value))
    rng = random.Random(f"{HELDOUT_SEED}-draws")  # a space too big to list: distinct random draws
    drawn = {tuple(rng.choice(values) for _ in range(length)) for _ in range(HELDOUT_SIZE + TRAIN_SIZE)}
    return _split(sorted(drawn), key=("list", length, max_value))


# ---------------------------------------------------------------------------------------- countdown
def countdown_prompt(numbers: tuple[int, ...], target: int) -> str:
    return f"{' '.join(map(str, numbers))} to {target}="


@functools.cache
def countdown_split(count: int = 3, max_number: int = 9, max_target: int = 99) -> tuple[tuple, tuple]:
    """(train, heldout) triples (numbers, target, one_solution), each target reachable in 1..max_target.

    A problem is `count` numbers in 1..max_number (in the order shown) and a target made by joining all
    of them, in some order, with + - * (ordinary precedence, no brackets, e.g. "3+5*7"); `one_solution`
    is the first such expression (in a fixed enumeration order) that reaches it.
    """
    solutions: dict[tuple, str] = {}
    for numbers in itertools.product(range(1, max_number + 1), repeat=count):
        for order in itertools.permutations(numbers):
            for ops in itertools.product("+-*", repeat=count - 1):
                expression = "".join(f"{op}{n}" for op, n in zip(["", *ops], order))
                target = eval(expression)  # digits and + - * only, made just above
                if 1 <= target <= max_target:
                    solutions.setdefault((numbers, target), expression)
    problems = [(numbers, target, expression) for (numbers, target), expression in solutions.items()]
    return _split(problems, key=("countdown", count, max_number, max_target))


def check_countdown(expression: str, numbers, target) -> tuple[bool, str]:
    """(reaches the target, why not): uses each of `numbers` exactly once and equals `target`.

    The expression is parsed, never evaluated by Python: integer literals, binary + - * /, brackets.
    Division is exact (fractions), so "(8/3)*3" is 8; unary minus and powers are not allowed.
    """
    try:
        used: list[int] = []
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body, used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return False, f"not a countdown expression: {e}"
    if Counter(used) != Counter(int(n) for n in numbers):
        return False, f"uses {sorted(used)}, not each of {sorted(int(n) for n in numbers)} once"
    if value != Fraction(target):
        return False, f"equals {value}, not {target}"
    return True, ""


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    raise ValueError(f"{ast.unparse(node)!r} is not a number or a + - * / of two expressions")


# ------------------------------------------------------------------------------------------- common
def _digits(n: int) -> range:
    return range(10 ** (n - 1) if n > 1 else 0, 10**n)


def _split(problems: list[tuple], *, key: Hashable) -> tuple[tuple, tuple]:
    """Shuffle `problems` with a fixed seed: the first HELDOUT_SIZE (at most a third) are held out, the
    next TRAIN_SIZE train. Both are returned sorted, so the split does not depend on the input order."""
    problems = sorted(problems)
    random.Random(f"{HELDOUT_SEED}-{key}").shuffle(problems)
    heldout_size = min(HELDOUT_SIZE, len(problems) // 3)
    return tuple(sorted(problems[heldout_size:heldout_size + TRAIN_SIZE])), tuple(sorted(problems[:heldout_size]))
