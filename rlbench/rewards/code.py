"""Code-execution rewards: run the completion's program against tests, in the sandbox, and judge on the host.

The tests (verl's `reward_model.ground_truth`, a dict or its JSON string) are stdin/stdout cases,
`{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}`, and/or Python assertions, `{"assert": "assert add(1, 2) == 3"}`.

The expected values never enter the sandbox, so no program can forge a pass (replacing `exec`, walking the
harness's frames, an object whose `__eq__` is always true): a program only ever sees a test's input.
- A stdin/stdout case runs the program on its input; the host compares its stdout.
- Assertions of the form `assert CALL == LITERAL` (either side) are call tests: the program runs once, then each
  call is evaluated in its namespace and its value sent back as plain data (None, bool, int, float, str, bytes,
  complex and lists, tuples, sets, dicts of them; an object of another type is an error), and the host compares it
  with the literal by Python's `==` on its own objects. A call that raises is that test's error.
- Any other assertion is weaker: each runs after the program in a fresh sandbox and passes when it finishes
  (`run_python(check=...)`: a program that exits before it fails, but one written to walk the harness's frames can
  make it pass).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from rlbench.rewards.answers import ground_truth
from rlbench.rewards.sandbox import Limits, Run, run_python

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)

# sent after the program with the calls' sources only: it prints each call's value as plain data, or its error
_HARNESS = '''
def _rlbench_results(calls):
    import json

    def plain(value, depth=0):
        kind = type(value)
        if depth > 100:
            raise ValueError("nested more than 100 deep")
        if value is None or kind in (bool, int, float, str):
            return value
        if kind is list:
            return [plain(item, depth + 1) for item in value]
        if kind in (tuple, set, frozenset):
            return {"type": kind.__name__, "items": [plain(item, depth + 1) for item in value]}
        if kind is dict:
            return {"type": "dict", "items": [[plain(k, depth + 1), plain(v, depth + 1)] for k, v in value.items()]}
        if kind is bytes:
            return {"type": "bytes", "hex": value.hex()}
        if kind is complex:
            return {"type": "complex", "items": [value.real, value.imag]}
        raise TypeError(f"returned a {kind.__name__}; the tests compare plain values (numbers, strings, containers)")

    results = []
    for source in calls:
        try:
            results.append(["value", plain(eval(source, globals()))])
        except BaseException as error:
            results.append(["error", f"{type(error).__name__}: {str(error)[:200]}"])
    return json.dumps(results)


print("\\n" + _rlbench_results(__CALLS__))
'''


@dataclass(frozen=True)
class Outcome:
    passed: bool
    why: str = ""
    """Why not: "wrong answer ...", "error: ..." (the call raised), or the run's reason (a timeout, a crash)."""


def extract_code(completion: str) -> str:
    """The last fenced code block (```python ... ```), or the whole completion when it has none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def run_tests(program: str, tests: dict, *, limits: Limits = Limits(), mode: str | None = None) -> list[Outcome]:
    """The result of each stdin/stdout case, then of each assertion (see the module docstring); `mode`: the sandbox's
    (`run_python`)."""
    results = []
    for stdin, expected in zip(tests.get("inputs", []), tests.get("outputs", []), strict=True):
        run = run_python(program, stdin=stdin, limits=limits, mode=mode)
        if not run.ok:
            results.append(Outcome(False, run.reason))
        else:
            same = run.stdout.split() == str(expected).split()  # whitespace-insensitive, like most judges
            results.append(Outcome(same, "" if same else f"wrong output {run.stdout[:100]!r}"))
    if tests.get("assert"):
        calls, others = split_asserts(tests["assert"])
        if calls:
            results += _call_tests(program, calls, limits, mode)
        for statement in others:
            run = run_python(program, check=statement, limits=limits, mode=mode)
            results.append(Outcome(run.ok, run.reason))
    return results


def split_asserts(source: str) -> tuple[list[tuple[str, object]], list[str]]:
    """(the call tests: (call source, expected value) of each `assert CALL == LITERAL`, the other statements' sources);
    ValueError when the tests are not Python (the task's data is broken, not the program)."""
    try:
        statements = ast.parse(source).body
    except SyntaxError as error:
        raise ValueError(f"the example's assert tests are not Python: {error}") from None
    calls, others = [], []
    for node in statements:
        test = node.test if isinstance(node, ast.Assert) and node.msg is None else None
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            for call, literal in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
                try:
                    calls.append((ast.unparse(call), ast.literal_eval(literal)))
                    break
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    continue
            else:
                others.append(ast.unparse(node))
        else:
            others.append(ast.unparse(node))
    return calls, others


def _call_tests(program: str, calls: list[tuple[str, object]], limits: Limits, mode: str | None) -> list[Outcome]:
    harness = _HARNESS.replace("__CALLS__", repr([source for source, _ in calls]))
    run = run_python(program + "\n" + harness, limits=limits, mode=mode)
    values = _values(run, len(calls))
    if isinstance(values, str):
        return [Outcome(False, values)] * len(calls)
    results = []
    for (source, expected), (kind, value) in zip(calls, values):
        if kind == "error":
            results.append(Outcome(False, f"error: {source} raised {value}"))
        elif _python(value) == expected:
            results.append(Outcome(True))
        else:
            results.append(Outcome(False, f"wrong answer: {source} gave {str(_python(value))[:100]}"))
    return results


def _values(run: Run, n: int) -> list | str:
    """The calls' [kind, value] pairs from the run's last line, or why there are none."""
    if not run.ok:
        return run.reason
    try:
        values = json.loads(run.stdout.rstrip("\n").rsplit("\n", 1)[-1])
    except (ValueError, RecursionError):
        values = None
    if not (isinstance(values, list) and len(values) == n and all(
            isinstance(v, list) and len(v) == 2 and v[0] in ("value", "error") for v in values)):
        return "the program changed or cut the harness's output (no results for the calls)"
    return values


def _python(value):
    """A plain value sent back by the harness, as the Python object it stands for."""
    if isinstance(value, list):
        return [_python(item) for item in value]
    if not isinstance(value, dict):
        return value
    kind, items = value.get("type"), value.get("items", [])
    if kind == "bytes":
        return bytes.fromhex(value.get("hex", ""))
    if kind == "complex":
        return complex(*items)
    try:
        made = [_python(item) for item in items]
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](made) if kind != "dict" else dict(made)
    except (KeyError, TypeError, ValueError):
        return value  # (a malformed record equals no expected value)


def code_reward(completion: str, example: dict, *, limits: Limits = Limits()) -> dict:
    """Score = the fraction of tests passed (each stdin/stdout case and each assertion is one), "acc" = 1 when all
    pass. A program that does not compile, times out, runs out of memory or trips the sandbox fails its tests (that is
    the program's failure, not the reward's)."""
    tests = ground_truth(example)
    tests = json.loads(tests) if isinstance(tests, str) else tests
    results = run_tests(extract_code(completion), tests, limits=limits)
    if not results:
        raise ValueError("the example has no tests (need 'inputs'/'outputs' or 'assert')")
    passed = sum(result.passed for result in results)
    return {"score": passed / len(results), "acc": float(passed == len(results))}
