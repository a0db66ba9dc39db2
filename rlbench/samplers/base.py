"""The Sampler protocol: token ids in, completions with the log-probs they were sampled with out."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
import torch

from rlbench.batch import Batch


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Completions per prompt; rows come out prompt-major (prompt 0's n samples first)."""
    max_new_tokens: int = 16
    """Most tokens per completion, the stop token included."""
    temperature: float = 1.0
    """0 means greedy. Returned log-probs are of the temperature-scaled distribution (1 when greedy)."""
    top_p: float = 1.0
    """Nucleus mass (1.0 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    seed: int = 0
    """Seed of this call's random draws."""
    seeds: tuple[int, ...] | None = None
    """One seed per prompt instead (a prompt's draws then do not depend on the other prompts of the call)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a completion besides the sampler's EOS (a tool call's end), kept in the completion."""
    keep_cache: bool = False
    """Keep the KV cache of each completion that ends with a stop token, for a later call whose prompt continues
    it (an episode's next turn); the HF sampler then prefills only the new tokens. A kept cache is dropped once
    a call uses it or when the next 2 calls do not, all of them on `load_weights`. The HF sampler keeps them on
    its compact decoder (Qwen2, Qwen3, Llama) only: on other architectures this has no effect. vLLM ignores
    it: its prefix caching reuses shared prefixes without being asked."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def of(cls, cfg, *, n: int = 1, greedy: bool = False, max_new_tokens: int | None = None, **fields) -> SamplingParams:
        """A session's sampling settings (its `rl.Config`: `max_new_tokens`, `temperature`, `top_p`, `top_k`) for `n`
        completions per prompt, or greedy ones; `fields` set the rest (`seed` or `seeds`, `stop_token_ids`, ...). The
        one place rollouts, evaluation and episodes get their settings from."""
        settings = dict(temperature=0.0) if greedy else dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
        return cls(n=n, max_new_tokens=max_new_tokens or cfg.max_new_tokens, **settings, **fields)


class Sampler(Protocol):
    """What the session needs of a sampler (the HF decode loop and vLLM both follow it)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> Batch:
        """Sample `params.n` completions of every prompt.

        Returns a Batch of `len(prompt_ids) * n` rows with `response_ids [B, T]` (right-padded with the
        pad id), `response_mask [B, T]` (1 on generated tokens, the stop token included),
        `sampler_logp [B, T]` (log-prob of each generated token, 0 on padding) and `finished [B]`
        (True where the completion ended with a stop token rather than at max_new_tokens).
        """
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the model's weights with a full (unsharded) state dict of the policy."""
        ...


def as_tensors(state_dict: dict) -> dict[str, torch.Tensor]:
    """A state dict of tensors from tensors or numpy arrays (read-only views from Ray's object store are
    fine: the weights are only read, to be copied into the sampler's model)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state_dict.items()}


def max_positions(model_dir: Path) -> int | None:
    """A model directory's context length (its config's `max_position_embeddings`), or None where it names none."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")


def checkpoint_names(model_dir: Path) -> set[str] | None:
    """The tensor names of a model directory's safetensors checkpoint (None if it has none)."""
    from safetensors import safe_open

    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names = set()
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            names |= set(f.keys())
    return names or None


CHECKPOINT_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
"""(live prefix, stored prefix) of a vision-language model's tensors: transformers nests the Qwen2-VL family's language
model and vision tower under `model.` in memory and saves them under their original names."""


def fit_checkpoint(state: dict, names: set[str] | None) -> dict:
    """The entries of a full state dict that an engine built from a checkpoint with tensors `names` takes, by their
    stored names (`CHECKPOINT_PREFIXES`), in name order (a tied LM head, which the policy exports and the checkpoint
    does not store, left out); a ValueError naming what is missing and what is unexpected. `names` None (no
    safetensors checkpoint): `state` as it is."""
    if names is None:
        return state
    state = {_stored_name(name, names): tensor for name, tensor in state.items()}
    unexpected, missing = set(state) - names - {"lm_head.weight"}, names - set(state)
    if unexpected or missing:
        raise ValueError(f"weights do not fit the sampler's model: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    return {name: state[name] for name in sorted(names)}


def _stored_name(name: str, names: set[str]) -> str:
    """`name` as the checkpoint with tensors `names` stores it (`CHECKPOINT_PREFIXES`); `name` where none applies."""
    for live, stored in CHECKPOINT_PREFIXES:
        if name.startswith(live) and stored + name.removeprefix(live) in names:
            return stored + name.removeprefix(live)
    return name


def completions(ids: Sequence[Sequence[int]], logps: Sequence[Sequence[float]], finished: Sequence[bool],
                pad_token_id: int) -> Batch:
    """An engine's completions as the protocol's Batch: right-padded `response_ids`, `response_mask`, `sampler_logp`
    `[B, T]` and `finished` `[B]`."""
    B, T = len(ids), max([len(row) for row in ids] + [1])
    ids_B_T = torch.full((B, T), pad_token_id, dtype=torch.long)
    logp_B_T = torch.zeros((B, T))
    mask_B_T = torch.zeros((B, T), dtype=torch.long)
    for i, (row, logp) in enumerate(zip(ids, logps)):
        ids_B_T[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        logp_B_T[i, : len(row)] = torch.tensor(logp, dtype=torch.float32)
        mask_B_T[i, : len(row)] = 1
    return Batch({"response_ids": ids_B_T, "response_mask": mask_B_T, "sampler_logp": logp_B_T,
                  "finished": torch.tensor(list(finished), dtype=torch.bool)})


def special_ids(model_dir) -> dict[str, int]:
    """The EOS and pad ids of a local model directory's tokenizer, as an engine sampler's constructor takes them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
