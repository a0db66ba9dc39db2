"""Tools: Python callables with type hints and a docstring, described to the model by a JSON schema.

    @rl.tool
    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: e.g. "(3+4)*5".
        \"\"\"
        ...

    calculator.schema      # {"type": "function", "function": {"name": "calculator", "description": ..., "parameters": ...}}
    calculator(expression="1+2")

An environment's methods marked `@rl.tool` are its tools (`rlbench.agents.env.tools_of`), bound to the
episode's instance when read from it. Arguments are checked against the signature before the call
(`Tool.check`), so a model's wrong call becomes a clear message for it to read, not an exception deep inside the
tool.
"""

from __future__ import annotations

import copy
import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
                               dict: "object"}


class Tool:
    """A callable the model may call by name, with the JSON schema derived from its signature and docstring."""

    def __init__(self, fn: Callable, name: str | None = None):
        self.fn = fn
        self.name = name or fn.__name__
        doc = inspect.getdoc(fn)
        if not doc:
            raise ValueError(f"tool {self.name!r} needs a docstring: its first line tells the model what it does")
        self.description, arg_docs = _parse_docstring(doc)
        self.params: dict[str, tuple[type, bool]] = {}  # name -> (type, required)
        hints = typing.get_type_hints(fn)
        properties, required = {}, []
        for p in inspect.signature(fn).parameters.values():
            if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.name not in hints:
                raise ValueError(f"tool {self.name!r}: parameter {p.name!r} needs a type hint (str, int, float, "
                                 f"bool, list or dict)")
            kind = typing.get_origin(hints[p.name]) or hints[p.name]
            if kind not in _JSON_TYPES:
                raise ValueError(f"tool {self.name!r}: parameter {p.name!r} has type {hints[p.name]!r}; a tool "
                                 f"takes str, int, float, bool, list or dict")
            properties[p.name] = {"type": _JSON_TYPES[kind]} | (
                {"description": arg_docs[p.name]} if p.name in arg_docs else {})
            self.params[p.name] = (kind, p.default is p.empty)
            if p.default is p.empty:
                required.append(p.name)
        self.schema = {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": properties, "required": required}}}
        """The OpenAI / Qwen function schema (what `apply_chat_template(tools=...)` takes)."""

    def check(self, arguments: Any) -> dict:
        """The arguments as keyword arguments of the call, or ValueError saying what is wrong with them."""
        if not isinstance(arguments, dict):
            raise ValueError(f"arguments of {self.name} must be a JSON object, got {type(arguments).__name__}")
        unknown = sorted(set(arguments) - set(self.params))
        if unknown:
            raise ValueError(f"{self.name} has no argument(s) {', '.join(unknown)}; it takes: "
                             f"{', '.join(self.params) or 'none'}")
        missing = [n for n, (_, required) in self.params.items() if required and n not in arguments]
        if missing:
            raise ValueError(f"{self.name} is missing argument(s) {', '.join(missing)}")
        checked = {}
        for name, value in arguments.items():
            kind = self.params[name][0]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
                raise ValueError(f"argument {name} of {self.name} must be {_JSON_TYPES[kind]}, got "
                                 f"{type(value).__name__} {value!r:.40}")
            checked[name] = value
        return checked

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __get__(self, instance, owner=None) -> Tool:
        """A method marked `@rl.tool`, read from an environment instance: the tool bound to that instance."""
        if instance is None:
            return self
        bound = copy.copy(self)
        bound.fn = self.fn.__get__(instance, owner)
        return bound

    def __repr__(self) -> str:
        return f"Tool({self.name}({', '.join(self.params)}): {self.description})"


def tool(fn: Callable | None = None, *, name: str | None = None):
    """Make a function a `Tool` (`@rl.tool` or `@rl.tool(name="calc")`): its schema comes from the signature
    (type hints: str, int, float, bool, list, dict) and the docstring (first paragraph: the description;
    an "Args:" section: each parameter's)."""
    if fn is None:
        return lambda f: Tool(f, name)
    return Tool(fn, name)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) of a Google-style docstring: the description is its first
    paragraph (lines joined), parameters are the "name: text" entries of an "Args:" section (continuation
    lines joined)."""
    parts = re.split(r"^\s*(?:Args|Arguments|Parameters):[ \t]*$", doc, maxsplit=1, flags=re.M)
    description = " ".join(line.strip() for line in parts[0].strip().split("\n\n")[0].splitlines())
    params: dict[str, str] = {}
    current, indent = None, 0
    for line in (parts[1] if len(parts) > 1 else "").splitlines():
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if current is not None and depth < indent:  # the next section ("Returns:")
            break
        match = re.match(r"\s*(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
        if match and (current is None or depth == indent):
            current, indent = match.group(1), depth
            params[current] = match.group(2).strip()
        elif current is not None:
            params[current] = f"{params[current]} {line.strip()}"
    return description, params
