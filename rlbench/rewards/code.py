"""Code-execution rewards: run the completion's program against tests, in the sandbox.

The tests (verl's `reward_model.ground_truth`, a dict or its JSON string) are stdin/stdout cases,
`{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}`, and/or Python assertions run after the program,
`{"assert": "assert add(1, 2) == 3"}` (`run_python(check=...)`: they count only if they ran to the end,
so a program that calls `sys.exit(0)` or `os._exit(0)` before them fails).
"""

from __future__ import annotations

import json
import re

from rlbench.rewards.answers import ground_truth
from rlbench.rewards.sandbox import Limits, run_python

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


def extract_code(completion: str) -> str:
    """The last fenced code block (```python ... ```), or the whole completion when it has none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def run_tests(program: str, tests: dict, *, limits: Limits = Limits()) -> list[tuple[bool, str]]:
    """(passed, why not) for each stdin/stdout case, then for the assertions if any; each in a fresh sandbox."""
    results = []
    for stdin, expected in zip(tests.get("inputs", []), tests.get("outputs", []), strict=True):
        run = run_python(program, stdin=stdin, limits=limits)
        if not run.ok:
            results.append((False, run.reason))
        else:
            same = run.stdout.split() == str(expected).split()  # whitespace-insensitive, like most judges
            results.append((same, "" if same else f"wrong output {run.stdout[:100]!r}"))
    if tests.get("assert"):  # after the program, in its namespace; a program that exits before them fails
        run = run_python(program, check=tests["assert"], limits=limits)
        results.append((run.ok, run.reason))
    return results


def code_reward(completion: str, example: dict, *, limits: Limits = Limits()) -> dict:
    """Score = the fraction of tests passed, "acc" = 1 when all pass. A program that times out, runs out of
    memory or trips the sandbox fails its test (that is the program's failure, not the reward's)."""
    tests = ground_truth(example)
    tests = json.loads(tests) if isinstance(tests, str) else tests
    results = run_tests(extract_code(completion), tests, limits=limits)
    if not results:
        raise ValueError("the example has no tests (need 'inputs'/'outputs' or 'assert')")
    passed = sum(ok for ok, _ in results)
    return {"score": passed / len(results), "acc": float(passed == len(results))}
