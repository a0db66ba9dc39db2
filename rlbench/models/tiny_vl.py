"""tiny-vl: a Qwen2-VL model small enough to train on a CPU, warm-started on the "shapes" task's pictures.

The recipe: the byte-level tiny tokenizer plus Qwen's `<|vision_start|>`, `<|image_pad|>` and `<|vision_end|>` (special
tokens: typed as text they stay text), and `<|video_pad|>`, added after the warm start (`with_video_token`);
Qwen2-VL's image processor at 8-pixel patches, so that a 64 x 64 picture is 8 x 8 patches, merged 2 x 2 into 16
image tokens; a fresh `Qwen2VLForConditionalGeneration` with a one-block vision tower (`build_model`), warm-started
in two supervised phases (loss on the answer and EOS), the way a real vision-language model comes to RL having learnt
to see before it learnt the task:

1. to see: `DESCRIBE_STEPS` steps of describing pictures (`<image>describe?=` -> what each cell holds,
   `shapes_data.describe`), each step on new pictures, so that it learns to see rather than to remember;
2. the task, briefly: the task's questions on `QA_POOL` pictures of their own, until greedy held-out accuracy is
   between `STOP_AT` and `OVERSHOOT` (a few steps): above answering blind (0.145) and below what it sees.

Neither phase shows it the task's own training pictures (all are drawn apart from the task's, seed 0). GRPO then
teaches it to answer from what it sees (`tests/test_vision.py`). Cached like the other built-ins under
`$RLBENCH_CACHE/models/`; deterministic for a seed.
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
from rlbench.runs.progress import bar as progress_bar

NAME = "tiny-vl"
VERSION = 3
"""Part of the cache directory's name: bump it whenever the recipe below changes."""
MAX_POSITIONS = 256
PATCH, MERGE, IMAGE_SIZE = 8, 2, 64
LR = 2e-3
BATCH_SIZE = 16
DESCRIBE = "<image>describe?="
DESCRIBE_STEPS = 1250
DESCRIBE_SEED = 1
"""Phase 1's pictures at step k: `shapes_data.problems(BATCH_SIZE, seed=DESCRIBE_SEED * 100_000 + k)`."""
QA_POOL, QA_SEED = 2000, 2
"""Phase 2's questions: `shapes_data.problems(QA_POOL, seed=QA_SEED)`."""
EVAL_EVERY = 5
STOP_AT, OVERSHOOT = 0.30, 0.40
MAX_STEPS = 3000
ANSWER_TOKENS = 16
"""Greedy budget of an answer ("green triangle" and EOS: 15 tokens)."""


def build_vl_tokenizer() -> PreTrainedTokenizerBase:
    """`build_tokenizer()` plus the three image tokens (ids 259, 260, 261), as special tokens."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    return tokenizer


VIDEO_TOKEN = "<|video_pad|>"
"""Qwen2-VL's video slot. tiny-vl takes no video, but a Qwen2-VL tokenizer has the token and vLLM's Qwen2-VL processor
looks it up; the policy never draws it (`rlbench.models.vision.never_sampled`)."""


def with_video_token(model: Qwen2VLForConditionalGeneration, tokenizer: PreTrainedTokenizerBase) -> None:
    """Add `VIDEO_TOKEN` to the tokenizer (id 262) and a zero row for it to the (tied) embedding, in place. Added once
    the model is trained, so that the warm start is the one it was before the token (version 2): the sampler and the
    trainer give the token no probability, and the row meets no gradient."""
    tokenizer.add_special_tokens({"additional_special_tokens": [*IMAGE_TOKENS, VIDEO_TOKEN]})
    with torch.random.fork_rng(devices=[]):  # (new rows are drawn, then zeroed: the global RNG untouched)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)
    with torch.no_grad():
        model.get_input_embeddings().weight[model.config.video_token_id] = 0.0


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


def ensure_built(seed: int = 0, *, shipped: bool = True) -> Path:
    """The model directory for `seed`: shipped with rlbench, or cached and built first if missing (`build_cached`)."""
    return build_cached(cache_dir(seed), lambda: (*train_tiny_vl(seed), build_image_processor()), shipped=shipped)


def train_tiny_vl(seed: int = 0) -> tuple[Qwen2VLForConditionalGeneration, PreTrainedTokenizerBase]:
    """Build and warm-start the model in memory, both phases (one torch thread, for reproducible numbers)."""
    test = shapes_data.split(image_size=IMAGE_SIZE)[1]  # the task's default held-out split: where phase 2 stops
    with torch_threads(1):
        tokenizer = build_vl_tokenizer()
        model = build_model(seed, tokenizer)
        vision = Vision(build_image_processor(), *tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS)), merge_size=MERGE)
        learn_to_see(model, tokenizer, vision, seed=seed)
        pool = shapes_data.problems(QA_POOL, max_shapes=shapes_data.MAX_SHAPES, image_size=IMAGE_SIZE, seed=QA_SEED)
        supervised = Supervised(model, tokenizer, vision, [(e["prompt"], e["images"], e["answer"]) for e in pool])
        supervised_warm_start(model, supervised.inputs_N_T, supervised.labels_N_T,
                              lambda m: greedy_accuracy(m, tokenizer, vision, test), seed=seed, lr=LR,
                              batch_size=BATCH_SIZE, eval_every=EVAL_EVERY, stop_at=STOP_AT, overshoot=OVERSHOOT,
                              max_steps=MAX_STEPS, name=NAME, inputs_of=supervised.batch)
    with_video_token(model, tokenizer)
    return model.eval(), tokenizer


def learn_to_see(model, tokenizer: PreTrainedTokenizerBase, vision: Vision, *, seed: int) -> None:
    """Phase 1: `DESCRIBE_STEPS` AdamW steps on describing new pictures (see the module docstring)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.98), weight_decay=0.0)
    with progress_bar(total=DESCRIBE_STEPS, desc=f"building {NAME} (seed {seed}): learning to see", unit="step") as bar:
        for step in range(DESCRIBE_STEPS):
            model.train()
            pictures = shapes_data.problems(BATCH_SIZE, max_shapes=shapes_data.MAX_SHAPES, image_size=IMAGE_SIZE,
                                            seed=DESCRIBE_SEED * 100_000 + step)
            rows = Supervised(model, tokenizer, vision, [(DESCRIBE, e["images"], shapes_data.describe(e["shapes"]))
                                                         for e in pictures])
            loss = model(**rows.batch(torch.arange(BATCH_SIZE))).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")


class Supervised:
    """(prompt, images, answer) rows as a vision-language model's supervised batches: prompt + answer + EOS, the
    loss on the answer and EOS; right-padded."""

    def __init__(self, model, tokenizer: PreTrainedTokenizerBase, vision: Vision, rows) -> None:
        self.model, encoded, self.pixels = model, [], []
        for prompt, images, answer in rows:
            ids, pixels = vision.encode(tokenizer, prompt, images)
            target = tokenizer.encode(answer) + [tokenizer.eos_token_id]
            encoded.append((ids + target, [False] * len(ids) + [True] * len(target)))
            self.pixels.append(pixels)
        self.inputs_N_T, self.labels_N_T = sft_tensors(encoded, tokenizer.pad_token_id)
        self.lengths_N = torch.tensor([len(ids) for ids, _ in encoded])

    def batch(self, rows_B: torch.Tensor) -> dict:
        """The forward's keyword arguments for these rows (labels included)."""
        ids_B_T = self.inputs_N_T[rows_B]
        mask_B_T = (torch.arange(ids_B_T.shape[1]) < self.lengths_N[rows_B, None]).long()
        return dict(input_ids=ids_B_T, attention_mask=mask_B_T, labels=self.labels_N_T[rows_B],
                    **forward_inputs(self.model, ids_B_T, mask_B_T, [self.pixels[i] for i in rows_B.tolist()]))


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
