"""Tasks: prompt sources with their rewards (see `Task`), and the registry of built-in ones.

    task = rlbench.tasks.get("arithmetic")
    task.train[0]   # {"prompt": "10+10=", "answer": "20", "a": 10, "b": 10}
    task.reward("20", task.train[0])   # 1.0

    task = rlbench.tasks.get("countdown", count=4)             # a built-in synthetic task, harder knob
    task = rlbench.tasks.from_parquet("gsm8k/train.parquet", test="gsm8k/test.parquet")   # verl's schema
    ids = rlbench.tasks.encode_prompt(tokenizer, task.train[0]["prompt"])   # chat template or plain text
"""

from __future__ import annotations

import hashlib
import json
import reprlib
from collections.abc import Callable

from rlbench.agents.parsers import HermesParser
from rlbench.models.chat import encode_prompt, render_prompt
from rlbench.tasks.agent import AgentTask
from rlbench.tasks.calculator import Calculator, calculator_split
from rlbench.tasks.arithmetic import Arithmetic
from rlbench.tasks.base import Task
from rlbench.tasks.data import (DataTask, check_row, convert_files, convert_main, from_jsonl, from_parquet, read_records,
                                read_rows, shuffled, split, write_rows)
from rlbench.tasks.prompts import check_pictures, check_prompts, has_images, limit_prompt_tokens, longest_prompt_tokens, prompt_tokens
from rlbench.tasks.shapes import Shapes
from rlbench.tasks.synthetic import Countdown, ListTask, Multiplication, Reverse, Sort
from rlbench.tasks import tool_math

__all__ = [
    "AgentTask", "Arithmetic", "Countdown", "DataTask", "ListTask", "Multiplication", "Reverse", "Shapes", "Sort", "Task", "check_row",
    "check_pictures", "check_prompts", "convert_files", "convert_main", "digest", "encode_prompt", "factory", "fingerprint", "from_jsonl", "from_parquet", "get", "has_images", "limit_prompt_tokens", "longest_prompt_tokens", "names",
    "prompt_tokens", "read_records", "read_rows", "render_prompt", "settings_of", "shuffled", "split", "write_rows",
]

def calculator(max_turns: int = 3, tool_timeout_s: float = 5.0) -> AgentTask:
    """Two-digit multiplication with a `calc` tool (`rl.tasks.calculator.Calculator`): the built-in agentic task,
    made for the `tiny-tools` model (200 held-out problems)."""
    train, test = calculator_split()
    # tiny-tools was warm-started on turns that end at the call's </tool_call> (the template writes what follows)
    # a call with its arguments takes about 55 tokens: the default 16 would cut every one
    return AgentTask(train, test, env=Calculator, max_turns=max_turns, tool_timeout_s=tool_timeout_s,
                     parser=HermesParser(stop_at_call=True), name="calculator", settings={"max_new_tokens": 64})


_BUILTINS: dict[str, Callable[..., Task]] = {
    "arithmetic": Arithmetic,
    "multiplication": Multiplication,
    "sort": Sort,
    "reverse": Reverse,
    "countdown": Countdown,
    "tool_math": tool_math.tool_math,
    "calculator": calculator,
    "shapes": Shapes,
}
"""Built-in task name -> factory; `get(name, **kwargs)` calls it with the kwargs."""


def names() -> list[str]:
    """The built-in task names."""
    return list(_BUILTINS)


def _brief(value) -> str:
    """A repr of `value` cut short (a list of a whole data set would fill a screen)."""
    brief = reprlib.Repr()
    brief.maxlist = brief.maxdict = 2
    brief.maxstring = brief.maxother = 40
    return brief.repr(value)


def get(task: str | Task, **kwargs) -> Task:
    """A built-in task by name (kwargs go to its factory); a Task instance is returned as is."""
    if not isinstance(task, str):
        if kwargs:
            raise TypeError(f"options {sorted(kwargs)} only apply to a task given by name, not to "
                            f"{_brief(task)}")
        if not isinstance(task, (Task, AgentTask)):
            raise TypeError(f"task= got a {type(task).__name__}, {_brief(task)}: a task is a built-in task's "
                            f"name ({', '.join(names())}) or an object with name, train, test, truncated_reward and "
                            f"reward() (rl.tasks.Task; examples in a file: rl.tasks.from_jsonl)")
        return task
    return factory(task)(**kwargs)


def factory(name: str) -> Callable[..., Task]:
    """What `get(name, **options)` calls for a built-in task: its signature names the task's options."""
    if name not in _BUILTINS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(names())}")
    return _BUILTINS[name]


def settings_of(task: Task) -> dict:
    """The Session settings `task` needs (its `settings`, a dict of `rl.Config` fields; none without one)."""
    settings = getattr(task, "settings", None) or {}
    if not isinstance(settings, dict):
        raise TypeError(f"task {getattr(task, 'name', task)!r}: settings must be a dict of Session settings, "
                        f"got {type(settings).__name__}")
    return dict(settings)


def digest(task: Task) -> str:
    """A hash of every example of the task, train and test (prompts, answers, the pixels of pictures): what a
    checkpoint records of its data, so that a restore onto other data of the same size is told."""
    hasher = hashlib.sha256()
    for split in (task.train, task.test):
        for example in split:
            hasher.update(json.dumps(example, sort_keys=True, default=_hashable).encode())
    return hasher.hexdigest()[:16]


def _hashable(value) -> str:
    """A JSON stand-in for a value JSON cannot hold: the hash of its bytes (a picture, a tensor), else its repr."""
    raw = value if isinstance(value, bytes) else getattr(value, "tobytes", None)
    if raw is not None:
        return hashlib.sha256(raw if isinstance(raw, bytes) else raw()).hexdigest()
    return repr(value)


def fingerprint(task: Task) -> str:
    """A short identity of a task: its name, split sizes and a hash of a few of its prompts (first and last
    train examples, first test example)."""
    train, test = task.train, task.test
    sample = [train[i].get("prompt", train[i]) for i in sorted({0, len(train) - 1})] + [
        test[0].get("prompt", test[0]) for _ in test[:1]]
    digest = hashlib.sha1(repr(sample).encode()).hexdigest()[:10]
    return f"{getattr(task, 'name', type(task).__name__)} ({len(train)} train, {len(test)} test, {digest})"
