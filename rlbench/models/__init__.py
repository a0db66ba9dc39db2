"""Models: the built-in offline tiny models, loading of local Hugging Face model directories, and LoRA adapters
(`lora.py`: their shape, deltas, merge and peft folder).

Nothing here touches the network: a built-in name's seed 0 ships with rlbench (rlbench/models/weights/, the same
bytes on every machine; `python -m rlbench.models.build NAME` is the recipe that made it), another seed is built on
this machine (once, then cached), and everything is loaded with `local_files_only=True`.

    path = rlbench.models.resolve("tiny-arith")          # .../rlbench/models/weights/tiny-arith-v1-seed0
    model, tokenizer = rlbench.models.load("tiny-arith")  # or load("/path/to/hf/checkpoint")
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from rlbench.models import tiny_arith, tiny_mix, tiny_moe, tiny_tools, tiny_vl, vision
from rlbench.models.arithmetic_data import arithmetic_split
from rlbench.models.checks import (check_fits, check_same_tokenizer, check_tokenizer_files, check_weights, dropout_fields,
                                   prompt_room)
from rlbench.models.tiny_arith import build_tiny_model
from rlbench.models.tokenizer import build_tokenizer, readable_decode

__all__ = ["arithmetic_split", "build_tiny_model", "build_tokenizer", "builder", "check_fits", "check_same_tokenizer", "dropout_fields",
           "prompt_room", "from_pretrained", "load", "load_tokenizer", "names", "quiet_transformers", "readable_decode", "register",
           "resolve"]

_BUILTINS: dict[str, Callable[[int], Path] | str] = {tiny_arith.NAME: tiny_arith.ensure_built,
                                                      tiny_arith.SMALL_NAME: tiny_arith.ensure_built_small,
                                                      tiny_mix.NAME: tiny_mix.ensure_built,
                                                      tiny_moe.NAME: tiny_moe.ensure_built,
                                                      tiny_tools.NAME: tiny_tools.ensure_built,
                                                      tiny_vl.NAME: tiny_vl.ensure_built,
                                                      tiny_arith.GRPO_NAME: "rlbench.quickstart:teacher"}
"""Built-in model name -> function of the seed returning its directory (shipped, or cached and built on demand;
`shipped=False` builds it whatever ships), or where that function lives (`"module:function"`) when an RL run of the
layers above builds it (tiny-arith-grpo, the quickstart's trained model): that module is imported when the name is
first resolved, so importing rlbench imports no top-floor module."""


def register(name: str, build: Callable[[int], Path] | str) -> None:
    """Add a built-in model: `build(seed)` returns its cached directory, building it first if missing; or
    `build` names that function as `"module:function"`, imported when the name is first resolved. A name is taken
    once (registering the same builder again is a no-op)."""
    if _BUILTINS.get(name, build) != build:
        raise ValueError(f"built-in model {name!r} is already registered; pick another name")
    _BUILTINS[name] = build


def builder(name: str) -> Callable[[int], Path]:
    """The build function of the built-in model `name` (importing its module first if it is named by a string)."""
    build = _BUILTINS[name]
    if isinstance(build, str):
        module, _, function = build.partition(":")
        build = getattr(importlib.import_module(module), function)
    return build


def names() -> list[str]:
    """The built-in model names."""
    return list(_BUILTINS)


def resolve(model: str | os.PathLike, *, seed: int = 0) -> Path:
    """A built-in name -> its shipped directory (seed 0), or its cached one (built if missing); a local HF model
    directory -> itself.

    `seed` selects the built-in's build (ignored for directories). Raises ValueError otherwise.
    """
    if isinstance(model, str) and model in _BUILTINS:
        return builder(model)(seed)
    check(model)
    return Path(model).expanduser()


def check(model: str | os.PathLike) -> None:
    """ValueError (the one `resolve` raises) when `model` is neither a built-in name nor a local Hugging Face model
    directory; builds and loads nothing."""
    if isinstance(model, str) and model in _BUILTINS:
        return
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        problem = "has no config.json" if path.is_dir() else "does not exist"
        raise ValueError(f"model {str(model)!r} is not a built-in model ({', '.join(names())}) "
                         f"nor a local Hugging Face model directory: {path} {problem}")


def load(
    model: str | os.PathLike, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(causal LM in eval mode, tokenizer) for a built-in name or a local HF model directory (a vision-language
    one: its image-text-to-text model, see `from_pretrained`)."""
    path = resolve(model, seed=seed)
    tokenizer = load_tokenizer(path)
    return from_pretrained(AutoModelForCausalLM, path, dtype=dtype).eval(), tokenizer


def load_tokenizer(model: str | os.PathLike, *, seed: int = 0) -> PreTrainedTokenizerBase:
    """The tokenizer of a built-in name or local HF model directory; it must have EOS and pad tokens."""
    path = resolve(model, seed=seed)
    check_tokenizer_files(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    for token in ("eos", "pad"):
        if getattr(tokenizer, f"{token}_token_id") is None:
            raise ValueError(
                f"the tokenizer of {path} has no {token} token (rlbench needs eos_token_id and pad_token_id)"
            )
    return tokenizer


def from_pretrained(auto_class, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, **kwargs):
    """`auto_class.from_pretrained` from local files only, without transformers' per-tensor progress bar.
    AutoModelForCausalLM of a vision-language folder (Qwen2-VL's, whose config has a `vision_config`) loads its
    image-text-to-text model: the language model with its vision tower, which takes images (`models.vision`).

    A folder without weights, or with a truncated or corrupt safetensors file, is a ValueError naming it."""
    check_weights(path)
    if auto_class is AutoModelForCausalLM:
        auto_class = causal_lm_class(path)
    with quiet_transformers():  # e.g. a critic's value head is new by design: no load report
        return auto_class.from_pretrained(path, local_files_only=True, dtype=dtype, **kwargs)


def causal_lm_class(path: str | os.PathLike):
    """The transformers class of a folder's model as a policy: AutoModelForCausalLM, or for a vision-language folder
    (its config has a `vision_config`) AutoModelForImageTextToText, the language model with its vision tower."""
    if vision.has_vision(path):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


@contextmanager
def quiet_transformers():
    """No progress bars and only errors from transformers inside the block (loading and saving tiny models)."""
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
