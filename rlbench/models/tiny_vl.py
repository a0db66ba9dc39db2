"""tiny-vl: a Qwen2-VL model small enough to train on a CPU, warm-started on the "shapes" task.

The recipe: the byte-level tiny tokenizer plus Qwen's `<|vision_start|>`, `<|image_pad|>` and `<|vision_end|>` (special
tokens: typed as text they stay text); Qwen2-VL's image processor at 8-pixel patches, so that a 64 x 64 picture is
8 x 8 patches, merged 2 x 2 into 16 image tokens; a fresh `Qwen2VLForConditionalGeneration` with a one-block vision
tower (`build_model`), trained with supervision on the task's training pictures (loss on the answer and EOS) until
greedy held-out accuracy is between `STOP_AT` and `OVERSHOOT`: well above what answering blind gives (0.145) and
what it answers of blanked pictures (stopped much earlier, it answers blank pictures about as well: it has not learnt
to look yet), far from what looking carefully gives (`tests/test_vision.py` checks the band and the blank pictures).
Cached like the other built-ins under `$RLBENCH_CACHE/models/`; deterministic for a seed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen2VLConfig, Qwen2VLForConditionalGeneration

from rlbench.batch import left_pad
from rlbench.models import shapes_data
from rlbench.models.tokenizer import build_tokenizer
from rlbench.models.vision import IMAGE_TOKENS, Vision, forward_inputs
from rlbench.models.warm_start import build_cached, cache_root, sft_tensors, supervised_warm_start, torch_threads

NAME = "tiny-vl"
VERSION = 1
"""Part of the cache directory's name: bump it whenever the recipe below changes."""
MAX_POSITIONS = 256
PATCH, MERGE, IMAGE_SIZE = 8, 2, 64
LR = 2e-3
BATCH_SIZE = 16
EVAL_EVERY = 25
STOP_AT, OVERSHOOT = 0.38, 0.48
MAX_STEPS = 3000
ANSWER_TOKENS = 16
"""Greedy budget of an answer ("green triangle" and EOS: 15 tokens)."""


def build_vl_tokenizer() -> PreTrainedTokenizerBase:
    """`build_tokenizer()` plus the three image tokens (ids 259, 260, 261), as special tokens."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    return tokenizer


def build_image_processor():
    from transformers import Qwen2VLImageProcessorPil

    pixels = IMAGE_SIZE * IMAGE_SIZE
    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                    min_pixels=pixels, max_pixels=pixels)


def build_model(seed: int = 0, tokenizer: PreTrainedTokenizerBase | None = None) -> Qwen2VLForConditionalGeneration:
    """The untrained model; its initialisation depends only on `seed` (global RNG untouched)."""
    tokenizer = tokenizer or build_vl_tokenizer()
    start, image, end = tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS))
    special = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         tie_word_embeddings=True, **special),
        vision_config=dict(depth=1, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3),
        image_token_id=image, vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True, **special)
    with torch.random.fork_rng(devices=[]):  # the global RNG untouched
        torch.manual_seed(seed)
        return Qwen2VLForConditionalGeneration(config)


def cache_dir(seed: int = 0) -> Path:
    """Where the built model for `seed` lives (it may not exist yet)."""
    return cache_root() / f"{NAME}-v{VERSION}-seed{seed}"


def ensure_built(seed: int = 0) -> Path:
    """The cached model directory for `seed`, built first if missing."""
    return build_cached(cache_dir(seed), lambda: (*train_tiny_vl(seed), build_image_processor()))


def train_tiny_vl(seed: int = 0) -> tuple[Qwen2VLForConditionalGeneration, PreTrainedTokenizerBase]:
    """Build and warm-start the model in memory (one torch thread, for reproducible numbers)."""
    train, test = shapes_data.split(image_size=IMAGE_SIZE)  # the task's default split
    with torch_threads(1):
        tokenizer = build_vl_tokenizer()
        model = build_model(seed, tokenizer)
        vision = Vision(build_image_processor(), *tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS)), merge_size=MERGE)
        rows, pixels = [], []
        for example in train:
            ids, images = vision.encode(tokenizer, example["prompt"], example["images"])
            answer = tokenizer.encode(example["answer"]) + [tokenizer.eos_token_id]
            rows.append((ids + answer, [False] * len(ids) + [True] * len(answer)))
            pixels.append(images)
        inputs_N_T, labels_N_T = sft_tensors(rows, tokenizer.pad_token_id)
        lengths_N = torch.tensor([len(ids) for ids, _ in rows])

        def batch(rows_B: torch.Tensor) -> dict:
            ids_B_T = inputs_N_T[rows_B]
            mask_B_T = (torch.arange(ids_B_T.shape[1]) < lengths_N[rows_B, None]).long()  # right padding
            return dict(input_ids=ids_B_T, attention_mask=mask_B_T, labels=labels_N_T[rows_B],
                        **forward_inputs(model, ids_B_T, mask_B_T, [pixels[i] for i in rows_B.tolist()]))

        supervised_warm_start(model, inputs_N_T, labels_N_T, lambda m: greedy_accuracy(m, tokenizer, vision, test),
                              seed=seed, lr=LR, batch_size=BATCH_SIZE, eval_every=EVAL_EVERY, stop_at=STOP_AT,
                              overshoot=OVERSHOOT, max_steps=MAX_STEPS, name=NAME, inputs_of=batch)
    return model.eval(), tokenizer


@torch.no_grad()
def greedy_accuracy(model, tokenizer: PreTrainedTokenizerBase, vision: Vision, examples) -> float:
    """The share of `examples` whose greedy answer (up to ANSWER_TOKENS, ending with EOS) is exactly theirs."""
    model.eval()
    encoded = [vision.encode(tokenizer, e["prompt"], e["images"]) for e in examples]
    ids_N_P, mask_N_P = left_pad([ids for ids, _ in encoded], tokenizer.pad_token_id)
    inputs = forward_inputs(model, ids_N_P, mask_N_P, [images for _, images in encoded])
    inputs.pop("position_ids")  # generate computes them, and those of each new token
    out_N_L = model.generate(input_ids=ids_N_P, attention_mask=mask_N_P, do_sample=False,
                             max_new_tokens=ANSWER_TOKENS, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, **inputs)
    right = 0
    for example, row in zip(examples, out_N_L[:, ids_N_P.shape[1]:].tolist()):
        if tokenizer.eos_token_id in row:
            right += tokenizer.decode(row[: row.index(tokenizer.eos_token_id)]) == example["answer"]
    return right / len(examples)
