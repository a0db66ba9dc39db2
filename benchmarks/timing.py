"""Shared by the benchmark scripts (they run from this folder, so `from timing import ...` finds it)."""

import statistics
import time

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

import rlbench as rl


def tokens_per_second(fns: list, repeats: int) -> list[float]:
    """For each function, the median of its returned token count over its wall time. They run in turns (one
    call of each, `repeats` times, after a warm-up call each), so that a slow spell of a shared machine
    falls on all of them alike."""
    for fn in fns:
        fn()
    rates = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_rates in zip(fns, rates):
            start = time.perf_counter()
            tokens = int(fn())
            fn_rates.append(tokens / (time.perf_counter() - start))
    return [statistics.median(r) for r in rates]


def random_qwen2(directory: str, *, hidden: int = 256, layers: int = 4, intermediate: int = 1024, heads: int = 4,
                 kv_heads: int = 2, max_positions: int = 128, tied: bool = True, seed: int = 0) -> str:
    """A randomly initialised Qwen2 with tiny-arith's tokenizer, saved to `directory` (default ~4M parameters):
    `max_positions` its context length, `tied` whether the LM head shares the embedding's weights."""
    tokenizer = rl.models.build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=tied, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.manual_seed(seed)
    transformers.utils.logging.disable_progress_bar()
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
