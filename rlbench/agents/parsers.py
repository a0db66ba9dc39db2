"""Tool-call parsers: the text of an assistant turn -> the calls it makes, and what was wrong with the others.

Built in, by name in `PARSERS` (`AgentTask(parser=...)`), one per tool-call format of the major model families:

- "hermes" / "qwen" (`HermesParser`): Hermes, Qwen2.5, Qwen3 (and QwQ), any number of calls per turn,

      <tool_call>
      {"name": "calc", "arguments": {"expression": "37*48"}}
      </tool_call>

  Qwen3 may think first (`<think>...</think>`): a call inside the think block is part of the reasoning, neither
  run nor an error (Qwen3's template takes all before the last `</think>` as reasoning); while a `<think>` is
  open (the turn was cut), no call is read.
- "llama3" (`Llama3Parser`): Llama 3.1 / 3.2 / 3.3 with custom tools, the whole turn is one JSON call,
  `{"name": "calc", "parameters": {"expression": "37*48"}}`, after an optional `<|python_tag|>`, ending with
  `<|eom_id|>` or `<|eot_id|>` (one call per turn: their templates render one).
- "gpt-oss" (`GptOssParser`): the harmony format of gpt-oss, a turn of messages on channels: reasoning on
  `analysis`, the answer on `final`, a call on `commentary` addressed to `functions.NAME`,
  `<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{"expression": "37*48"}<|call|>`
  (the recipient may also stand before the channel, as the template writes it); the turn ends at `<|call|>`.

Which to pick: the one whose format the model's chat template writes for an assistant message's `tool_calls`
(the template's system prompt shows it: Qwen's "<tool_call></tool_call> XML tags", Llama's `"parameters"`, gpt-oss's
`namespace functions`).

A parser is any object with `stop` (strings after which the sampler stops a turn early; empty: the turn runs to
the end of the assistant's turn, EOS, so that every call it makes is read) and `parse(text) -> (calls, errors)`;
an error is a message the model will read as the tool's answer ("malformed tool call: ..."), never an exception.

A parser may also say how its format's turn is a chat message, for templates that render an assistant message's
`tool_calls` (Qwen's, Llama 3.1's, gpt-oss's) and those that render a tool message only after the call it answers,
named after it (gpt-oss's):
`assistant_message(text, calls)` (the turn as the template takes it) and `tool_messages(calls, contents)` (the
results). `assistant_message(parser, ...)` and `tool_messages(parser, ...)` below call them, or, for a parser
without them, give the text as the message's content and one tool message per result, the k-th named after the
k-th call. The sampled tokens are kept as sampled whatever the message says (`rlbench.agents.render`): the messages
only decide how the template renders what follows them (tool results, the next generation prompt) and what
`check_template` compares with.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

THINK_START, THINK_END = "<think>", "</think>"
"""Qwen3's reasoning block: calls inside it are not read."""


@dataclass
class ToolCall:
    """One call the model made; edit `name` / `arguments` before the tools run to change it."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    """The call as sampled."""


class Parser(Protocol):
    stop: tuple[str, ...]
    """Strings that end a turn early (e.g. a call is complete: run the tool); () lets it run to EOS."""

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        """The calls in an assistant turn's text, and one message per call that could not be read."""
        ...


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn (Qwen2.5 / Qwen3 / Hermes).

    A turn runs to its end (EOS: `<|im_end|>` for Qwen), so that it may make several calls; they run at once, and
    their results follow in order. `stop_at_call=True` ends a turn at its first `</tool_call>` instead (one call per
    turn), for a model whose call turns end there, as the built-in tiny-tools' do (its chat template writes what
    follows a call).
    """

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self, stop_at_call: bool = False):
        self.stop = (self.close_tag,) if stop_at_call else ()
        self._call = re.compile(re.escape(self.open_tag) + r"(.*?)(" + re.escape(self.close_tag) + r"|$)", re.S)

    def __repr__(self) -> str:
        return f"HermesParser(stop_at_call={bool(self.stop)})"

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        read = [self._read(match) for match in self._matches(text)]
        return [call for call, _ in read if call], [error for _, error in read if error]

    def _matches(self, text: str) -> list[re.Match]:
        """The calls after the reasoning: after the last `</think>`; none while a `<think>` is open."""
        end = text.rfind(THINK_END)
        if end < 0 and THINK_START in text:
            return []
        return list(self._call.finditer(text, end + len(THINK_END) if end >= 0 else 0))

    def _read(self, match: re.Match) -> tuple[ToolCall | None, str | None]:
        body = match.group(1).strip()
        if not match.group(2):
            return None, f"unterminated tool call (no {self.close_tag}): {body[:80]!r}"
        value, error = _load_json(body)
        return (None, error) if error else _named_call(value, "arguments", body, match.group(0))

    def assistant_message(self, text: str, calls: list[ToolCall]) -> dict:
        """The calls as `tool_calls`, the rest of the text as content (with any reasoning: Qwen3's template splits
        it off itself; and the calls that could not be read, as sampled). Qwen's templates write the content, a
        newline, then each call as `<tool_call>\\n{json}\\n</tool_call>`, joined by newlines: a turn sampled that
        way renders as sampled."""
        spans = [m.span() for m in self._matches(text) if self._read(m)[0]]
        if not spans:
            return {"role": "assistant", "content": text}
        kept = [text[a:b] for a, b in zip([0] + [e for _, e in spans], [s for s, _ in spans] + [len(text)])]
        return {"role": "assistant", "content": "".join(kept).strip(), "tool_calls": _tool_calls(calls)}


class Llama3Parser:
    """`{"name": ..., "parameters": {...}}`, the whole turn, after an optional `<|python_tag|>` (Llama 3.1 / 3.2 /
    3.3 with custom tools; "arguments" is read too). A turn that starts with neither `{` nor the tag is an answer.
    One call per turn, as the templates render it; what follows the call is an error message. The turn ends at
    `<|eot_id|>` (EOS) or `<|eom_id|>` (the stop: "a tool answers next")."""

    tag, ends = "<|python_tag|>", ("<|eom_id|>", "<|eot_id|>")

    def __init__(self):
        self.stop = self.ends[:1]

    def __repr__(self) -> str:
        return "Llama3Parser()"

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        body = text.strip()
        for end in self.ends:
            body = body.removesuffix(end).rstrip()
        tagged = body.startswith(self.tag)
        body = body.removeprefix(self.tag).lstrip()
        if not body.startswith("{"):
            return [], [f"after {self.tag} comes a JSON tool call, got {body[:80]!r}"] if tagged else []
        try:
            value, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as error:
            return [], [_json_error(error, body)]
        key = next((k for k in ("parameters", "arguments") if isinstance(value, dict) and k in value), "parameters")
        call, error = _named_call(value, key, body[:end], text)
        rest = body[end:].strip()
        errors = [error] if error else []
        errors += [f"one tool call per turn: ignored what follows the call, {rest[:80]!r}"] if rest else []
        return [call] if call else [], errors

    def assistant_message(self, text: str, calls: list[ToolCall]) -> dict:
        """The call as `tool_calls` (Llama 3.1-3.3's templates write it as `{"name": ..., "parameters": ...}`), or
        the text as content."""
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": "", "tool_calls": _tool_calls(calls)}


class GptOssParser:
    """gpt-oss's harmony format. A turn (after the generation prompt `<|start|>assistant`) is messages, each
    `<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY` ending with `<|end|>`, `<|call|>` or
    `<|return|>`, the next one after `<|start|>assistant`. A message to `functions.NAME` (on `commentary`) is a call
    of NAME with the JSON object BODY; the turn ends at its `<|call|>` (the stop), so a turn makes one call. Other
    recipients (the built-in `browser.*`, `python`) are error messages."""

    start, header_end, ends = "<|start|>", "<|message|>", ("<|end|>", "<|call|>", "<|return|>")
    _recipient, _channel = re.compile(r"\bto=([^\s<]+)"), re.compile(r"<\|channel\|>\s*(\w+)")

    def __init__(self):
        self.stop = ("<|call|>",)

    def __repr__(self) -> str:
        return "GptOssParser()"

    def messages(self, text: str) -> list[dict]:
        """The turn's messages: {"channel", "recipient" (None: not a call), "body", "end" ("" when cut off)}."""
        out = []
        for part in text.split(self.start):
            header, found, rest = part.partition(self.header_end)
            if not found:
                continue  # "assistant" before a message, or a header cut off by the length limit
            ends = [(rest.find(e), e) for e in self.ends if e in rest]
            at, end = min(ends) if ends else (len(rest), "")
            channel, recipient = self._channel.search(header), self._recipient.search(header)
            out.append({"channel": channel.group(1) if channel else None, "body": rest[:at], "end": end,
                        "recipient": recipient.group(1) if recipient else None})
        return out

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        calls, errors = [], []
        for m in self.messages(text):
            if m["recipient"] is None:
                continue
            call, error = self._call(m)
            calls += [call] if call else []
            errors += [error] if error else []
        return calls, errors

    def _call(self, m: dict) -> tuple[ToolCall | None, str | None]:
        recipient, body = m["recipient"], m["body"].strip()
        if not recipient.startswith("functions."):
            return None, f"tool calls go to functions.NAME (the tools declared), got to={recipient}"
        if m["end"] != "<|call|>":
            return None, f"unterminated tool call to {recipient} (no <|call|>): {body[:80]!r}"
        arguments, error = _load_json(body)
        if error:
            return None, error
        if not isinstance(arguments, dict):
            return None, f"the arguments of a call to {recipient} are a JSON object, got {body[:80]!r}"
        return ToolCall(recipient.removeprefix("functions."), arguments, m["body"]), None

    def assistant_message(self, text: str, calls: list[ToolCall]) -> dict:
        """`thinking` (the analysis channel), `content` (the final channel) and `tool_calls`, as gpt-oss's template
        takes them. The calls are read from the text, so that a call that could not be read still names the
        function its error message answers as (the template names a tool message after the call before it)."""
        read = self.messages(text)
        thinking = "\n".join(m["body"] for m in read if m["channel"] == "analysis")
        called = [m for m in read if m["recipient"]]
        message = {"role": "assistant", "content": "" if called else
                   "".join(m["body"] for m in read if m["channel"] == "final")}
        if thinking:
            message["thinking"] = thinking
        if called:
            message["tool_calls"] = [
                _function(k, m["recipient"].removeprefix("functions."), _arguments_or_text(m["body"]))
                for k, m in enumerate(called)]
        return message


def _load_json(body: str) -> tuple[Any, str | None]:
    """(the value, None) or (None, the error message)."""
    try:
        return json.loads(body), None
    except json.JSONDecodeError as error:
        return None, _json_error(error, body)


def _json_error(error: json.JSONDecodeError, body: str) -> str:
    return f"malformed tool call JSON ({error.msg} at character {error.pos}): {body[:80]!r}"


def _named_call(value: Any, key: str, body: str, text: str) -> tuple[ToolCall | None, str | None]:
    """`{"name": <string>, key: <object>}` as a call (its arguments may be a JSON string, as some models send
    them), or the error message."""
    arguments = value.get(key, {}) if isinstance(value, dict) else None
    if isinstance(arguments, str):
        arguments = _load_json(arguments)[0]
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
        return None, f'a tool call is {{"name": <string>, "{key}": <object>}}, got {body[:80]!r}'
    return ToolCall(value["name"], arguments, text), None


def _arguments_or_text(body: str):
    """A call's JSON object, or its text when it is not one (the template still renders it)."""
    value, error = _load_json(body)
    return value if error is None and isinstance(value, dict) else body


def _function(k: int, name: str, arguments) -> dict:
    """The k-th call of a turn as an OpenAI-style `tool_calls` entry (what chat templates read)."""
    return {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_calls(calls: list[ToolCall]) -> list[dict]:
    return [_function(k, call.name, call.arguments) for k, call in enumerate(calls)]


def assistant_message(parser: Parser, text: str, calls: list[ToolCall]) -> dict:
    """The sampled turn as a chat message: the parser's `assistant_message`, or the text as content."""
    build = getattr(parser, "assistant_message", None)
    return build(text, calls) if build else {"role": "assistant", "content": text}


def tool_messages(parser: Parser, calls: list[ToolCall], contents: list[str]) -> list[dict]:
    """The tool results of a turn as chat messages: the parser's `tool_messages`, or one tool message per content,
    the k-th answering the k-th call (its name and the id `assistant_message` gives it: "call_k"), the others
    (messages about calls that could not be read) answering none. The built-in formats all take the latter."""
    build = getattr(parser, "tool_messages", None)
    if build:
        return build(calls, contents)
    return [{"role": "tool", "content": content,
             **({"name": calls[k].name, "tool_call_id": f"call_{k}"} if k < len(calls) else {})}
            for k, content in enumerate(contents)]


PARSERS = {"hermes": HermesParser, "qwen": HermesParser, "llama3": Llama3Parser, "gpt-oss": GptOssParser}
"""Built-in parsers by name (`AgentTask(parser="hermes")`): the module docstring says which model each reads."""


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
