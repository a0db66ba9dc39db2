"""tiny-arith: a 1.13M-parameter Qwen2 that knows a little two-digit addition, built offline.

The recipe: a fresh `Qwen2ForCausalLM` (`build_tiny_model`) is trained with supervision on the
arithmetic train pairs ("12+34=" -> "46<eos>", loss on the answer and EOS only) until its greedy
accuracy on the 200 held-out pairs is between `STOP_AT` and `OVERSHOOT` (about 0.3), so an RL run
starts with signal and room to improve. The result is saved once as an ordinary Hugging Face model
directory under `$RLBENCH_CACHE/models/` (default `~/.cache/rlbench`). Deterministic for a seed.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from rlbench.models.arithmetic_data import Pair, answer, arithmetic_split, prompt
from rlbench.models.tokenizer import build_tokenizer

NAME = "tiny-arith"
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


def tiny_config(tokenizer: PreTrainedTokenizerBase) -> Qwen2Config:
    """2 layers of width 192 (6 query heads, 2 KV heads of 32), MLP 768, tied embeddings, fp32.

    Few wide layers because at this size decoding speed is per-layer Python overhead.
    """
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=192,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    """The untrained tiny-arith model; its initialisation depends only on `seed` (global RNG untouched)."""
    config = tiny_config(build_tokenizer())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def cache_dir(seed: int = 0) -> Path:
    """Where the built model for `seed` lives (it may not exist yet)."""
    root = Path(os.environ.get("RLBENCH_CACHE") or Path.home() / ".cache" / "rlbench")
    return root / "models" / f"{NAME}-v{VERSION}-seed{seed}"


def ensure_built(seed: int = 0) -> Path:
    """The cached model directory for `seed`, built first if missing.

    Built into a temporary directory next to the final one, then renamed into place, so a directory
    under its final name is always complete; of two concurrent builders, the loser uses the winner's.
    """
    final = cache_dir(seed)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        model, tokenizer = train_tiny_arith(seed)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp makes it private; make it an ordinary directory
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def train_tiny_arith(seed: int = 0) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerBase]:
    """Build and warm-start the model in memory (one torch thread, for reproducible numbers)."""
    with _torch_threads(1):
        tokenizer = build_tokenizer()
        model = build_tiny_model(seed)
        warm_start(model, tokenizer, seed=seed)
    return model.eval(), tokenizer


def warm_start(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, *, seed: int) -> tuple[int, float]:
    """Supervised training on the train pairs until held-out greedy accuracy is in [STOP_AT, OVERSHOOT].

    Returns (steps taken, held-out accuracy). A check above OVERSHOOT rolls the model and optimizer
    back to the previous check, and training goes on from there with a check after every step.
    """
    train_pairs, heldout_pairs = arithmetic_split()
    inputs_N_T, labels_N_T = sft_tensors(tokenizer, train_pairs)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.98), weight_decay=0.0)
    eval_every, last_check = EVAL_EVERY, _snapshot(model, optimizer)
    with tqdm(desc=f"building {NAME} (seed {seed})", unit="step") as bar:
        for step in range(1, MAX_STEPS + 1):
            model.train()
            rows_B = torch.randint(len(train_pairs), (BATCH_SIZE,), generator=generator)
            loss = model(input_ids=inputs_N_T[rows_B], labels=labels_N_T[rows_B]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            bar.update()
            if step % eval_every:
                continue
            accuracy = greedy_accuracy(model, tokenizer, heldout_pairs)
            bar.set_postfix(loss=f"{loss.item():.3f}", heldout_acc=accuracy)
            if accuracy < STOP_AT:
                last_check = _snapshot(model, optimizer)
            elif accuracy <= OVERSHOOT:
                return step, accuracy
            elif eval_every > 1:
                _restore(model, optimizer, last_check)
                eval_every = 1
            else:
                break
    raise RuntimeError(
        f"{NAME} warm start (seed {seed}) did not stop with held-out accuracy in [{STOP_AT}, {OVERSHOOT}]"
    )


def sft_tensors(tokenizer: PreTrainedTokenizerBase, pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids_N_T, labels_N_T): prompt + answer + EOS, right-padded; labels -100 except on answer + EOS.

    Right padding is harmless here: pads only follow the last target, and attention is causal.
    """
    eos = tokenizer.eos_token_id
    rows = [(tokenizer.encode(prompt(a, b)), tokenizer.encode(answer(a, b)) + [eos]) for a, b in pairs]
    T = max(len(p) + len(t) for p, t in rows)
    input_ids_N_T = torch.full((len(rows), T), tokenizer.pad_token_id)
    labels_N_T = torch.full((len(rows), T), -100)
    for i, (p, t) in enumerate(rows):
        input_ids_N_T[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels_N_T[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    return input_ids_N_T, labels_N_T


@torch.no_grad()
def greedy_accuracy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[Pair],
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> float:
    """Fraction of `pairs` whose greedy completion is exactly the answer followed by EOS."""
    model.eval()
    batch = tokenizer([prompt(a, b) for a, b in pairs], return_tensors="pt", padding=True)
    out_N_L = model.generate(
        **batch,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    completions_N_C = out_N_L[:, batch["input_ids"].shape[1] :].tolist()
    targets = [tokenizer.encode(answer(a, b)) + [tokenizer.eos_token_id] for a, b in pairs]
    return sum(c[: len(t)] == t for c, t in zip(completions_N_C, targets)) / len(pairs)


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    return copy.deepcopy((model.state_dict(), optimizer.state_dict()))


def _restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, snapshot: tuple[dict, dict]) -> None:
    model.load_state_dict(snapshot[0])
    optimizer.load_state_dict(snapshot[1])


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
