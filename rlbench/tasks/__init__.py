"""Tasks: prompt sources with their rewards (see `Task`), and the registry of built-in ones.

    task = rlbench.tasks.get("arithmetic")
    task.train[0]   # {"prompt": "10+10=", "answer": "20", "a": 10, "b": 10}
    task.reward("20", task.train[0])   # 1.0
"""

from __future__ import annotations

from collections.abc import Callable

from rlbench.tasks.arithmetic import Arithmetic
from rlbench.tasks.base import Task

__all__ = ["Arithmetic", "Task", "get", "names"]

_BUILTINS: dict[str, Callable[..., Task]] = {
    "arithmetic": Arithmetic,
}
"""Built-in task name -> factory; `get(name, **kwargs)` calls it with the kwargs."""


def names() -> list[str]:
    """The built-in task names."""
    return list(_BUILTINS)


def get(task: str | Task, **kwargs) -> Task:
    """A built-in task by name (kwargs go to its factory); a Task instance is returned as is."""
    if not isinstance(task, str):
        if kwargs:
            raise TypeError(f"options {sorted(kwargs)} only apply to a task given by name, not to {task!r}")
        if not isinstance(task, Task):
            raise TypeError(f"{task!r} is not a Task: it needs name, train, test, truncated_reward and reward()")
        return task
    if task not in _BUILTINS:
        raise ValueError(f"unknown task {task!r}; built-in tasks: {', '.join(names())}")
    return _BUILTINS[task](**kwargs)
