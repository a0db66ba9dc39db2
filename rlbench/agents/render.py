"""Rendering a conversation as the sampler sees it: append-only token ids, and the check that a template is.

An episode's context grows by appending: the sampled tokens of a turn stay exactly as sampled, then the tokens
of the new messages (tool results, observations) and the next generation prompt are appended. Nothing already
in the context is re-tokenized or re-rendered (chat templates are not always append-only: some drop earlier
reasoning blocks or rewrite turn separators, and a trainer fed the re-rendered tokens learns on tokens nobody
sampled).

What to append comes from the template itself, rendered around a fixed reference conversation: the text it puts
after an assistant message's content (`end_of_turn`: e.g. "<|im_end|>\\n"), minus whatever the sampled turn
already ended with, then the text it renders for the new messages and the generation prompt. `check_template`
says whether this equals rendering the conversation whole, turn by turn.

Without a chat template, messages render plainly as "role: content" lines and "assistant:" for the reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlbench.models.chat import has_chat_template

PROBE = "rlbench-probe-3f9a"
"""The assistant content of the reference conversation (text no template writes by itself)."""
KINDS = ("template", "sampled", "tool")
"""What each token of an episode is (its code is the index): written by the chat template, sampled by the
policy (the only trainable kind), or the content of a tool result / observation."""


class Renderer:
    """A tokenizer's chat template (with the tools declared) as prompt ids and append-only continuations."""

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools or None
        self._reference = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PROBE}]
        self._reference_text = self.render(self._reference, generation_prompt=False)
        self.end_of_turn = self._reference_text[self._reference_text.rindex(PROBE) + len(PROBE):]
        """What the template writes after an assistant message's content (e.g. "<|im_end|>\\n")."""

    def render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        """The conversation as text, whole, ending with the assistant's generation prompt if asked."""
        if has_chat_template(self.tokenizer):
            return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first context of an episode: its messages and the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def continuation(self, sampled_text: str, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(token ids, their kinds) to append after an assistant turn that sampled `sampled_text`: the rest of
        the template's end of turn, `messages` (tool results, observations) and the next generation prompt."""
        closing = self.end_of_turn
        for k in range(len(closing), 0, -1):  # the part of the end of turn the model already sampled (an EOS)
            if sampled_text.endswith(closing[:k]):
                closing = closing[k:]
                break
        text = closing + self._rendered(list(messages))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans, start = [], len(closing)
        for m in messages:  # where each message's content sits in the appended text
            at = text.find(m["content"], start) if m["content"] else -1
            if at >= 0:
                spans.append((at, at + len(m["content"])))
                start = at + len(m["content"])
        kinds = [KINDS.index("tool") if any(a < e and b > s for s, e in spans) else KINDS.index("template")
                 for a, b in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), kinds

    def _rendered(self, messages: list[dict]) -> str:
        """The template's text for `messages` and the generation prompt, after an assistant turn; where the
        template rewrites an earlier assistant message once more follow, after a user message alone (the new
        messages' own text: earlier tokens are never rewritten)."""
        for before in (self._reference, self._reference[:1]):
            head = self.render(before, generation_prompt=False)
            after = self.render(before + messages, generation_prompt=True)
            if after.startswith(head):
                return after[len(head):]
        raise ValueError("this chat template renders a user message differently once more messages follow: "
                         "rlbench cannot append messages to a conversation with it")


@dataclass
class TemplateReport:
    """What `check_template` found: per assistant turn, the first token where appending differs from the
    whole render (None where they agree)."""

    turns: list[dict] = field(default_factory=list)
    """One dict per turn: {"turn", "position", "appended", "whole"} (position None: no difference)."""

    @property
    def ok(self) -> bool:
        return all(t["position"] is None for t in self.turns)

    def __str__(self) -> str:
        if self.ok:
            return f"template is append-only over {len(self.turns)} turns"
        lines = ["template is NOT append-only: the tokens a sampler appends differ from rendering the "
                 "conversation whole"]
        for t in self.turns:
            if t["position"] is not None:
                lines.append(f"  turn {t['turn']}: first difference at token {t['position']}: appended "
                             f"{t['appended']!r}, whole {t['whole']!r}")
        return "\n".join(lines)

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


def check_template(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> TemplateReport:
    """Render `messages` turn by turn as a sampler sees them (the first prompt, each assistant message's content
    as its sampled tokens, the template's continuations appended) and whole, and report the first differing
    token of each assistant turn (the whole render of the conversation up to and including that turn's
    continuation is the reference).

    `messages` needs at least one assistant message after the first user turn. The session runs this on its
    task's first example at start-up and warns with the report when it fails.
    """
    try:
        messages = chat_messages(messages)
    except ValueError as error:
        raise ValueError(f"check_template: {error}") from None
    renderer = Renderer(tokenizer, tools)
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if not first:
        raise ValueError("check_template needs a conversation with an assistant message after the first turn")
    ids = renderer.prompt_ids(messages[:first])
    report = TemplateReport()
    i, turn = first, 0
    while i < len(messages):
        content = messages[i]["content"]
        j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
        ids = ids + renderer.encode(content)
        if j < len(messages) or j > i + 1:  # messages follow: the template's continuation is appended
            ids = ids + renderer.continuation(content, messages[i + 1 : j])[0]
            whole = renderer.encode(renderer.render(messages[:j], generation_prompt=True))
        else:  # the last turn: it ends with the template's end of turn
            ids = ids + renderer.encode(renderer.end_of_turn)
            whole = renderer.encode(renderer.render(messages[:j], generation_prompt=False))
        position = next((p for p, (a, b) in enumerate(zip(ids, whole)) if a != b),
                        None if len(ids) == len(whole) else min(len(ids), len(whole)))
        report.turns.append({"turn": turn, "position": position,
                             "appended": _around(tokenizer, ids, position), "whole": _around(tokenizer, whole, position)})
        i, turn = j, turn + 1
    return report


def _around(tokenizer, ids: list[int], position: int | None) -> str | None:
    """The text of a few tokens from `position` (None: no difference)."""
    if position is None:
        return None
    return tokenizer.decode(ids[position : position + 8])
