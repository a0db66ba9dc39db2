"""tiny-moe: a 1.13M-parameter Qwen3-MoE (4 experts, 2 per token) that knows a little two-digit addition, built
offline.

The tiny-arith recipe (`tiny_arith.warm_start`: supervised steps on the arithmetic train pairs until held-out greedy
accuracy is about 0.3) on a mixture-of-experts architecture of the same width and depth: each layer's MLP is 4
experts of width 192 (the dense model's 768 split four ways), a router picks 2 of them per token and weighs them by
its renormalised probabilities. Cached like tiny-arith under `$RLBENCH_CACHE/models/`; deterministic for a seed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen3MoeConfig, Qwen3MoeForCausalLM

from rlbench.models import tiny_arith
from rlbench.models.tokenizer import build_tokenizer
from rlbench.models.warm_start import build_cached, cache_root, torch_threads

NAME = "tiny-moe"
VERSION = 1
"""Part of the cache directory's name: bump it whenever the recipe below changes."""
EXPERTS = 4
EXPERTS_PER_TOKEN = 2


def moe_config(tokenizer: PreTrainedTokenizerBase) -> Qwen3MoeConfig:
    """tiny-arith's shape (2 layers of width 192, 6 query heads and 2 KV heads of 32, tied embeddings, fp32) with
    `EXPERTS` experts of width 192 per layer, `EXPERTS_PER_TOKEN` of them per token, and no auxiliary loss."""
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=192, intermediate_size=768, moe_intermediate_size=192,
        num_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, norm_topk_prob=True, router_aux_loss_coef=0.0,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32")


def cache_dir(seed: int = 0) -> Path:
    """Where the built model for `seed` lives (it may not exist yet)."""
    return cache_root() / f"{NAME}-v{VERSION}-seed{seed}"


def ensure_built(seed: int = 0, *, shipped: bool = True) -> Path:
    """The model directory for `seed`: shipped with rlbench, or cached and built first if missing (`build_cached`)."""
    return build_cached(cache_dir(seed), lambda: train_tiny_moe(seed), shipped=shipped)


def train_tiny_moe(seed: int = 0) -> tuple[Qwen3MoeForCausalLM, PreTrainedTokenizerBase]:
    """Build and warm-start the model in memory (one torch thread, for reproducible numbers); its initialisation
    depends only on `seed` (global RNG untouched)."""
    with torch_threads(1):
        tokenizer = build_tokenizer()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3MoeForCausalLM(moe_config(tokenizer))
        tiny_arith.warm_start(model, tokenizer, seed=seed, name=NAME)
    return model.eval(), tokenizer
