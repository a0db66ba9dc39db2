"""Prompts as text and token ids: a tokenizer's chat template when it has one, else a plain rendering.

A prompt is a string (used as is) or a list of chat messages (dicts with "role" and "content", verl's
`prompt` column). Without a chat template (the built-in tiny models have none) messages render plainly:

- one user message renders as its content alone, so `[{"role": "user", "content": "12+34="}]` is "12+34=";
- any other conversation renders one "role: content" line per message, then "assistant:" for the reply:
  "system: Be brief.\\nuser: 12+34=\\nassistant:".

It lives in the ground floor because tasks (prompt lengths) and rewards (reward models, judges) both need it.
"""

from __future__ import annotations


def messages_of(prompt) -> list[dict] | None:
    """The prompt's chat messages (validated), or None for a string prompt."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"an empty prompt ({prompt!r})")
        return None
    if not isinstance(prompt, (list, tuple)) and type(prompt).__name__ != "ndarray":  # parquet lists: ndarray
        raise ValueError(f"a prompt is a string or a list of chat messages, got {type(prompt).__name__}")
    messages = list(prompt)
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"a chat message needs string 'role' and 'content', got {m!r:.200}")
    if not messages:
        raise ValueError("a prompt needs at least one chat message")
    return messages


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, prompt) -> str:
    """The prompt's text, ready for the model to continue (the module docstring gives the rules)."""
    messages = messages_of(prompt)
    if messages is None:
        return prompt
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def render_conversation(tokenizer, prompt, completion: str) -> str:
    """Prompt and completion as one text (what a reward model reads): the chat template over the messages
    plus an assistant message when there is one, else `render_prompt(...) + completion`."""
    messages = messages_of(prompt)
    if messages is not None and has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}],
                                             tokenize=False)
    return render_prompt(tokenizer, prompt) + completion


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of `render_prompt(tokenizer, prompt)`, adding no special tokens (a template writes its own)."""
    return list(tokenizer.encode(render_prompt(tokenizer, prompt), add_special_tokens=False))
