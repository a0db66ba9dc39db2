"""Images in prompts, for vision-language models of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL).

A prompt's text marks where each of its images goes with `<image>` (verl's convention; without a mark the images
go before the text, as Qwen's chat templates put them). `Vision.encode` turns (text, images) into token ids, the
mark replaced by the model's `<|vision_start|>`, one `<|image_pad|>` per merged patch of that image and
`<|vision_end|>`, and the image processor's `pixel_values` and `image_grid_thw`. The image tokens are placed token by
token, never parsed from text, so a prompt's text cannot forge one (a tokenizer that would read typed image markup
as its special token is refused, naming it). `forward_inputs`
gives the model's forward what it needs beside the ids: the pixels, the grids, `mm_token_type_ids`, and the 3-D
rotary positions (M-RoPE) of left- or right-padded rows, computed here so that no state is kept in the model
between calls.

Images are PIL images, paths to image files, or verl parquet's `{"bytes": ..., "path": ...}` records.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

IMAGE_MARK = "<image>"
IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
NEVER_LOGIT = -1e30
"""The logit of a token the policy never draws (`never_sampled`) in the sampler and the trainer: probability 0 exactly
(fp32's exp underflows), and finite after any temperature scaling (the lowest float divided by a temperature below 1
is -inf, which makes an entropy's 0 x z a NaN)."""


@dataclass(frozen=True)
class Vision:
    """What a vision-language model directory says about images: its image processor and its image token ids."""

    processor: Any
    start_id: int
    image_id: int
    end_id: int
    merge_size: int

    @classmethod
    def of(cls, model_dir: str | Path, tokenizer) -> Vision | None:
        """The model's Vision, or None for a text-only model (its config.json has no `vision_config`)."""
        if not has_vision(model_dir):
            return None
        config = json.loads((Path(model_dir) / "config.json").read_text())
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        ids = tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS))
        if tokenizer.unk_token_id in ids or None in ids:
            missing = [t for t, i in zip(IMAGE_TOKENS, ids) if i in (None, tokenizer.unk_token_id)]
            raise ValueError(f"the tokenizer of {model_dir} has no {', '.join(missing)} token: it cannot mark images")
        if config.get("image_token_id", ids[1]) != ids[1]:
            raise ValueError(f"{model_dir}: config.json's image_token_id {config['image_token_id']} is not the "
                             f"tokenizer's <|image_pad|> ({ids[1]})")
        return cls(processor, *ids, merge_size=config["vision_config"].get("spatial_merge_size", 2))

    def encode(self, tokenizer, text: str, images: Sequence) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(ids, {"pixel_values", "image_grid_thw"}) of a prompt's text and its images (see the module docstring).
        ValueError when the text has more `<image>` marks than images, or images are left over."""
        if IMAGE_MARK not in text:
            text = IMAGE_MARK * len(images) + text
        parts = text.split(IMAGE_MARK)
        if len(parts) - 1 != len(images):
            raise ValueError(f"the prompt has {len(parts) - 1} {IMAGE_MARK} mark(s) and {len(images)} image(s): each "
                             f"image needs its own mark (or none has one: then the images go before the text)")
        if not images:
            return self._text(tokenizer, text), {}
        pixels = self.pixels(images)
        ids = self._text(tokenizer, parts[0])
        for part, run in zip(parts[1:], self.image_runs(pixels)):
            ids += run + self._text(tokenizer, part)
        return ids, pixels

    def pixels(self, images: Sequence) -> dict[str, torch.Tensor]:
        """{"pixel_values", "image_grid_thw"} of images (PIL images, paths or records), as the processor makes them."""
        pixels = self.processor(images=[load_image(image) for image in images], return_tensors="pt")
        return {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}

    def image_runs(self, pixels: dict[str, torch.Tensor]) -> list[list[int]]:
        """Each image's tokens in a context: `<|vision_start|>`, one `<|image_pad|>` per merged patch of its grid,
        `<|vision_end|>`."""
        return [[self.start_id] + [self.image_id] * (t * h * w // self.merge_size**2) + [self.end_id]
                for t, h, w in pixels["image_grid_thw"].tolist()]

    def prompt_tokens(self, tokenizer, text: str, images: Sequence) -> int:
        """How many tokens `encode` gives the prompt, without processing a pixel: its text's, and each image's from
        the image's size alone (the processor's resize rule; of a file only the header is read)."""
        if IMAGE_MARK not in text:
            text = IMAGE_MARK * len(images) + text
        parts = text.split(IMAGE_MARK)
        return sum(len(self._text(tokenizer, part)) for part in parts) + sum(
            self.image_tokens(image) for image in images)

    def image_tokens(self, image) -> int:
        """The tokens one image takes in a prompt: `<|vision_start|>`, one `<|image_pad|>` per merged patch,
        `<|vision_end|>`."""
        width, height = image_size(image)
        return self.processor.get_number_of_image_patches(height, width, {}) // self.merge_size**2 + 2

    def _text(self, tokenizer, text: str) -> list[int]:
        """The ids of a stretch of text; ValueError where the tokenizer reads an image token in it (`refuse_markup`)."""
        return self.refuse_markup(tokenizer, tokenizer.encode(text, add_special_tokens=False))

    def refuse_markup(self, tokenizer, ids: list[int]) -> list[int]:
        """`ids`, tokens of text; ValueError where they hold an image token (a tokenizer that parses special tokens
        in text, as Qwen's does, would take typed "<|image_pad|>" for an image slot that has no pixels)."""
        typed = sorted({tokenizer.convert_ids_to_tokens(i) for i in ids if i in (self.start_id, self.image_id,
                                                                                  self.end_id)})
        if typed:
            raise ValueError(f"the text holds {', '.join(typed)} as typed text, which this tokenizer reads as "
                             f"image markup: mark an image's place with {IMAGE_MARK} instead")
        return ids


def has_vision(model_dir: str | Path) -> bool:
    """Whether the model in `model_dir` takes images (its config.json has a `vision_config`)."""
    return "vision_config" in json.loads((Path(model_dir) / "config.json").read_text())


def has_vision_tower(model) -> bool:
    """Whether a loaded model takes images (its config has a `vision_config`)."""
    return getattr(model.config, "vision_config", None) is not None


VISION_TOWER = "visual"
"""The vision tower's module name in the Qwen2-VL family (`model.visual`: its patch embedding, blocks and merger)."""


def vision_tower(model) -> torch.nn.Module | None:
    """A loaded vision-language model's vision tower (also inside a peft wrapper), or None for a text model."""
    if not has_vision_tower(model):
        return None
    towers = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == VISION_TOWER]
    if len(towers) != 1:
        raise ValueError(f"{type(model).__name__} has {len(towers)} modules named {VISION_TOWER!r}: expected its one "
                         f"vision tower (a model of the Qwen2-VL family)")
    return towers[0]


def never_sampled(model) -> list[int]:
    """The token ids a vision-language model's policy never draws: its image markup (`<|vision_start|>`,
    `<|image_pad|>`, `<|vision_end|>`, and the video ones where it has them). They stand for pixels only in a
    prompt; drawn in a response they would be text, and a forward with images would take them for more image slots.
    The sampler and the trainer both leave them out of the distribution (their logits are `NEVER_LOGIT`), so
    that the two agree exactly. [] for a text model."""
    return never_sampled_ids(model.config)


def never_sampled_ids(config) -> list[int]:
    """`never_sampled`'s ids from a model's config (a transformers `PretrainedConfig`; [] without a `vision_config`):
    what the vLLM sampler, which holds no transformers model, reads them from."""
    if getattr(config, "vision_config", None) is None:
        return []
    names = ("image_token_id", "vision_start_token_id", "vision_end_token_id", "video_token_id")
    vocab = config.get_text_config().vocab_size  # (a default id past it is no token of this model)
    return sorted({i for i in (getattr(config, name, None) for name in names) if i is not None and i < vocab})


def forward_inputs(model, ids_B_T: torch.Tensor, mask_B_T: torch.Tensor,
                   images: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The keyword arguments of a vision-language `model`'s forward for rows `ids_B_T` (padding 0 in `mask_B_T`, on
    either side) whose images are `images` (per row, `Vision.encode`'s dict; empty for a row without images), beside
    input_ids and attention_mask: `image_inputs`, and the 3-D rotary positions (M-RoPE), computed here so that the
    model keeps no state between calls. {} when no row has an image."""
    inputs = image_inputs(model, ids_B_T, images)
    if inputs:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # (a LoRA policy: peft's wrapper)
        inputs["position_ids"], _ = base.model.get_rope_index(
            ids_B_T, image_grid_thw=inputs["image_grid_thw"], attention_mask=mask_B_T,
            mm_token_type_ids=inputs["mm_token_type_ids"])
    return inputs


def image_inputs(model, ids_B_T: torch.Tensor, images: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The pixels and grids of `images` (`Vision.encode`'s dicts, empty ones skipped), in the order their image tokens
    come in `ids_B_T` read row by row, and `mm_token_type_ids` (1 at the image tokens); {} without images."""
    pixels = joined(images)
    if not pixels:
        return {}
    return {"pixel_values": pixels["pixel_values"].to(ids_B_T.device, model.dtype),
            "image_grid_thw": pixels["image_grid_thw"].to(ids_B_T.device),
            "mm_token_type_ids": (ids_B_T == model.config.image_token_id).int()}


def joined(images: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One context's pictures as one dict (`Vision.encode`'s, empty ones skipped) in their order: what a sampler and
    the trainer take per row. {} without any."""
    given = [entry for entry in images if entry]
    if len(given) <= 1:
        return given[0] if given else {}
    return {key: torch.cat([entry[key] for entry in given]) for key in ("pixel_values", "image_grid_thw")}


def content_of(value) -> tuple[str, list]:
    """(text, pictures) of a message's value: a text as it is; a PIL image as an `<image>` mark and the image; a list
    or tuple of texts and PIL images as its texts joined, each image's place marked `<image>`. Anything else: its
    `str`."""
    from PIL import Image

    if not has_pictures(value):
        return str(value), []
    parts = [value] if isinstance(value, Image.Image) else value
    return ("".join(IMAGE_MARK if isinstance(part, Image.Image) else str(part) for part in parts),
            [part for part in parts if isinstance(part, Image.Image)])


def has_pictures(value) -> bool:
    """Whether a message's value holds PIL images: is one, or is a list or tuple with one among its items."""
    from PIL import Image

    return isinstance(value, Image.Image) or (isinstance(value, (list, tuple))
                                              and any(isinstance(item, Image.Image) for item in value))


def same_images(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two prompts' images (`Vision.encode`'s dicts) are the same pictures."""
    if a is b or (not a and not b):
        return True
    return bool(a) and bool(b) and torch.equal(a["image_grid_thw"], b["image_grid_thw"]) and torch.equal(
        a["pixel_values"], b["pixel_values"])


def image_size(image) -> tuple[int, int]:
    """(width, height) of a PIL image, a path or a `{"bytes", "path"}` record, reading a file's header only."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.size
    with _opened(image) as opened:  # lazy: the pixels are not decoded
        return opened.size


def load_image(image):
    """An RGB PIL image from a PIL image, a path, or a `{"bytes": ..., "path": ...}` record (verl's parquet)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")  # loaded once: no copy when encoded again
    with _opened(image) as opened:
        return opened.convert("RGB")


def _opened(image):
    """The file behind a path or a `{"bytes", "path"}` record, opened (not decoded) by PIL."""
    from PIL import Image

    source = io.BytesIO(image["bytes"]) if isinstance(image, dict) and image.get("bytes") else (
        image.get("path") if isinstance(image, dict) else image)
    if not isinstance(source, (str, Path, io.BytesIO)):
        raise TypeError(f"an image is a PIL image, a path or a {{'bytes', 'path'}} record, not {type(image).__name__}")
    return Image.open(source)
