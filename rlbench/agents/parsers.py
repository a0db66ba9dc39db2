"""Tool-call parsers: the text of an assistant turn -> the calls it makes, and what was wrong with the others.

The built-in `HermesParser` reads the Hermes / Qwen2.5 / Qwen3 format,

    <tool_call>
    {"name": "calc", "arguments": {"expression": "37*48"}}
    </tool_call>

A parser is any object with `stop` (strings after which the sampler should stop: the end of a call, so that
the tool runs before the model goes on) and `parse(text) -> (calls, errors)`; an error is a message the model
will read as the tool's answer ("malformed tool call: ..."), never an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCall:
    """One call the model made; edit `name` / `arguments` before the tools run to change it."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    """The call as sampled."""


class Parser(Protocol):
    stop: tuple[str, ...]
    """Strings that end a turn early (a call is complete: run the tool)."""

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        """The calls in an assistant turn's text, and one message per call that could not be read."""
        ...


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn (Qwen2.5 / Qwen3 / Hermes)."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.stop = (self.close_tag,)
        self._call = re.compile(re.escape(self.open_tag) + r"(.*?)(" + re.escape(self.close_tag) + r"|$)", re.S)

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        calls, errors = [], []
        for match in self._call.finditer(text):
            body, closed = match.group(1).strip(), bool(match.group(2))
            if not closed:
                errors.append(f"unterminated tool call (no {self.close_tag}): {body[:80]!r}")
                continue
            try:
                call = json.loads(body)
            except json.JSONDecodeError as error:
                errors.append(f"malformed tool call JSON ({error.msg} at character {error.pos}): {body[:80]!r}")
                continue
            arguments = call.get("arguments", {}) if isinstance(call, dict) else None
            if isinstance(arguments, str):  # some models send the arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
                errors.append(f'a tool call is {{"name": <string>, "arguments": <object>}}, got {body[:80]!r}')
                continue
            calls.append(ToolCall(call["name"], arguments, match.group(0)))
        return calls, errors


PARSERS = {"hermes": HermesParser}
"""Built-in parsers by name (`AgentTask(parser="hermes")`)."""


def get_parser(parser: str | Parser) -> Parser:
    """A parser by name, or the given object (it needs `stop` and `parse`)."""
    if isinstance(parser, str):
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; built-in: {', '.join(PARSERS)} (or pass an "
                             f"object with .stop and .parse(text))")
        return PARSERS[parser]()
    if not (hasattr(parser, "parse") and hasattr(parser, "stop")):
        raise TypeError(f"a tool-call parser needs .stop and .parse(text) -> (calls, errors), got {parser!r}")
    return parser
