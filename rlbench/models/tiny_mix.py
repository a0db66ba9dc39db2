"""tiny-mix: the tiny-arith architecture and tokenizer, warm-started on countdown, sorting and reversing.

The recipe: a fresh `Qwen2ForCausalLM` (`build_tiny_model`) is trained with supervision on a mixture of
the synthetic problem sets (`synthetic_data`): every countdown training problem (3 numbers in 1..9,
target <= 99, "3 5 7 to 22=" -> "3*5+7"), plus every sixth sort and reverse problem (4 digits), until
its greedy accuracy on the 200 held-out countdown problems (checked exactly: any expression that uses
each number once and reaches the target) is between `STOP_AT` and `OVERSHOOT`. Countdown is the harder
task it leaves room on: GRPO raises that accuracy (tests/test_tasks_synthetic.py). Cached like tiny-arith
under `$RLBENCH_CACHE/models/`; deterministic for a seed.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM

from rlbench.models import synthetic_data as data
from rlbench.models.tiny_arith import build_tiny_model
from rlbench.models.tokenizer import build_tokenizer
from rlbench.models.warm_start import (build_cached, cache_root, greedy_completions, supervised_warm_start,
                                       text_sft_tensors, torch_threads)

NAME = "tiny-mix"
VERSION = 1
"""Part of the cache directory's name: bump it whenever the recipe below changes."""

LR = 1e-3
BATCH_SIZE = 64
EVAL_EVERY = 25
STOP_AT = 0.2
OVERSHOOT = 0.4
MAX_STEPS = 2000
MAX_NEW_TOKENS = 8
LIST_STRIDE = 6
"""Every LIST_STRIDE-th sort and reverse training problem joins the mixture (countdown dominates)."""


def mixture() -> list[tuple[str, str]]:
    """The (prompt, answer) training texts of the warm start."""
    countdown = [(data.countdown_prompt(n, t), solution) for n, t, solution in data.countdown_split()[0]]
    lists = data.list_split()[0][::LIST_STRIDE]
    return countdown + [(data.list_prompt(verb, items), data.list_answer(verb, items))
                        for verb in ("sort", "rev") for items in lists]


def countdown_accuracy(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, problems) -> float:
    """Fraction of (numbers, target, _) problems whose greedy completion reaches the target, then EOS."""
    completions = greedy_completions(model, tokenizer, [data.countdown_prompt(n, t) for n, t, _ in problems],
                                     MAX_NEW_TOKENS)
    eos = tokenizer.eos_token_id
    solved = [eos in ids and data.check_countdown(tokenizer.decode(ids[: ids.index(eos)]), n, t)[0]
              for ids, (n, t, _) in zip(completions, problems)]
    return sum(solved) / len(problems)


def cache_dir(seed: int = 0) -> Path:
    """Where the built model for `seed` lives (it may not exist yet)."""
    return cache_root() / f"{NAME}-v{VERSION}-seed{seed}"


def ensure_built(seed: int = 0, *, shipped: bool = True) -> Path:
    """The model directory for `seed`: shipped with rlbench, or cached and built first if missing (`build_cached`)."""
    return build_cached(cache_dir(seed), lambda: train_tiny_mix(seed), shipped=shipped)


def train_tiny_mix(seed: int = 0) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerBase]:
    """Build and warm-start the model in memory (one torch thread, for reproducible numbers)."""
    with torch_threads(1):
        tokenizer = build_tokenizer()
        model = build_tiny_model(seed)
        inputs_N_T, labels_N_T = text_sft_tensors(tokenizer, mixture())
        heldout = data.countdown_split()[1]
        supervised_warm_start(
            model, inputs_N_T, labels_N_T, lambda m: countdown_accuracy(m, tokenizer, heldout), seed=seed, lr=LR,
            batch_size=BATCH_SIZE, eval_every=EVAL_EVERY, stop_at=STOP_AT, overshoot=OVERSHOOT,
            max_steps=MAX_STEPS, name=NAME)
    return model.eval(), tokenizer
