"""Rendering a conversation as the sampler sees it: append-only token ids, and the check that a template is.

An episode's context grows by appending: the sampled tokens of a turn stay exactly as sampled, then the tokens
of the new messages (tool results, observations) and the next generation prompt are appended. Nothing already
in the context is re-tokenized or re-rendered (chat templates are not always append-only: some drop earlier
reasoning blocks or rewrite turn separators, and a trainer fed the re-rendered tokens learns on tokens nobody
sampled).

What to append comes from the template itself, rendered around a short reference conversation (a user turn, then
the sampled turn as a chat message): what the template writes after the sampled text (`Renderer.closing`: the
end of turn the sampler did not sample, e.g. "\\n" after Qwen's "<|im_end|>"), then the text it renders for the
new messages and the generation prompt. The sampled turn's message is the parser's (`rlbench.agents.parsers`):
templates such as gpt-oss's render a tool result only after the assistant message whose `tool_calls` it answers,
and name it after that call (a template that renders no `tool_calls` gets the sampled text as the content).
`check_template` says whether this equals rendering the conversation whole, turn by turn, and what to do when it
does not. A template that fails on a conversation (a jinja error) is a ValueError naming the error and the shape
of the messages.

Without a chat template, messages render plainly as "role: content" lines and "assistant:" for the reply (an
assistant message as "assistant:" and its content, as the sampler drew it after that prompt).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from jinja2 import TemplateError

from rlbench.agents.parsers import Parser, assistant_message, tool_messages
from rlbench.models.chat import has_chat_template
from rlbench.models.vision import IMAGE_MARK, Vision

PROBE = "rlbench-probe-3f9a"
"""The assistant content of the reference conversation (text no template writes by itself)."""
USER = {"role": "user", "content": "hi"}
"""The user turn of the reference conversation."""
KINDS = ("template", "sampled", "tool", "image")
"""What each token of an episode is (its code is the index): written by the chat template, sampled by the
policy (the only trainable kind), the content of a tool result / observation, or a picture's placeholder (a
vision-language model's image tokens, where a tool's picture goes: never sampled, never trained)."""


class Renderer:
    """A tokenizer's chat template (with the tools declared) as prompt ids and append-only continuations; with a
    vision-language model's `vision` (`rl.models.vision.Vision`), pictures at the `<image>` marks of messages."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, vision: Vision | None = None):
        self.tokenizer, self.tools, self.vision = tokenizer, tools or None, vision
        reference = self.render([USER, {"role": "assistant", "content": PROBE}], generation_prompt=False)
        self.end_of_turn = reference[reference.rindex(PROBE) + len(PROBE):]
        """What the template writes after an assistant message's content (e.g. "<|im_end|>\\n")."""
        self._prompt_text = self.render([USER], generation_prompt=True)
        self.renders_tool_calls = self._renders_tool_calls()
        """Whether the template writes an assistant message's `tool_calls`; one that does not (the built-in
        tiny-tools', Llama 3's first) gets each turn's sampled text as the message's content instead."""

    def render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        """The conversation as text, whole, ending with the assistant's generation prompt if asked; ValueError
        naming the template's error and the messages' shape when the template fails on them."""
        if not has_chat_template(self.tokenizer):  # a reply follows "assistant:" as it was sampled after it
            return "".join(f"{m['role']}:{'' if m['role'] == 'assistant' else ' '}{m['content']}\n"
                           for m in messages) + ("assistant:" if generation_prompt else "")
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except TemplateError as error:
            raise ValueError(f"the chat template cannot render messages shaped {shape(messages)}: "
                             f"{type(error).__name__}: {error} (a template that renders an assistant message's "
                             f"tool_calls, or names a tool message after its call, needs the messages of the model's "
                             f"tool-call format: AgentTask(parser=...), one of rl.agents.PARSERS)") from error

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first context of an episode: its messages and the generation prompt."""
        return self.prompt(messages)[0]

    def prompt(self, messages: list[dict], images: Sequence = ()) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(ids, pixels) of an episode's first context with its pictures (an example's `images`), placed as a
        single-turn prompt's are (`Vision.encode`: at the `<image>` marks, or before the text); pixels {} without.
        ValueError for pictures to a text-only model, marks that do not pair up with them, typed image markup."""
        text = self.render(messages, generation_prompt=True)
        if self.vision is not None:
            return self.vision.encode(self.tokenizer, text, images)
        if images:
            raise ValueError(f"{len(images)} image(s) for a text-only model (no vision tower)")
        return self.encode(text), {}

    def continuation(self, sampled_text: str, messages: list[dict], assistant: dict | None = None,
                     images: Sequence[Sequence] = ()) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
        """(token ids, their kinds, pixels) to append after an assistant turn that sampled `sampled_text`: the rest
        of the template's end of turn, `messages` (tool results, observations) and the next generation prompt.
        `assistant` is the sampled turn as a chat message (`parsers.assistant_message`; default: the text as its
        content). `images`: per message, its pictures, one per `<image>` mark of its content (a tool's picture,
        `rl.models.vision.content_of`); their tokens (kind "image") go at the marks, their pixels are the third value
        ({} without pictures; in a message without pictures `<image>` is text). ValueError when a message's marks and
        pictures do not pair up, or, for a vision-language model, when the text holds image markup tokens."""
        if assistant is None or not self.renders_tool_calls:
            assistant = {"role": "assistant", "content": self._without_eos(sampled_text)}
        closing = self.closing(sampled_text, assistant)
        text = closing + self._rendered(assistant, list(messages))
        spans, marks, start = [], [], len(closing)
        for m, pictures in zip(messages, list(images) + [()] * (len(messages) - len(images))):
            at = text.find(m["content"], start) if m["content"] else -1  # where its content sits in the text
            if at >= 0:
                spans.append((at, at + len(m["content"])))
                start = at + len(m["content"])
            marks += _marks(m["content"], at, pictures)
        pieces = [text] if not marks else [text[a:b] for a, b in zip([0] + [at + len(IMAGE_MARK) for at in marks],
                                                                    marks + [len(text)])]
        pixels = self.vision.pixels([p for pictures in images for p in pictures]) if marks else {}
        runs = self.vision.image_runs(pixels) if marks else []
        ids, kinds, offset = [], [], 0
        for k, piece in enumerate(pieces):
            encoded = self.tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
            ids += self.vision.refuse_markup(self.tokenizer, encoded["input_ids"]) if self.vision else encoded["input_ids"]
            kinds += [KINDS.index("tool") if any(offset + a < e and offset + b > s for s, e in spans)
                      else KINDS.index("template") for a, b in encoded["offset_mapping"]]
            if k < len(runs):
                ids += runs[k]
                kinds += [KINDS.index("image")] * len(runs[k])
            offset += len(piece) + len(IMAGE_MARK)
        return ids, kinds, pixels

    def closing(self, sampled_text: str, assistant: dict) -> str:
        """What the template writes after the sampled text of a turn (`assistant`: the turn as a chat message).

        The template's text of the turn (`turn_text`) after the sampled text less its EOS: its end of turn when the
        turn was sampled as the template writes it ("<|im_end|>\\n" after a stop string); where the template writes
        it otherwise (a call's JSON spaced otherwise, gpt-oss's recipient on the other side of the channel), what
        follows the longest end of it that the template's text holds. A sampled EOS that this starts with is
        not written again ("\\n" after Qwen's EOS "<|im_end|>"). Where the template's text holds no end of it at
        all, `end_of_turn`."""
        text = self._without_eos(sampled_text)
        turn = self.turn_text(assistant)
        if turn.startswith(text):
            closing = turn[len(text):]
        elif k := _longest_end_within(text, turn):
            closing = turn[turn.rindex(text[-k:]) + k:]
        else:
            closing = self.end_of_turn
        eos = sampled_text[len(text):]
        return closing[len(eos):] if eos and closing.startswith(eos) else closing

    def _without_eos(self, sampled_text: str) -> str:
        return sampled_text.removesuffix(self.tokenizer.eos_token or "")

    def _renders_tool_calls(self) -> bool:
        call = {"id": "call_0", "type": "function", "function": {"name": PROBE, "arguments": {}}}
        try:
            return PROBE in self.render([USER, {"role": "assistant", "content": "", "tool_calls": [call]}],
                                        generation_prompt=False)
        except ValueError:  # a template that fails on tool_calls renders none
            return False

    def turn_text(self, assistant: dict) -> str:
        """The template's text of an assistant message as the last of the reference conversation, after the
        generation prompt."""
        whole = self.render([USER, assistant], generation_prompt=False)
        return whole[len(os.path.commonprefix([self._prompt_text, whole])):]

    def _rendered(self, assistant: dict, messages: list[dict]) -> str:
        """The template's text for `messages` and the generation prompt, after the sampled turn (`assistant`);
        where the template rewrites the turn once more follow (Qwen3's drops an empty reasoning block), after the
        user turn alone (the new messages' own text: earlier tokens are never rewritten)."""
        for before in ([USER, assistant], [USER]):
            head = self.render(before, generation_prompt=False)
            after = self.render(before + messages, generation_prompt=True)
            if after.startswith(head):
                return after[len(head):]
        raise ValueError(f"this chat template renders the conversation {shape([USER, assistant] + messages)} "
                         f"differently from its first messages alone, even after a user message: rlbench cannot "
                         f"append messages to a conversation with it")


FIXES = """\
What to do (an episode keeps the tokens it sampled either way, and trains on the contexts the model really saw;
what differs is the context the template would give at inference):
  - use a template that leaves earlier turns as they were, a fixed copy of the model's, such as TRL's training
    templates (trl/chat_templates/*_training.jinja; qwen3_training.jinja keeps Qwen3's reasoning): set
    `tokenizer.chat_template` and save the tokenizer in the model's folder (`tokenizer.save_pretrained(path)`), which
    the session loads (rlbench has no chat-template setting of its own);
  - or accept it: the session only warns."""
"""The options a failed `TemplateReport` lists."""


@dataclass
class TemplateReport:
    """What `check_template` found: per assistant turn, the first token where appending differs from the
    whole render (None where they agree); printed when they differ, it lists what to do (`FIXES`)."""

    turns: list[dict] = field(default_factory=list)
    """One dict per turn: {"turn", "position", "appended", "whole"} (position None: no difference)."""
    error: str | None = None
    """Why the conversation could not be rendered at all (then nothing was compared)."""

    @property
    def ok(self) -> bool:
        return self.error is None and all(t["position"] is None for t in self.turns)

    def __str__(self) -> str:
        if self.error is not None:
            return f"template could not be checked: {self.error}"
        if self.ok:
            return f"template is append-only over {len(self.turns)} turns"
        lines = ["template is NOT append-only: the tokens a sampler appends differ from rendering the "
                 "conversation whole"]
        for t in self.turns:
            if t["position"] is not None:
                lines.append(f"  turn {t['turn']}: first difference at token {t['position']}: appended "
                             f"{t['appended']!r}, whole {t['whole']!r}")
        return "\n".join(lines + [FIXES])

    __repr__ = __str__


def chat_messages(value) -> list[dict]:
    """`value` as a copy of its chat messages (a string is one user turn); ValueError saying what it got when it is
    not a string or a non-empty list of dicts, each with a string "role" and "content"."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{value!r:.80}: expected a string (one user turn) or a list of chat messages")
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"message {i} {message!r:.80}: expected a dict with a string role and content")
    return [dict(m) for m in value]


def check_template(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                   parser: Parser | None = None) -> TemplateReport:
    """Render `messages` turn by turn as a sampler sees them (the first prompt, each assistant message's content
    as its sampled tokens, the template's continuations appended) and whole, and report the first differing
    token of each assistant turn (the whole render of the conversation up to and including that turn's
    continuation is the reference).

    With a `parser` (`rl.agents.get_parser("qwen")`, ...), the template gets the messages an episode gives it: each
    assistant message as the parser reads its text (`tool_calls` and all), the tool messages after it named after
    its calls; write the assistant texts as the model writes its calls. Without one, or with a template that
    renders no `tool_calls`, assistant messages are their text. `messages` needs at least one assistant message
    after the first user turn. The session runs this on its task's first example at start-up and warns with the
    report when it fails.
    """
    try:
        messages = chat_messages(messages)
    except ValueError as error:
        raise ValueError(f"check_template: {error}") from None
    renderer = Renderer(tokenizer, tools)
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if not first:
        raise ValueError("check_template needs a conversation with an assistant message after the first turn")
    parsed = episode_messages(messages, parser if renderer.renders_tool_calls else None)
    ids = renderer.prompt_ids(parsed[:first])
    report = TemplateReport()
    i, turn = first, 0
    while i < len(messages):
        content = messages[i]["content"]
        j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
        ids = ids + renderer.encode(content)
        if j < len(messages) or j > i + 1:  # messages follow: the template's continuation is appended
            ids = ids + renderer.continuation(content, parsed[i + 1 : j], parsed[i])[0]
            whole = renderer.encode(renderer.render(parsed[:j], generation_prompt=True))
        else:  # the last turn: it ends with the template's end of turn
            ids = ids + renderer.encode(renderer.closing(content, parsed[i]))
            whole = renderer.encode(renderer.render(parsed[:j], generation_prompt=False))
        position = next((p for p, (a, b) in enumerate(zip(ids, whole)) if a != b),
                        None if len(ids) == len(whole) else min(len(ids), len(whole)))
        report.turns.append({"turn": turn, "position": position,
                             "appended": _around(tokenizer, ids, position), "whole": _around(tokenizer, whole, position)})
        i, turn = j, turn + 1
    return report


def episode_messages(messages: list[dict], parser: Parser | None) -> list[dict]:
    """`messages` as an episode with `parser` gives them to the template: each assistant message (its content the
    sampled text) as `parsers.assistant_message` builds it, each run of tool messages after it as
    `parsers.tool_messages` does (the k-th answering its k-th call); the others as they are. No parser: all as
    they are."""
    if parser is None:
        return list(messages)
    out, calls, i = [], [], 0
    while i < len(messages):
        m = messages[i]
        if m["role"] == "tool":
            j = next((k for k in range(i, len(messages)) if messages[k]["role"] != "tool"), len(messages))
            out += tool_messages(parser, calls, [t["content"] for t in messages[i:j]])
            i = j
            continue
        if m["role"] == "assistant":
            calls = parser.parse(m["content"])[0]
            m = assistant_message(parser, m["content"], calls)
        out.append(m)
        i += 1
    return out


def shape(messages: list[dict]) -> str:
    """The roles and fields of chat messages, e.g. "[user{content}, assistant{content, tool_calls}]"."""
    return "[" + ", ".join(f"{m.get('role')}{{{', '.join(k for k in m if k != 'role')}}}" for m in messages) + "]"


def _marks(content: str, at: int, pictures: Sequence) -> list[int]:
    """Where the `<image>` marks of a message's content (at `at` in the appended text) are, one per picture;
    ValueError when they do not pair up. A message without pictures has none (`<image>` in it is text)."""
    if not pictures:
        return []
    found = [at + k for k in range(len(content)) if content.startswith(IMAGE_MARK, k)] if at >= 0 else []
    if len(found) != len(pictures):
        raise ValueError(f"a message has {len(found)} {IMAGE_MARK} mark(s) in the template's text and "
                         f"{len(pictures)} picture(s): each picture needs its own mark")
    return found


def _longest_end_within(text: str, within: str) -> int:
    """The length of the longest end of `text` that `within` holds (an end held means a shorter one is)."""
    low, high = 0, len(text)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if text[-mid:] in within else (low, mid - 1)
    return low


def _around(tokenizer, ids: list[int], position: int | None) -> str | None:
    """The text of a few tokens from `position` (None: no difference)."""
    if position is None:
        return None
    return tokenizer.decode(ids[position : position + 8])
