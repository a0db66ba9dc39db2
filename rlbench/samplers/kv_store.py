"""The K/V of finished contexts kept across sampler calls, for an episode's next turn (`SamplingParams.keep_cache`).

An entry is the K/V `[layers, KV, length, D]` of a token sequence: a prompt's real tokens and what a row
generated before its stop token (the stop token itself has no K/V yet). A later prompt that starts with a
stored sequence copies that K/V in and prefills only the rest.

Look-up is linear in the prompt's length: one cumulative sum gives the hash of every prefix of the prompt (a
random int64 weight per position, products and sums wrapping), probed in a dict at each stored length, longest
first; a hit is then compared token by token. Eviction: an entry leaves when a call uses it (its K/V lives on
in the decoder, and in the longer entry the row stores if it stops again), when it was not used within the
2 calls after the one that stored it, and all leave on `clear` (new weights, or a new dtype or device).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

MAX_IDLE_CALLS = 2
"""Calls an entry waits for its continuation before it is dropped."""


@dataclass
class _Entry:
    ids: list[int]
    K: torch.Tensor
    V: torch.Tensor
    call: int
    """The call that stored it."""


class KVStore:
    def __init__(self):
        self.entries: dict[tuple[int, int], _Entry] = {}  # (length, hash of the ids) -> entry
        self.lengths: Counter[int] = Counter()  # how many entries have each length
        self.calls = 0  # calls ended so far: the current call's index
        self.where: tuple[torch.dtype, torch.device] | None = None  # dtype and device of the stored K/V
        self._generator = torch.Generator().manual_seed(0)
        self._weights = torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.lengths.clear()

    def take(self, prompts: list[list[int]], dtype: torch.dtype,
             device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per prompt, the K/V of the longest stored sequence that it starts with and that leaves at least its
        last token to compute, or None; the entries given out are dropped."""
        if self.where != (dtype, device):
            self.clear()
            self.where = (dtype, device)
        keys = [self._longest_prefix(ids) for ids in prompts] if self.entries else [None] * len(prompts)
        found = [None if key is None else (self.entries[key].K, self.entries[key].V) for key in keys]
        for key in {key for key in keys if key is not None}:
            self._drop(key)
        return found

    def store(self, ids: list[int], K: torch.Tensor, V: torch.Tensor) -> None:
        """Keep the K/V `[layers, KV, len(ids), D]` of the sequence `ids` (replacing one of the same ids)."""
        if self.where != (K.dtype, K.device):
            self.clear()
            self.where = (K.dtype, K.device)
        key = (len(ids), self._hash(ids))
        if key not in self.entries:
            self.lengths[len(ids)] += 1
        self.entries[key] = _Entry(ids, K, V, self.calls)

    def end_call(self) -> None:
        """A sampler call ended: drop the entries whose 2 calls to be used in have gone by."""
        if self.entries:
            for key in [key for key, entry in self.entries.items() if entry.call <= self.calls - MAX_IDLE_CALLS]:
                self._drop(key)
        self.calls += 1

    def _longest_prefix(self, ids: list[int]) -> tuple[int, int] | None:
        """The key of the longest entry that `ids` starts with and is longer than, or None."""
        lengths = sorted((n for n in self.lengths if n < len(ids)), reverse=True)
        if not lengths:
            return None
        hashes = self._prefix_hashes(ids)[torch.tensor(lengths) - 1].tolist()
        for key in zip(lengths, hashes):
            entry = self.entries.get(key)
            if entry is not None and entry.ids == ids[: key[0]]:
                return key
        return None

    def _drop(self, key: tuple[int, int]) -> None:
        del self.entries[key]
        self.lengths[key[0]] -= 1
        if not self.lengths[key[0]]:
            del self.lengths[key[0]]

    def _hash(self, ids: list[int]) -> int:
        return int(self._prefix_hashes(ids)[-1])

    def _prefix_hashes(self, ids: list[int]) -> torch.Tensor:
        """The hash of `ids[:i + 1]` at i: sum over positions j <= i of weight_j * ids_j, wrapping at 64 bits."""
        if len(ids) > len(self._weights):  # new weights for the new positions; the old ones stay
            more = max(len(ids), 2 * len(self._weights)) - len(self._weights)
            self._weights = torch.cat([self._weights, torch.randint(
                -(2**63), 2**63 - 1, (more,), dtype=torch.long, generator=self._generator)])
        return (torch.tensor(ids, dtype=torch.long) * self._weights[: len(ids)]).cumsum(0)
