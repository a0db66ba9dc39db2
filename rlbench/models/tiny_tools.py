"""tiny-tools: the tiny-arith architecture with tool-call tokens and a chat template, warm-started to call `calc`.

The recipe: the byte-level tiny tokenizer plus `<tool_call>` and `</tool_call>` (one token each) and a
four-line chat template (`CHAT_TEMPLATE`); a fresh `Qwen2ForCausalLM` (`build_model`) trained with
supervision on a mixture of calculator episodes (`calculator_data`), one per training product: mostly
(`TOOL_SHARE_BIG`) an episode that calls `calc` and copies its result for products of at least
`BIG_PRODUCT`, mostly (1 - `TOOL_SHARE_SMALL`) the product answered at once for smaller ones (which a model
this small cannot compute). Loss on the sampled tokens only. Training stops when greedy held-out episodes
(`episode_metrics`) are right between `STOP_AT` and `OVERSHOOT` of the time, while the model is still
learning to copy the operands into the call and the result into its answer: it calls the tool on some
problems and is right on some of those, so RL has room to teach it to call the tool always, and well.
The build's progress bar prints its steps and the held-out accuracy, tool calls and well-formed calls at each
check (`tests/test_tiny_tools.py` asserts the accuracy it stops at is within [STOP_AT, OVERSHOOT]). Cached like
tiny-arith under `$RLBENCH_CACHE/models/`; deterministic for a seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM

from rlbench.models import calculator_data as data
from rlbench.models.tiny_arith import build_tiny_model
from rlbench.models.tokenizer import build_tokenizer
from rlbench.models.warm_start import (build_cached, cache_root, greedy_continuations, sft_tensors,
                                       supervised_warm_start, torch_threads)

NAME = "tiny-tools"
VERSION = 1
"""Part of the cache directory's name: bump it whenever the recipe below changes."""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ {'user': 'Q:', 'assistant': 'A:', 'tool': 'R:'}.get(message['role'], '') }}{{ message['content'] }}\n"
    "{% endfor -%}"
    "{%- if add_generation_prompt %}A:{% endif -%}"
)
"""One line per message: "Q:" user, "A:" assistant, "R:" tool, a system message's content alone; "A:" asks
for the reply. Append-only: a conversation renders as the concatenation of its messages' renderings."""
MAX_POSITIONS = 256
"""Context: an episode of one call is 82 tokens; three turns fit."""

BIG_PRODUCT = 2000
TOOL_SHARE_BIG, TOOL_SHARE_SMALL = 0.9, 0.1
"""The share of training products of at least BIG_PRODUCT whose episode calls calc, and that of smaller ones
(the others are answered directly): greedy, the warm-started model calls the tool on about half the
problems, and sampling explores both ways on every problem."""
MIXTURE_SEED = 7
LR = 1.5e-3
BATCH_SIZE = 8
"""Learning to copy (the operands into the call, the result into the answer) takes 300 to 700 steps at
nearly any batch size, so a small batch builds fastest."""
EVAL_EVERY = 25
STOP_AT = 0.15
OVERSHOOT = 0.35
MAX_STEPS = 3000
TURN_TOKENS = 72
"""Greedy budget of the first turn (a call is 56 tokens)..."""
ANSWER_TOKENS = 8
"""... and of the answer after the tool's result."""


def build_tools_tokenizer() -> PreTrainedTokenizerBase:
    """`build_tokenizer()` plus `<tool_call>` and `</tool_call>` (ids 259 and 260) and `CHAT_TEMPLATE`.

    The markup tokens are added tokens, not special ones: typed as text they still encode to one token
    each (the text "<eos>" stays five tokens), and decoding keeps them, also with skip_special_tokens.
    """
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (data.CALL_START, data.CALL_END)])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(seed: int = 0) -> Qwen2ForCausalLM:
    """The untrained model (tiny-arith's shape, MAX_POSITIONS, the larger vocabulary); depends only on `seed`."""
    return build_tiny_model(seed, build_tools_tokenizer(), max_position_embeddings=MAX_POSITIONS)


def cache_dir(seed: int = 0) -> Path:
    """Where the built model for `seed` lives (it may not exist yet)."""
    return cache_root() / f"{NAME}-v{VERSION}-seed{seed}"


def ensure_built(seed: int = 0, *, shipped: bool = True) -> Path:
    """The model directory for `seed`: shipped with rlbench, or cached and built first if missing (`build_cached`)."""
    return build_cached(cache_dir(seed), lambda: train_tiny_tools(seed), shipped=shipped)


def train_tiny_tools(seed: int = 0) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerBase]:
    """Build and warm-start the model in memory (one torch thread, for reproducible numbers)."""
    with torch_threads(1):
        tokenizer = build_tools_tokenizer()
        model = build_model(seed)
        inputs_N_T, labels_N_T = sft_tensors(mixture(tokenizer), tokenizer.pad_token_id)
        heldout = data.calculator_pairs()[1]
        supervised_warm_start(
            model, inputs_N_T, labels_N_T, lambda m: episode_metrics(m, tokenizer, heldout), seed=seed, lr=LR,
            batch_size=BATCH_SIZE, eval_every=EVAL_EVERY, stop_at=STOP_AT, overshoot=OVERSHOOT,
            max_steps=MAX_STEPS, name=NAME)
    return model.eval(), tokenizer


def mixture(tokenizer: PreTrainedTokenizerBase) -> list[tuple[list[int], list[bool]]]:
    """The (ids, sampled) training episodes: one per training product, calling calc or answering directly."""
    rng = random.Random(MIXTURE_SEED)
    share = {True: TOOL_SHARE_BIG, False: TOOL_SHARE_SMALL}
    return [(data.tool_episode if rng.random() < share[a * b >= BIG_PRODUCT] else data.direct_episode)(tokenizer, a, b)
            for a, b in data.calculator_pairs()[0]]


@torch.no_grad()
def episode_metrics(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase,
                    pairs: Sequence[data.Pair]) -> dict[str, float]:
    """Greedy episodes of the products `pairs`, as fractions of them: "acc" (right), "tool_calls" (the first
    turn starts a call), "well_formed" (the first turn is a well-formed call of calc).

    Each turn stops at EOS or `</tool_call>`. A first turn without a call is the answer; a well-formed call
    is run, its result appended as the chat template renders it, and the second turn is the answer; a
    malformed call ends the episode, wrong. An episode is right when its answer ends with EOS and its text
    (stripped) is the product.
    """
    eos, call_start, call_end = tokenizer.convert_tokens_to_ids([tokenizer.eos_token, data.CALL_START, data.CALL_END])
    stops = dict(stop_ids=[eos, call_end], pad_id=tokenizer.pad_token_id)
    messages = [data.example(a, b)["prompt"] for a, b in pairs]
    prompts = [tokenizer.encode(data.render(tokenizer, m, add_generation_prompt=True)) for m in messages]
    first = greedy_continuations(model, prompts, max_new_tokens=TURN_TOKENS, **stops)
    second: dict[int, list[int]] = {}  # episode -> its tokens up to the second turn
    for i, turn in enumerate(first):
        expression = data.parse_tool_call(tokenizer.decode(turn)) if turn[-1:] == [call_end] else None
        if expression is not None:
            observation = data.observation_text(tokenizer, messages[i], tokenizer.decode(turn), _run(expression))
            second[i] = prompts[i] + turn + tokenizer.encode(observation)
    last = {i: turn for i, turn in enumerate(first) if call_start not in turn}  # direct answers
    if second:
        last.update(zip(second, greedy_continuations(model, list(second.values()), max_new_tokens=ANSWER_TOKENS,
                                                     **stops)))
    right = [i in last and last[i][-1:] == [eos] and tokenizer.decode(last[i][:-1]).strip() == data.answer(a, b)
             for i, (a, b) in enumerate(pairs)]
    return {"acc": sum(right) / len(pairs), "tool_calls": sum(call_start in t for t in first) / len(pairs),
            "well_formed": len(second) / len(pairs)}


def _run(expression: str) -> str:
    """calc's result, or its error as the tool message."""
    try:
        return data.calc(expression)
    except ValueError as e:
        return f"error: {e}"
