"""Partial rollouts: a sampler that takes new weights while it generates, and says which weights drew each token.

An asynchronous run's rollout worker (`rollout_mode="async"`) generates while the trainer updates. When new
weights arrive in the middle of a generation, the generation is not restarted: every row stops after the token
it is drawing (the HF sampler checks an interrupt flag each token; a sampler without one generates in chunks of
`chunk_tokens` and is interrupted between them), the weights are copied in, and each unfinished row goes on
from its prompt and what it drew so far, its K/V recomputed under the new weights (AReaL's interruptible
rollouts, arXiv:2505.24298 §4). `token_version [B, T]` records the weights version that drew each token; a
group's staleness is that of its oldest token.

The worker is the only place weights change, and only between the sampler's calls: `push_weights` (any thread)
leaves them pending and raises the interrupt; the generating thread copies them in (the world stops for the
copy alone). Other callers of `generate` (held-out evaluation) go before the next piece of a rollout in
progress, which they interrupt.

A sampler with `tokens_per_update` (`rl.samplers.Paced(..., tokens_per_update=u)`) is paced by the trainer instead
of the clock: a rollout that will be trained by newer weights than those it holds draws u tokens under each version,
then waits for the next one (the sampler-bound regime of long responses, the same on any machine).
"""

from __future__ import annotations

import inspect
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Sequence

import torch

from rlbench.batch import Batch
from rlbench.samplers.base import SamplingParams


class PartialRollouts:
    """A Sampler (`generate`, `load_weights`, `state_dict`) around another, adding interruptible, versioned
    rollouts (`rollout`) and weights handed over from any thread (`push_weights`)."""

    def __init__(self, sampler, *, chunk_tokens: int = 32, version: int = 0):
        self.sampler = sampler
        self.chunk_tokens = chunk_tokens
        """Tokens per call of a sampler that cannot be interrupted (vLLM): new weights wait at most this long."""
        self.version = version
        """The weights version the sampler holds (the policy's update count when they were pushed)."""
        self.interruptible = "interrupt" in inspect.signature(sampler.generate).parameters
        self.tokens_per_update: int | None = getattr(sampler, "tokens_per_update", None)
        """Tokens a rollout draws under each weights version older than those that will train it, then waits for the
        next version (None: as fast as the sampler goes)."""
        self.stats = {"weight_loads": 0, "load_s": 0.0, "interrupted_rows": 0}
        """Weight copies, the seconds they took, and rows that went on with newer weights than they started with."""
        self._pending: tuple[object, int] | None = None  # (weights, version) not copied in yet
        self._interrupt = threading.Event()
        self._turn = threading.Condition()  # one sampler call at a time; callers of `generate` go first
        self._busy, self._waiting = False, 0
        self._released = False  # set by release(): no rollout waits for weights any more

    # ---------------------------------------------------------------------------------- weights
    def push_weights(self, weights, version: int) -> None:
        """New weights (a state dict of tensors or numpy arrays, not modified afterwards): copied in before the
        sampler's next call, which a rollout in progress makes after the token it is drawing."""
        with self._turn:
            if version < max(self.version, self._pending[1] if self._pending else 0):
                return  # older than what it holds or will hold (pushes from two threads crossed)
            self._pending = (weights, version)
            self._turn.notify_all()  # a rollout waiting for newer weights (tokens_per_update) goes on
        self._interrupt.set()

    def release(self) -> None:
        """No rollout waits for new weights from now on (the session is closing: none will come)."""
        with self._turn:
            self._released = True
            self._turn.notify_all()

    def load_weights(self, weights, version: int | None = None) -> None:
        """Copy weights in now (between two calls of a rollout in progress); `version` None keeps the number."""
        self.push_weights(weights, self.version if version is None else version)
        with self._calling(first=True):
            pass  # the turn itself copies them in

    def state_dict(self) -> dict[str, torch.Tensor]:
        with self._calling(first=True):
            return self.sampler.state_dict()

    def _take_pending(self) -> None:
        """In the calling thread, holding the turn: copy pending weights in."""
        self._interrupt.clear()  # a push after this line interrupts the next call
        with self._turn:
            pending, self._pending = self._pending, None
        if pending is not None:
            start = time.perf_counter()
            self.sampler.load_weights(pending[0])
            self.version = pending[1]
            self.stats["weight_loads"] += 1
            self.stats["load_s"] += time.perf_counter() - start

    # --------------------------------------------------------------------------------- sampling
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *,
                 images: Sequence[dict] | None = None) -> Batch:
        """The Sampler protocol, under the newest weights pushed; a rollout in progress pauses for it. `images`: per
        prompt, its pixels (a vision-language model's; passed to the sampler's own `generate`)."""
        with self._calling(first=True):
            return self.sampler.generate(prompt_ids, params, **_with(images))

    def rollout(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, min_version: int = 0,
                images: Sequence[dict] | None = None, trained_by: int | None = None) -> Batch:
        """`params.n` completions of each prompt, like `generate`, plus `token_version [B, T]` (the weights version
        that drew each token; 0 on padding). Weights pushed meanwhile are taken at the next token and the unfinished
        rows go on under them (a row with images goes on with its prompt's). RuntimeError if the weights held at the
        start are older than `min_version` (the controller pushes them before it asks for a rollout that needs
        them). `trained_by`: the weights version that trains the oldest of these prompts (every version before it
        comes without them); with `tokens_per_update`, weights older than it draw that many tokens, then the rollout
        waits for the next version."""
        n, T = params.n, params.max_new_tokens
        B = len(prompt_ids) * n
        prompts = [[int(t) for t in prompt_ids[b // n]] for b in range(B)]
        seeds = [params.seeds[b // n] if params.seeds is not None else params.seed for b in range(B)]
        drawn: list[list[int]] = [[] for _ in range(B)]
        logp: list[list[float]] = [[] for _ in range(B)]
        versions: list[list[int]] = [[] for _ in range(B)]
        finished = [False] * B
        rows = list(range(B))
        first, held = True, (-1, 0)  # held: (version, decoding steps drawn under it)
        while rows:
            with self._calling(first=False):
                if first and self.version < min_version:
                    raise RuntimeError(f"rollout needs weights of version >= {min_version}, the sampler holds "
                                       f"{self.version} and none newer were pushed")
                version = self.version
                held = held if held[0] == version else (version, 0)
                paced = self.tokens_per_update is not None and trained_by is not None and version < trained_by
                if first:  # the first piece: exactly the sampler's own call (shared prompts, the caller's seeds)
                    out = self._call(prompt_ids, replace(params, max_new_tokens=self._piece(T, paced)), images)
                    lengths_B = out["response_mask"].sum(-1)
                    if bool((out["finished"] | (lengths_B >= T)).all()):  # nothing to go on with: as it came
                        return out.with_columns(token_version=out["response_mask"] * version)
                else:  # each unfinished row from its own context, with a seed of its own and of its length
                    room = T - len(drawn[rows[0]])
                    out = self._call([prompts[b] + drawn[b] for b in rows], replace(
                        params, n=1, max_new_tokens=self._piece(room, paced, held[1]),
                        seeds=tuple(_continuation_seed(seeds[b], b, len(drawn[b])) for b in rows)),
                        [images[b // n] for b in rows] if images is not None else None)
                    self.stats["interrupted_rows"] += sum(versions[b][0] != version for b in rows)
            ids = out["response_ids"].tolist()
            lengths = out["response_mask"].sum(-1).tolist()
            sampled = out["sampler_logp"].tolist()
            for j, b in enumerate(rows):
                k = min(int(lengths[j]), T - len(drawn[b]))
                drawn[b] += ids[j][:k]
                logp[b] += sampled[j][:k]
                versions[b] += [version] * k
                finished[b] = bool(out["finished"][j]) and k == int(lengths[j])
            rows = [b for b in rows if not finished[b] and len(drawn[b]) < T]
            first = False
            held = (version, held[1] + out["response_ids"].shape[1])
            if rows and paced and held[1] >= self.tokens_per_update:
                self._await_newer(version)
        return self._batch(drawn, logp, versions, finished)

    def _piece(self, room: int, paced: bool = False, drawn: int = 0) -> int:
        """A call's tokens: what is left, in chunks for a sampler that cannot be interrupted; a paced rollout's
        share of the version it holds."""
        piece = room if self.interruptible else min(room, self.chunk_tokens)
        return min(piece, max(self.tokens_per_update - drawn, 1)) if paced else piece

    def _await_newer(self, version: int) -> None:
        """Wait (not holding the turn: evaluation goes on, and may copy them in) until weights newer than `version`
        are pushed, or `release()`."""
        with self._turn:
            while not (self._released or self.version > version
                       or (self._pending is not None and self._pending[1] > version)):
                self._turn.wait()

    def _call(self, prompt_ids, params: SamplingParams, images: Sequence[dict] | None = None) -> Batch:
        if self.interruptible:
            return self.sampler.generate(prompt_ids, params, interrupt=self._interrupt, **_with(images))
        return self.sampler.generate(prompt_ids, params, **_with(images))

    def _batch(self, drawn, logp, versions, finished) -> Batch:
        B, T = len(drawn), max([len(d) for d in drawn] + [1])
        pad = getattr(self.sampler, "pad_token_id", 0)
        ids_B_T = torch.full((B, T), pad, dtype=torch.long)
        logp_B_T = torch.zeros(B, T)
        version_B_T = torch.zeros(B, T, dtype=torch.long)
        mask_B_T = torch.zeros(B, T, dtype=torch.long)
        for b, (d, l, v) in enumerate(zip(drawn, logp, versions)):
            ids_B_T[b, : len(d)] = torch.tensor(d, dtype=torch.long)
            logp_B_T[b, : len(d)] = torch.tensor(l)
            version_B_T[b, : len(d)] = torch.tensor(v, dtype=torch.long)
            mask_B_T[b, : len(d)] = 1
        return Batch({"response_ids": ids_B_T, "response_mask": mask_B_T, "sampler_logp": logp_B_T,
                      "finished": torch.tensor(finished, dtype=torch.bool), "token_version": version_B_T})

    # ----------------------------------------------------------------------------------- turns
    @contextmanager
    def _calling(self, first: bool):
        """Hold the sampler for one call, new weights copied in first. `first` (a caller of `generate`): interrupt
        a rollout's piece in progress and go before its next one."""
        with self._turn:
            if first:
                self._waiting += 1
                self._interrupt.set()
            while self._busy or (not first and self._waiting):
                self._turn.wait()
            self._busy = True
            if first:
                self._waiting -= 1
        try:
            self._take_pending()
            yield
        finally:
            with self._turn:
                self._busy = False
                self._turn.notify_all()


def _with(images: Sequence[dict] | None) -> dict:
    """The `images=` argument of a sampler's `generate` when there are images (a text-only sampler has none)."""
    return {"images": images} if images is not None else {}


def _continuation_seed(seed: int, row: int, length: int) -> int:
    """The seed of a row's draws after an interruption: from its prompt's seed, the row and how far it got."""
    return (seed * 1_000_003 + row * 7_919 + length) % (2**62)
