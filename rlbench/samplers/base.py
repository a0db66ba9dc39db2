"""The Sampler protocol: token ids in, completions with the log-probs they were sampled with out."""

from __future__ import annotations

from dataclasses import dataclass
import warnings
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
