"""Prompt lengths: what to do with prompts longer than the session allows.

    check_prompts(task)  # every example has a non-empty prompt
    task = limit_prompt_tokens(task, tokenizer, max_tokens=512, on_long="drop")
    task.dropped    # {"train": 3, "test": 0}
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

from rlbench.models.chat import messages_of, render_prompt
from rlbench.tasks.base import Task
from rlbench.tasks.data import DataTask


def prompt_tokens(tokenizer, examples: Sequence[dict]) -> list[int]:
    """Token count of each example's prompt, rendered as the session renders it (`render_prompt`)."""
    if not examples:
        return []
    texts = [render_prompt(tokenizer, e["prompt"]) for e in examples]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def longest_prompt_tokens(tokenizer, examples: Sequence[dict], *, fits: Callable[[int], bool]) -> int:
    """Token count of the longest prompt, or an upper bound of it that `fits`: a rendered prompt's UTF-8 byte
    count bounds its token count (every token stands for at least one byte), and rendering is ~100x cheaper
    than tokenizing, so prompts are tokenized only when the bound does not fit."""
    bound = max((len(render_prompt(tokenizer, e["prompt"]).encode()) for e in examples), default=0)
    return bound if fits(bound) else max(prompt_tokens(tokenizer, examples), default=0)


def check_prompts(task: Task) -> None:
    """ValueError naming the split and position of the first example without a usable prompt (no 'prompt'
    field, an empty one, malformed chat messages, images), or saying that the task has no train examples."""
    if not len(task.train):
        raise ValueError(f"task {task.name!r} has no train examples")
    for split_name in ("train", "test"):
        for i, example in enumerate(getattr(task, split_name)):
            try:
                if not isinstance(example, dict) or "prompt" not in example:
                    fields = sorted(example) if isinstance(example, dict) else type(example).__name__
                    raise ValueError(f"no 'prompt' field (has: {fields})")
                messages_of(example["prompt"])
                if example.get("images"):  # never trained as text alone, silently
                    raise ValueError("it carries images ('images'), and a session does not pass images to the model "
                                     "yet (rlbench.models.vision encodes them; the loop does not take them): its "
                                     "prompt would be trained as text alone")
            except ValueError as error:
                origin = _origin(example) if isinstance(example, dict) else ""
                raise ValueError(f"{split_name} example {i} of task {task.name!r}{origin}: {error}") from None


def limit_prompt_tokens(task: Task, tokenizer, max_tokens: int | None, *, on_long: str = "error") -> Task:
    """`task` itself when every prompt fits in `max_tokens` (or there is no limit); otherwise

    - on_long="error": ValueError naming the first too-long example (split, position, length, data source);
    - on_long="drop": a `DataTask` without them, with the count per split in `.dropped` (and a warning).
    """
    if on_long not in ("error", "drop"):
        raise ValueError(f"on_long must be 'error' or 'drop', got {on_long!r}")
    if max_tokens is None:
        return task
    kept, dropped = {}, {}
    for split_name in ("train", "test"):
        examples = list(getattr(task, split_name))
        lengths = prompt_tokens(tokenizer, examples)
        too_long = [i for i, n in enumerate(lengths) if n > max_tokens]
        if too_long and on_long == "error":
            i = too_long[0]
            raise ValueError(f"{split_name} example {i} of task {task.name!r}{_origin(examples[i])} has a "
                             f"{lengths[i]}-token prompt, over max_prompt_tokens={max_tokens} ({len(too_long)} "
                             f"{split_name} prompts are); raise the limit or drop them (long_prompts='drop')")
        skip = set(too_long)
        kept[split_name] = tuple(e for i, e in enumerate(examples) if i not in skip)
        dropped[split_name] = len(too_long)
    if not any(dropped.values()):
        return task
    warnings.warn(f"task {task.name!r}: dropped {dropped['train']} train and {dropped['test']} test prompts "
                  f"longer than {max_tokens} tokens", stacklevel=2)
    return DataTask(name=task.name, train=kept["train"], test=kept["test"], reward=task.reward,
                    truncated_reward=task.truncated_reward, dropped=dropped)


def _origin(example: dict) -> str:
    """" (data_source openai/gsm8k, index 17)" from what the example says about itself."""
    parts = [f"data_source {example['data_source']}"] if "data_source" in example else []
    index = (example.get("extra_info") or {}).get("index")
    parts += [f"index {index}"] if index is not None else []
    return f" ({', '.join(parts)})" if parts else ""
