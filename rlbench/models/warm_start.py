"""What the built-in tiny models share: supervised warm start to a target accuracy, and the build cache.

A built-in model is a fresh tiny Qwen2 trained with supervision (loss on the answer and EOS only) until
a held-out accuracy check lands in [stop_at, overshoot], so that an RL run starts with signal and room
to improve. Seed 0 of each built-in ships with rlbench (`SHIPPED`: the same bytes on every machine, made by
`python -m rlbench.models.build NAME --ship`); another seed is built on first use and saved once under
`$RLBENCH_CACHE/models/` (default `~/.cache/rlbench`).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlbench.batch import left_pad
from rlbench.runs.progress import bar as progress_bar


def cache_root() -> Path:
    """`$RLBENCH_CACHE/models`, default ~/.cache/rlbench/models."""
    return Path(os.environ.get("RLBENCH_CACHE") or Path.home() / ".cache" / "rlbench") / "models"


SHIPPED = Path(__file__).parent / "weights"
"""The built-in models that ship with rlbench, one folder each, named as their build's cache folder
(`tiny-arith-v1-seed0`). A model trained on the user's machine would differ from machine to machine (each CPU
rounds its own way), and so would every figure measured on it."""


def build_cached(final: Path, train: Callable[[], tuple[PreTrainedModel, PreTrainedTokenizerBase]], *,
                 shipped: bool = True) -> Path:
    """The shipped folder named as `final` (`SHIPPED`) unless `shipped` is False; otherwise `final`, after building
    it with `train()` if it has no config.json yet: (model, tokenizer, anything else saved with `save_pretrained`
    beside them).

    Built into a temporary directory next to the final one, then renamed into place, so a directory
    under its final name is always complete. A second process of this machine asking for it meanwhile waits
    for the first's build instead of training it again (`_building`); of two builders that do not see each
    other's lock (two machines sharing the cache), the loser uses the winner's.
    """
    if shipped and (SHIPPED / final.name / "config.json").is_file():
        return SHIPPED / final.name
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _building(final):
        if (final / "config.json").is_file():  # built by the process that held the lock
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            for part in train():  # the model, its tokenizer, and whatever else its folder holds (an image processor)
                part.save_pretrained(tmp)
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


@contextlib.contextmanager
def _building(final: Path) -> Iterator[None]:
    """Holds this machine's lock on building `final` (a file lock in the temp folder, named for its path, so the
    cache holds models only); says so on stderr when it has to wait. The kernel drops the lock of a builder that
    dies, so a crashed build never blocks the next."""
    key = hashlib.sha256(str(final.resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"rlbench-build-{key}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process building {final}", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def text_sft_tensors(tokenizer: PreTrainedTokenizerBase,
                     rows: Sequence[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids_N_T, labels_N_T) of (prompt, answer) texts: prompt + answer + EOS, labels on answer + EOS."""
    encoded = [(tokenizer.encode(p), tokenizer.encode(a) + [tokenizer.eos_token_id]) for p, a in rows]
    return sft_tensors([(p + t, [False] * len(p) + [True] * len(t)) for p, t in encoded], tokenizer.pad_token_id)


def sft_tensors(rows: Sequence[tuple[Sequence[int], Sequence[bool]]],
                pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids_N_T, labels_N_T) of (ids, trained) rows, right-padded; labels -100 where not `trained`.

    Right padding is harmless: pads only follow the last target (causal)."""
    T = max(len(ids) for ids, _ in rows)
    input_ids_N_T = torch.full((len(rows), T), pad_id)
    labels_N_T = torch.full((len(rows), T), -100)
    for i, (ids, trained) in enumerate(rows):
        input_ids_N_T[i, : len(ids)] = torch.tensor(ids)
        labels_N_T[i, : len(ids)] = torch.where(torch.tensor(trained, dtype=torch.bool), torch.tensor(ids), -100)
    return input_ids_N_T, labels_N_T


def supervised_warm_start(model: PreTrainedModel, inputs_N_T: torch.Tensor, labels_N_T: torch.Tensor,
                          evaluate: Callable[[PreTrainedModel], float | dict[str, float]], *, seed: int, lr: float,
                          batch_size: int, eval_every: int, stop_at: float, overshoot: float, max_steps: int,
                          name: str, inputs_of: Callable[[torch.Tensor], dict] | None = None) -> tuple[int, float]:
    """Train on random rows until `evaluate(model)` is in [stop_at, overshoot]; (steps, accuracy).

    `evaluate` returns the held-out accuracy, or a dict of metrics with it as "acc" (the others are shown
    in the progress bar). `inputs_of(rows_B)`, when given, is the forward's keyword arguments for those rows (a
    vision-language model's pixels beside the ids and labels); by default the rows of the two tensors.

    A check above `overshoot` rolls the model and optimizer back to the previous check, and training
    goes on from there with a check after every step. RuntimeError if it never lands in the band.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    last_check = _snapshot(model, optimizer)
    with progress_bar(desc=f"building {name} (seed {seed})", unit="step") as bar:
        for step in range(1, max_steps + 1):
            model.train()
            rows_B = torch.randint(len(inputs_N_T), (batch_size,), generator=generator)
            inputs = inputs_of(rows_B) if inputs_of else dict(input_ids=inputs_N_T[rows_B], labels=labels_N_T[rows_B])
            loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            bar.update()
            if step % eval_every:
                continue
            metrics = evaluate(model)
            metrics = metrics if isinstance(metrics, dict) else {"acc": metrics}
            accuracy = metrics["acc"]
            bar.set_postfix(loss=f"{loss.item():.3f}", heldout_acc=accuracy,
                            **{k: v for k, v in metrics.items() if k != "acc"})
            if accuracy < stop_at:
                last_check = _snapshot(model, optimizer)
            elif accuracy <= overshoot:
                return step, accuracy
            elif eval_every > 1:
                _restore(model, optimizer, last_check)
                eval_every = 1
            else:
                break
    raise RuntimeError(
        f"{name} warm start (seed {seed}) did not stop with held-out accuracy in [{stop_at}, {overshoot}]")


@torch.no_grad()
def greedy_continuations(model: PreTrainedModel, rows: Sequence[Sequence[int]], *, max_new_tokens: int,
                         stop_ids: Sequence[int], pad_id: int) -> list[list[int]]:
    """Greedy continuation ids of each row of token ids (a left-padded batch), each cut after its first
    stop id, up to `max_new_tokens` each."""
    model.eval()
    input_ids_N_L, attention_mask_N_L = left_pad(rows, pad_id)
    out_N_L = model.generate(input_ids=input_ids_N_L, attention_mask=attention_mask_N_L, do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids), pad_token_id=pad_id)
    continuations = out_N_L[:, input_ids_N_L.shape[1] :].tolist()
    stops = set(stop_ids)
    return [c[: next((i + 1 for i, t in enumerate(c) if t in stops), len(c))] for c in continuations]


@torch.no_grad()
def greedy_completions(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str],
                       max_new_tokens: int) -> list[list[int]]:
    """Greedy completion ids of each prompt (left-padded batch), up to `max_new_tokens` each."""
    model.eval()
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True)
    out_N_L = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return out_N_L[:, batch["input_ids"].shape[1] :].tolist()


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    return copy.deepcopy((model.state_dict(), optimizer.state_dict()))


def _restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, snapshot: tuple[dict, dict]) -> None:
    model.load_state_dict(snapshot[0])
    optimizer.load_state_dict(snapshot[1])


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
