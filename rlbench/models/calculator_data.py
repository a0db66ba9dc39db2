"""The calculator problem set, its tool and its episodes, defined once: 2-digit products, answered with `calc`.

It lives in the ground floor because the tiny-tools model's warm start trains on these episodes; the
"calculator" task (`rlbench.tasks.calculator`) imports the problems and the tool from here.

A problem is "37*48=" -> "1776" (both operands in 10..99). An episode, as the tokens a sampler sees
(`<tool_call>` and `</tool_call>` are single tokens; sampled parts in [brackets]; one sequence, two lines):

    Q:37*48=\\nA:[<tool_call>{"name": "calc", "arguments": {"expression": "37*48"}}</tool_call>]
    \\nR:1776\\nA:[1776<eos>]

or, without the tool, `Q:37*48=\\nA:[1776<eos>]`. Everything between the sampled parts is the chat
template's rendering of the conversation (tiny-tools' template: "Q:" user, "A:" assistant, "R:" tool lines).
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import random
import re
from collections.abc import Sequence
from fractions import Fraction

OPERANDS = range(10, 100)
HELDOUT_SIZE = 200
HELDOUT_SEED = 2718
"""Fixed, and independent of any session seed: every run holds out the same 200 pairs."""
TOOL_NAME = "calc"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
"""The tool-call markup (Hermes / Qwen style), one token each in tiny-tools' tokenizer."""

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_VALUE = 10**100
"""`calc` refuses longer expressions, larger exponents, and any number (numerator or denominator) this big."""

Pair = tuple[int, int]


# ------------------------------------------------------------------------------------------ problems
def question(a: int, b: int) -> str:
    return f"{a}*{b}="


def answer(a: int, b: int) -> str:
    return str(a * b)


def example(a: int, b: int) -> dict:
    """A task example: the prompt as chat messages, the answer, the operands."""
    return {"prompt": [{"role": "user", "content": question(a, b)}], "answer": answer(a, b), "a": a, "b": b}


@functools.cache
def calculator_pairs() -> tuple[tuple[Pair, ...], tuple[Pair, ...]]:
    """(train_pairs, heldout_pairs): all 90 x 90 operand pairs, 200 of them held out, both sorted."""
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS]
    heldout = sorted(random.Random(HELDOUT_SEED).sample(pairs, HELDOUT_SIZE))
    held = set(heldout)
    return tuple(p for p in pairs if p not in held), tuple(heldout)


# ---------------------------------------------------------------------------------------------- tool
def calc(expression: str) -> str:
    """The exact value of `expression` as text: integers, + - * / ** and brackets, parsed, never `eval`ed.

    Division is exact (fractions): "6/4" is "1.5", "1/3" is "0.3333333333" (a non-integer is rounded to
    10 decimals). ValueError, saying why, for anything else, a division by zero, an exponent above
    MAX_EXPONENT, a number of MAX_VALUE or more, or more than MAX_EXPRESSION_CHARS characters.
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is {len(expression)} characters long (at most {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}: {e.msg}") from None
    value = _evaluate(tree.body)
    return str(value.numerator) if value.denominator == 1 else str(round(float(value), 10))


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if not (isinstance(node, ast.BinOp) and type(node.op) in _BINARY):
        raise ValueError(f"{ast.unparse(node)!r} is not allowed: only integers, + - * / ** and brackets")
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Div) and right == 0:
        raise ValueError(f"division by zero in {ast.unparse(node)!r}")
    if isinstance(node.op, ast.Pow):
        if right.denominator != 1 or abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent of {ast.unparse(node)!r} must be an integer in "
                             f"-{MAX_EXPONENT}..{MAX_EXPONENT}, got {right}")
        if left == 0 and right < 0:
            raise ValueError(f"division by zero in {ast.unparse(node)!r}")
    return _bounded(_BINARY[type(node.op)](left, right))


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) >= MAX_VALUE or value.denominator >= MAX_VALUE:
        raise ValueError(f"a number in the calculation has over {len(str(MAX_VALUE)) - 1} digits")
    return value


# ------------------------------------------------------------------------------------------ episodes
def tool_call_text(expression: str) -> str:
    """The call of `calc` on `expression`: markup around json.dumps (default separators)."""
    return CALL_START + json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}}) + CALL_END


_CALL = re.compile(re.escape(CALL_START) + "(.*?)" + re.escape(CALL_END), re.S)


def parse_tool_call(text: str) -> str | None:
    """The expression of the first call in `text` if it is a well-formed call of `calc`, else None."""
    match = _CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and call.keys() == {"name", "arguments"} and call["name"] == TOOL_NAME):
        return None
    arguments = call["arguments"]
    if not (isinstance(arguments, dict) and arguments.keys() == {"expression"}):
        return None
    return arguments["expression"] if isinstance(arguments["expression"], str) else None


def render(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
    """The conversation as text by the tokenizer's chat template."""
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


def observation_text(tokenizer, messages: Sequence[dict], turn: str, result: str) -> str:
    """What the template appends after the sampled `turn` (following `messages` and the generation prompt)
    when the tool answers `result`: the end of the assistant line, the tool message, the next generation
    prompt ("\\nR:1776\\nA:" for tiny-tools)."""
    before = render(tokenizer, messages, add_generation_prompt=True) + turn
    after = render(tokenizer, [*messages, {"role": "assistant", "content": turn}, {"role": "tool", "content": result}],
                   add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError(f"the chat template is not append-only: {after!r} does not start with {before!r}")
    return after[len(before):]


def tool_episode(tokenizer, a: int, b: int) -> tuple[list[int], list[bool]]:
    """(ids, sampled) of the episode that calls calc on "a*b", then answers: `sampled` marks the call and
    the answer + EOS (the tokens a policy produces; the loss goes there only)."""
    messages = example(a, b)["prompt"]
    call = tool_call_text(f"{a}*{b}")
    return _tokens(tokenizer, [(render(tokenizer, messages, add_generation_prompt=True), False), (call, True),
                               (observation_text(tokenizer, messages, call, calc(f"{a}*{b}")), False),
                               (answer(a, b), True)])


def direct_episode(tokenizer, a: int, b: int) -> tuple[list[int], list[bool]]:
    """(ids, sampled) of the episode that answers at once: prompt, then answer + EOS (sampled)."""
    messages = example(a, b)["prompt"]
    return _tokens(tokenizer, [(render(tokenizer, messages, add_generation_prompt=True), False),
                               (answer(a, b), True)])


def _tokens(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Each piece's ids, concatenated, then EOS (sampled: it ends the last, sampled, piece)."""
    ids: list[int] = []
    sampled: list[bool] = []
    for text, is_sampled in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        sampled += [is_sampled] * len(piece)
    return ids + [tokenizer.eos_token_id], sampled + [True]
