"""A sampler slowed to a chosen decoding speed: the sampler-bound regime of GPU recipes, at toy size on a CPU.

On a GPU recipe (responses of 1-4k tokens) sampling a step takes several times its update (the GPU check's GRPO steps
in `benchmarks/results/gpu/check.json`: rollout 20.4-21.8 s, update 4.6-6.3 s), so an asynchronous run's rollout
worker is always generating when new weights arrive, and rows take them mid-generation (partial rollouts). A built-in tiny model answers in a few tokens and
its whole step's sampling takes a fraction of an update: the worker is idle when weights arrive, and no row is
ever partial. `Paced(sampler, seconds_per_token)` makes each decoding step take at least that long (the tokens,
log-probs and seeds are the wrapped sampler's own), so the staleness, the trainer's waits and the partial rollouts
of that regime can be studied on the tiny models.

A pace in seconds races the trainer's clock: on a slower or busier machine the update outlasts the answers and no
row is partial. `Paced(sampler, tokens_per_update=u)` states the regime in tokens instead, the same on any machine:
in an asynchronous run, a rollout that newer weights will train draws u decoding steps under each weights version
and then waits for the next one (`rl.samplers.PartialRollouts`), as if each update took the time of u tokens. Every
row longer than u tokens is then partial, with exactly u tokens under the older weights.
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Sequence

from rlbench.batch import Batch
from rlbench.samplers.base import SamplingParams


class Paced:
    """A Sampler (`generate`, `load_weights`, `state_dict`) drawing what `sampler` draws, at most one decoding step
    per `seconds_per_token` seconds, and in an asynchronous run at most `tokens_per_update` decoding steps per weights
    version of a rollout that newer weights will train. `sampler` must be interruptible (its `generate` takes
    `interrupt` and checks it after each token, as the HF sampler does): the pause is taken at that check, so new
    weights pushed during a pause are taken at the next token."""

    def __init__(self, sampler, seconds_per_token: float = 0.0, *, tokens_per_update: int | None = None):
        if seconds_per_token < 0:
            raise ValueError(f"seconds_per_token must be >= 0, got {seconds_per_token}")
        if tokens_per_update is not None and tokens_per_update < 1:
            raise ValueError(f"tokens_per_update must be >= 1 (or None), got {tokens_per_update}")
        if "interrupt" not in inspect.signature(getattr(sampler, "generate", lambda: None)).parameters:
            raise TypeError(f"Paced needs a sampler whose generate() takes interrupt= (checked after each token, as "
                            f"HFSampler's), not {type(sampler).__name__}")
        self.sampler = sampler
        self.seconds_per_token = seconds_per_token
        self.tokens_per_update = tokens_per_update
        """Read by the rollout worker around it (`PartialRollouts`), which does the waiting."""
        self.pad_token_id = sampler.pad_token_id

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *,
                 interrupt: threading.Event | None = None, images: Sequence[dict] | None = None) -> Batch:
        clock = _Clock(interrupt, self.seconds_per_token)
        given = {"images": images} if images is not None else {}  # (a text-only sampler takes none)
        out = self.sampler.generate(prompt_ids, params, interrupt=clock, **given)
        clock.wait_until(out["response_ids"].shape[1])  # the last step (no check after it) takes its time too
        return out

    def load_weights(self, weights) -> None:
        self.sampler.load_weights(weights)

    def state_dict(self):
        return self.sampler.state_dict()


class _Clock:
    """The interrupt flag a paced call hands the sampler: each check waits for the next step's time first."""

    def __init__(self, interrupt: threading.Event | None, seconds_per_token: float):
        self.interrupt, self.seconds_per_token = interrupt, seconds_per_token
        self.start, self.steps = time.perf_counter(), 0

    def is_set(self) -> bool:
        self.steps += 1
        self.wait_until(self.steps)
        return self.interrupt is not None and self.interrupt.is_set()

    def wait_until(self, steps: int) -> None:
        left = self.start + steps * self.seconds_per_token - time.perf_counter()
        if left > 0:
            time.sleep(left)
