"""Prompt lengths: what to do with prompts longer than the session allows.

    check_prompts(task)  # every example has a non-empty prompt
    task = limit_prompt_tokens(task, tokenizer, max_tokens=512, on_long="drop")
    task.dropped    # {"train": 3, "test": 0}
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from rlbench.models.chat import messages_of, render_prompt
from rlbench.models.vision import IMAGE_MARK, Vision, image_size
from rlbench.tasks.base import Task
from rlbench.tasks.data import DataTask


def prompt_tokens(tokenizer, examples: Sequence[dict], vision: Vision | None = None) -> list[int]:
    """Token count of each example's prompt, rendered as the session renders it (`render_prompt`); with a
    vision-language model's `vision`, its images' tokens counted in (`Vision.prompt_tokens`)."""
    if not examples:
        return []
    texts = [render_prompt(tokenizer, e["prompt"]) for e in examples]
    if vision is not None:
        counts = []
        for text, example in zip(texts, examples):
            try:
                counts.append(vision.prompt_tokens(tokenizer, text, example.get("images") or []))
            except (OSError, TypeError, ValueError) as error:  # an image that cannot be read, typed image markup
                raise ValueError(f"the prompt {str(example['prompt'])[:60]!r}{_origin(example)}: {error}") from None
        return counts
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def longest_prompt_tokens(tokenizer, examples: Sequence[dict], *, fits: Callable[[int], bool],
                          vision: Vision | None = None) -> int:
    """Token count of the longest prompt, or an upper bound of it that `fits`: a rendered prompt's UTF-8 byte
    count bounds its token count (every token stands for at least one byte), and rendering is ~100x cheaper
    than tokenizing, so prompts are tokenized only when the bound does not fit. Prompts with images (`vision`:
    counted in) have no such bound: they are counted."""
    if vision is not None and any(e.get("images") for e in examples):
        return max(prompt_tokens(tokenizer, examples, vision), default=0)
    bound = max((len(render_prompt(tokenizer, e["prompt"]).encode()) for e in examples), default=0)
    return bound if fits(bound) else max(prompt_tokens(tokenizer, examples), default=0)


def check_prompts(task: Task, *, takes_images: bool = False) -> None:
    """ValueError naming the split and position of the first example without a usable prompt (no 'prompt'
    field, an empty one, malformed chat messages; images for a model that does not take them (`takes_images`), or
    not one `<image>` mark per image), or saying that the task has no train examples."""
    if not len(task.train):
        raise ValueError(f"task {task.name!r} has no train examples")
    for split_name in ("train", "test"):
        for i, example in enumerate(getattr(task, split_name)):
            try:
                if not isinstance(example, dict) or "prompt" not in example:
                    fields = sorted(example) if isinstance(example, dict) else type(example).__name__
                    raise ValueError(f"no 'prompt' field (has: {fields})")
                messages = messages_of(example["prompt"])
                if example.get("images"):
                    _check_images(example, messages, takes_images)
            except ValueError as error:
                origin = _origin(example) if isinstance(example, dict) else ""
                raise ValueError(f"{split_name} example {i} of task {task.name!r}{origin}: {error}") from None


def check_pictures(task: Task, *, takes_images: bool) -> None:
    """ValueError naming the split and position of the first example whose `images` cannot reach the model (a
    text-only one; a file that is not there or no picture): for an agentic task, whose first messages come from its
    environment (their `<image>` marks are paired with the pictures when an episode starts)."""
    for split_name in ("train", "test"):
        for i, example in enumerate(getattr(task, split_name)):
            if isinstance(example, dict) and example.get("images"):
                try:
                    _check_pictures(example["images"], takes_images)
                except ValueError as error:
                    raise ValueError(f"{split_name} example {i} of task {task.name!r}{_origin(example)}: "
                                     f"{error}") from None


def _check_images(example: dict, messages: list[dict] | None, takes_images: bool) -> None:
    """ValueError if the example's images cannot reach the model: a text-only one (never trained as text alone,
    silently), or `<image>` marks that do not pair up with the images (`rl.models.vision.Vision.encode`)."""
    images = example["images"]
    _check_pictures(images, takes_images)
    text = example["prompt"] if messages is None else "".join(str(m.get("content", "")) for m in messages)
    marks = text.count(IMAGE_MARK)
    if marks not in (0, len(images)):
        raise ValueError(f"its prompt has {marks} {IMAGE_MARK} mark(s) and {len(images)} image(s): each image "
                         f"needs its own mark (or none has one: then the images go before the text)")


def _check_pictures(images: list, takes_images: bool) -> None:
    """ValueError for pictures a text-only model would get, or a file that is not there or is no picture."""
    if not takes_images:
        raise ValueError(f"it has {len(images)} image(s) ('images') and the model is text-only (no vision tower): "
                         f"use a vision-language model (e.g. model='tiny-vl'), or drop the images")
    for image in images:  # a file named but not there, or not a picture: found now, not at its first rollout
        path = image.get("path") if isinstance(image, dict) and not image.get("bytes") else image
        if isinstance(path, (str, os.PathLike)) and not Path(path).is_file():
            raise ValueError(f"its image {str(path)!r} is not a file")
        try:
            image_size(image)  # its header: the pixels are read at the rollout
        except (OSError, TypeError) as error:
            raise ValueError(f"its image {str(path)[:80]!r} cannot be read: {error}") from None


def has_images(task: Task) -> bool:
    """Whether some example of the task carries images."""
    return any(isinstance(e, dict) and e.get("images") for split in (task.train, task.test) for e in split)


def limit_prompt_tokens(task: Task, tokenizer, max_tokens: int | None, *, on_long: str = "error",
                        vision: Vision | None = None) -> Task:
    """`task` itself when every prompt fits in `max_tokens` (or there is no limit; a vision-language model's `vision`:
    its images' tokens counted in); otherwise

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
        lengths = prompt_tokens(tokenizer, examples, vision)
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
