"""tiny-arith: a 1.13M-parameter Qwen2 that knows a little two-digit addition, built offline.

The recipe: a fresh `Qwen2ForCausalLM` (`build_tiny_model`) is trained with supervision on the
arithmetic train pairs ("12+34=" -> "46<eos>", loss on the answer and EOS only) until its greedy
accuracy on the 200 held-out pairs is between `STOP_AT` and `OVERSHOOT` (about 0.3), so an RL run
starts with signal and room to improve. The result is saved once as an ordinary Hugging Face model
directory under `$RLBENCH_CACHE/models/` (default `~/.cache/rlbench`). Deterministic for a seed.
tiny-arith-small is the same recipe with one layer: a smaller student for on-policy distillation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from rlbench.models.arithmetic_data import Pair, answer, arithmetic_split, prompt
from rlbench.models.tokenizer import build_tokenizer
from rlbench.models.warm_start import (build_cached, cache_root, greedy_completions, supervised_warm_start,
                                       text_sft_tensors, torch_threads)

NAME = "tiny-arith"
SMALL_NAME = "tiny-arith-small"
"""The same recipe with one layer instead of two (0.69M parameters): the student of on-policy distillation."""
GRPO_NAME = "tiny-arith-grpo"
"""The quickstart's model after 300 GRPO steps (`rlbench.quickstart.teacher`), the distillation teacher."""
VERSION = 1
"""Part of the cache directory's name: bump it whenever the recipe below changes."""

LR = 3e-4
BATCH_SIZE = 64
EVAL_EVERY = 25
"""Steps between held-out checks (1 after a check overshot)."""
STOP_AT = 0.25
"""Training stops at the first check with held-out accuracy >= STOP_AT ..."""
OVERSHOOT = 0.4
"""... unless it is above OVERSHOOT: then it rolls back to the previous check and checks every step."""
MAX_STEPS = 2000
MAX_NEW_TOKENS = 8


def tiny_config(tokenizer: PreTrainedTokenizerBase, *, max_position_embeddings: int = 64,
                layers: int = 2) -> Qwen2Config:
    """2 layers (or `layers`) of width 192 (6 query heads, 2 KV heads of 32), MLP 768, tied embeddings, fp32.

    Few wide layers because at this size decoding speed is per-layer Python overhead.
    """
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=192,
        intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_tiny_model(seed: int = 0, tokenizer: PreTrainedTokenizerBase | None = None, *,
                     max_position_embeddings: int = 64, layers: int = 2) -> Qwen2ForCausalLM:
    """The untrained tiny model (for `tokenizer`'s vocabulary, default the byte tokenizer); its initialisation
    depends only on `seed` (global RNG untouched)."""
    config = tiny_config(tokenizer or build_tokenizer(), max_position_embeddings=max_position_embeddings,
                         layers=layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def cache_dir(seed: int = 0, name: str = NAME) -> Path:
    """Where the built model (`NAME` or `SMALL_NAME`) for `seed` lives (it may not exist yet)."""
    return cache_root() / f"{name}-v{VERSION}-seed{seed}"


def ensure_built(seed: int = 0, *, shipped: bool = True) -> Path:
    """The model directory for `seed`: shipped with rlbench, or cached and built first if missing (`build_cached`)."""
    return build_cached(cache_dir(seed), lambda: train_tiny_arith(seed), shipped=shipped)


def ensure_built_small(seed: int = 0, *, shipped: bool = True) -> Path:
    """`SMALL_NAME`'s model directory for `seed`: shipped, or cached and built first if missing (`build_cached`)."""
    return build_cached(cache_dir(seed, SMALL_NAME), lambda: train_tiny_arith(seed, layers=1), shipped=shipped)


def train_tiny_arith(seed: int = 0, layers: int = 2) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerBase]:
    """Build and warm-start the model (`layers` layers) in memory (one torch thread, for reproducible numbers)."""
    with torch_threads(1):
        tokenizer = build_tokenizer()
        model = build_tiny_model(seed, layers=layers)
        warm_start(model, tokenizer, seed=seed)
    return model.eval(), tokenizer


def warm_start(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, seed: int,
               name: str | None = None) -> tuple[int, float]:
    """Supervised training on the train pairs until held-out greedy accuracy is in [STOP_AT, OVERSHOOT]; `name`
    shows in the progress bar (default `NAME`, or `SMALL_NAME` for one layer).

    Returns (steps taken, held-out accuracy). A check above OVERSHOOT rolls the model and optimizer
    back to the previous check, and training goes on from there with a check after every step.
    """
    train_pairs, heldout_pairs = arithmetic_split()
    inputs_N_T, labels_N_T = sft_tensors(tokenizer, train_pairs)
    return supervised_warm_start(
        model, inputs_N_T, labels_N_T, lambda m: greedy_accuracy(m, tokenizer, heldout_pairs), seed=seed, lr=LR,
        batch_size=BATCH_SIZE, eval_every=EVAL_EVERY, stop_at=STOP_AT, overshoot=OVERSHOOT, max_steps=MAX_STEPS,
        name=name or (NAME if model.config.num_hidden_layers == 2 else SMALL_NAME))


def sft_tensors(tokenizer: PreTrainedTokenizerBase, pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids_N_T, labels_N_T): prompt + answer + EOS, right-padded; labels -100 except on answer + EOS."""
    return text_sft_tensors(tokenizer, [(prompt(a, b), answer(a, b)) for a, b in pairs])


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[Pair],
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> float:
    """Fraction of `pairs` whose greedy completion is exactly the answer followed by EOS."""
    completions_N_C = greedy_completions(model, tokenizer, [prompt(a, b) for a, b in pairs], max_new_tokens)
    targets = [tokenizer.encode(answer(a, b)) + [tokenizer.eos_token_id] for a, b in pairs]
    return sum(c[: len(t)] == t for c, t in zip(completions_N_C, targets)) / len(pairs)
