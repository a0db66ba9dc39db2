"""Start-up checks on a model folder, each a ValueError naming the folder or file, the numbers and the fix
(instead of a library error at load time, or `IndexError: index out of range in self` at the first rollout).

    check_tokenizer_files(model_dir)   # before AutoTokenizer: some tokenizer file is there
    check_weights(model_dir)           # before from_pretrained: the weights files are whole
    check_fits(model_dir, tokenizer, max_prompt_tokens=None, max_new_tokens=256, longest_prompt_tokens=40)
    dropout_fields(config)             # {"attn_pdrop": 0.1, ...}: the dropout a trainer would run with
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A folder with none of these has no tokenizer that AutoTokenizer could load."""

WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
"""What `from_pretrained` loads weights from, in its order of preference (an index lists shards)."""

CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length",
                  "max_sequence_length", "max_seq_length", "seq_len")
"""Config fields that bound a sequence's length (GPT-2 has n_positions and n_ctx; the smallest wins, as in vLLM)."""


def check_tokenizer_files(model_dir: str | os.PathLike) -> None:
    """ValueError naming the folder when it has none of `TOKENIZER_FILES`."""
    folder = Path(model_dir)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"the model folder {folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
                         "save the tokenizer the model was trained with there (`tokenizer.save_pretrained(folder)`)")


def check_same_tokenizer(tokenizer: PreTrainedTokenizerBase, other: PreTrainedTokenizerBase, other_dir, role: str) -> None:
    """ValueError naming the first token id where `other` (the `role` model's tokenizer, in `other_dir`) and
    `tokenizer` (the policy's) differ: the two models must read the same ids as the same text."""
    if tokenizer.get_vocab() == other.get_vocab():
        return
    ours, theirs = (t.convert_ids_to_tokens(list(range(len(t)))) for t in (tokenizer, other))
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    token = lambda tokens: repr(tokens[first]) if first < len(tokens) else "nothing (its vocabulary ends before)"
    raise ValueError(f"the {role} in {other_dir} has another tokenizer than the policy's: token id {first} is "
                     f"{token(theirs)} there and {token(ours)} in the policy's ({len(theirs)} and {len(ours)} tokens). "
                     f"The {role} scores the policy's token ids: use a {role} trained with the policy's tokenizer")


def check_weights(model_dir: str | os.PathLike) -> None:
    """ValueError naming the folder when it has no weights file, or naming the safetensors file that does not
    open (a truncated or corrupt copy: its header, or its length against the header's). Reads headers only."""
    folder = Path(model_dir)
    found = next((folder / name for name in WEIGHTS_FILES if (folder / name).is_file()), None)
    if found is None:
        raise ValueError(f"the model folder {folder} has no weights file (none of {', '.join(WEIGHTS_FILES)}): "
                         "save the model there (`model.save_pretrained(folder)`)")
    if found.name == "model.safetensors.index.json":
        for shard in _shards(found):
            if not shard.is_file():
                raise ValueError(f"{shard} is missing (listed in {found}): copy it again from the original model")
            _check_safetensors(shard)
    elif found.suffix == ".safetensors":
        _check_safetensors(found)


def _shards(index: Path) -> list[Path]:
    """The shard files a `*.safetensors.index.json` maps weights to."""
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{index} is not a weights index (JSON with a 'weight_map'): {error}; copy it again "
                         "from the original model") from error
    return [index.parent / name for name in names]


def _check_safetensors(file: Path) -> None:
    """Opening checks the header, and the file's length against the tensors' offsets it lists."""
    try:
        with safe_open(file, framework="pt"):
            pass
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file} is truncated or corrupt ({file.stat().st_size} bytes; safetensors: {error}): "
                         "copy or download it again") from error


def text_config(model_dir: str | os.PathLike) -> PretrainedConfig:
    """The config of the model's text decoder: the whole config, or its `text_config` (multimodal models)."""
    return AutoConfig.from_pretrained(model_dir, local_files_only=True).get_text_config(decoder=True)


def context_length(config: PretrainedConfig) -> tuple[str, int] | None:
    """(field, value) of the config's tightest `CONTEXT_FIELDS` limit, None when it has none. The field is
    named as config.json spells it (GPT-2's max_position_embeddings is an alias of n_positions)."""
    limits = {config.attribute_map.get(name, name): value for name in CONTEXT_FIELDS
              if isinstance(value := getattr(config, name, None), int) and value > 0}
    return min(limits.items(), key=lambda limit: limit[1], default=None)


def prompt_room(model_dir: str | os.PathLike, max_new_tokens: int) -> int | None:
    """Tokens left for a prompt in the model's context after `max_new_tokens` (None: no limit)."""
    limit = context_length(text_config(model_dir))
    return None if limit is None else limit[1] - max_new_tokens


def check_fits(model_dir: str | os.PathLike, tokenizer: PreTrainedTokenizerBase, *, max_prompt_tokens: int | None,
               max_new_tokens: int, longest_prompt_tokens: int | None = None) -> None:
    """ValueError when the model in `model_dir` cannot take what the session will feed it:

    - a vocabulary (`vocab_size`) smaller than the tokenizer's (`len(tokenizer)`): some ids would index past
      the embedding;
    - a context (`context_length`) shorter than the longest prompt plus `max_new_tokens`. The longest prompt
      is `max_prompt_tokens` when set (longer ones were refused or dropped), else `longest_prompt_tokens`
      as the caller measured it (None: not known, only `max_new_tokens` is checked).
    """
    config = text_config(model_dir)
    vocab_size = getattr(config, "vocab_size", None)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(
            f"the model in {model_dir} has a vocabulary of {vocab_size} ids (config.json vocab_size) but its "
            f"tokenizer has {len(tokenizer)}: ids {vocab_size} and up would index past the embedding. Use the "
            "tokenizer the model was trained with, or grow the model's embedding "
            "(`model.resize_token_embeddings(len(tokenizer))`) and save it again")
    limit = context_length(config)
    prompt_tokens = max_prompt_tokens if max_prompt_tokens is not None else longest_prompt_tokens
    if limit is not None and (prompt_tokens or 0) + max_new_tokens > limit[1]:
        raise ValueError(_context_message(model_dir, limit, max_new_tokens, prompt_tokens,
                                          limited=max_prompt_tokens is not None))


def _context_message(model_dir, limit: tuple[str, int], max_new_tokens: int, prompt_tokens: int | None, *,
                     limited: bool) -> str:
    """What does not fit in `limit` and how to make it fit; `limited`: prompt_tokens is max_prompt_tokens."""
    field, positions = limit
    if prompt_tokens is None:
        what, fixes = f"max_new_tokens={max_new_tokens} is", [f"lower max_new_tokens to {positions}"]
    else:
        prompt = f"max_prompt_tokens={prompt_tokens}" if limited else f"the longest prompt ({prompt_tokens} tokens)"
        what = f"{prompt} + max_new_tokens={max_new_tokens} = {prompt_tokens + max_new_tokens} tokens is"
        fixes = [f"lower max_new_tokens to {positions - prompt_tokens}"] if prompt_tokens < positions else []
        fixes.append("lower max_prompt_tokens" if limited else
                     "set max_prompt_tokens with long_prompts='drop' to leave long prompts out")
    return (f"{what} over the {positions} positions of the model in {model_dir} (config.json {field}): "
            f"{' or '.join(fixes)}, so that prompt and completion fit in {positions}")


def dropout_fields(config: PretrainedConfig) -> dict[str, float]:
    """The config's non-zero dropout probabilities, by field: every field whose name contains "dropout" or
    "pdrop" (GPT-2's attn_pdrop, embd_pdrop, resid_pdrop; Qwen2's attention_dropout...). A sub-config's
    fields are named by their path, e.g. "text_config.attention_dropout"."""
    return dict(_dropout_items(config))


def _dropout_items(config: PretrainedConfig, prefix: str = ""):
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            yield from _dropout_items(value, f"{prefix}{name}.")
        elif ("dropout" in name or "pdrop" in name) and type(value) in (int, float) and value != 0:
            yield f"{prefix}{name}", float(value)
