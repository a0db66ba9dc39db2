"""`rollout_mode="async"`: rollout workers that generate while the trainer trains, at most `max_staleness` updates behind.

Each prompt group is a **ticket**: its index (the order tickets are drawn and trained in), its example and its
sampling seed. One feeder thread per rollout worker hands the worker tickets and puts the finished groups in a
buffer; `take(n)` gives the trainer the next n groups in ticket order, waiting (never dropping work) while
sampling is behind.

**The staleness bound.** Versions count the policy's updates: weights pushed after update v carry version v.
A step consumes at least one step's groups (`groups_per_step` = P; dynamic sampling takes more), so when
version v is pushed with `base` groups consumed so far, ticket i is trained no later than at version
v + floor((i - base) / P) (`_trained_by`, which also counts what the step in progress has taken). A feeder
starts ticket i only when that is within K = `max_staleness` of the weights the worker then holds: without
dynamic sampling, i < base + (K + 1) P (the worker takes pushed weights before it starts, and raises if it
holds older ones than the ticket needs). So a group's oldest token is at most K updates old when trained, and
sampling pauses when the buffer holds all the groups that could be trained within K. The tickets a step is
waiting for are always admitted (they are trained by the current weights). `Session` checks the bound on every
batch it takes.

**Faults.** A worker that dies (a Ray actor killed, out of memory) is replaced by a new one with the newest
weights, behind the same handle (`SamplerHandle.replace`: a call through it meanwhile, an evaluation, waits for the new
one); its tickets are drawn again first, under their own indices: no group is lost or trained twice.
**Checkpoints** keep the finished groups and the prompts of those in flight (`snapshot` / `restore`).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rlbench.batch import Batch
from rlbench.workers.cluster import WorkerDied


@dataclass(frozen=True)
class Ticket:
    index: int
    """Its place in the order groups are drawn and trained in."""
    example: dict
    seed: int


class AsyncRollouts:
    """The buffer of finished groups, the feeder threads of the rollout workers, and the staleness bound.

    `workers`: rollout worker handles (`SamplerHandle`s whose sampler is a `PartialRollouts`); `draw()` gives the
    next example and its seed (advancing the session's data position); `restart(i)` replaces dead worker i behind
    its handle, with the newest weights pushed to it; `sample(handle, tickets, min_version, trained_by)` has a worker
    roll the tickets out (a Batch of their groups, prompt-major, with `token_version`) holding weights of at least
    `min_version`, the oldest ticket to be trained by version `trained_by`."""

    def __init__(self, workers: list, *, max_staleness: int, groups_per_step: int, draw: Callable[[], tuple[dict, int]],
                 sample: Callable, restart: Callable[[int], None], version: int = 0):
        self.workers = list(workers)
        self.max_staleness, self.groups_per_step = max_staleness, groups_per_step
        self._draw, self._sample, self._restart = draw, sample, restart
        self.version = version
        """The newest weights version pushed to the workers."""
        self.consumed = 0
        """Tickets trained on (taken) so far."""
        self._base = 0  # tickets consumed when `version` was pushed
        self._wanted = 0  # tickets below this one are taken by the step in progress (trained by `version`)
        self._next_index = 0
        self._retry: list[Ticket] = []  # tickets of a dead worker, or of a checkpoint's in-flight groups: first
        self._flight: dict[int, list[Ticket]] = {}  # worker -> the tickets it is rolling out
        self._done: dict[int, Batch] = {}  # ticket index -> its finished group
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._paused = 0
        self._error: BaseException | None = None
        self.waits = {"trainer_wait_s": 0.0, "sampler_wait_s": 0.0}
        """Since the last `take_stats()`: seconds the trainer waited for groups, and seconds the workers waited
        for the bound to let them start (summed over workers)."""
        self._restarts = 0  # the workers' restarts counted by `take_stats` so far

    # ------------------------------------------------------------------------------- the trainer
    def start(self) -> None:
        """Start the feeder threads (idempotent): sampling begins."""
        with self._cond:
            if self._threads or self._closing:
                return
            self._threads = [threading.Thread(target=self._feed, args=(w,), name=f"rlbench-rollout-{w}", daemon=True)
                             for w in range(len(self.workers))]
        for thread in self._threads:
            thread.start()
        atexit.register(_stop_at_exit, weakref.ref(self))  # a session never closed: no feeder mid-rollout at exit

    def take(self, groups: int) -> Batch:
        """The next `groups` groups in ticket order, waiting for them; `group_ids` 0..groups-1, `ticket` [B]."""
        self.start()
        wanted = range(self.consumed, self.consumed + groups)
        start = time.perf_counter()
        with self._cond:
            self._wanted = wanted.stop
            self._cond.notify_all()
            while not all(i in self._done for i in wanted):
                if self._error is not None:
                    raise RuntimeError(f"a rollout worker failed: {self._error}") from self._error
                if self._closing:
                    raise RuntimeError("the rollout workers were closed (the session was closed)")
                self._cond.wait(1.0)
            parts = [self._done.pop(i) for i in wanted]
            self.consumed += groups
            occupancy = len(self._done)
            in_flight = sum(len(t) for t in self._flight.values())
            self._cond.notify_all()
        self.waits["trainer_wait_s"] += time.perf_counter() - start
        batch = Batch.concat(parts)
        sizes = [len(p) for p in parts]
        return batch.with_columns(
            group_ids=torch.arange(groups).repeat_interleave(torch.tensor(sizes)),
            ticket=torch.tensor(list(wanted)).repeat_interleave(torch.tensor(sizes))).with_meta(
            buffer_groups=occupancy, in_flight_groups=in_flight)

    def push(self, weights, version: int) -> None:
        """New weights to every worker (taken at their next token), then let the bound move on."""
        for handle in self.workers:
            try:
                handle.push_weights(weights, version)
            except WorkerDied:  # the new worker that replaces it takes them first
                pass
        with self._cond:
            self.version, self._base = version, self.consumed
            self._cond.notify_all()
        self.start()

    @contextmanager
    def paused(self):
        """No ticket starts within the block (those in flight finish): held-out evaluation has the workers' time,
        and a training clock that leaves evaluation out gives sampling no free time."""
        with self._cond:
            self._paused += 1
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def take_stats(self) -> dict[str, float]:
        """The waits and the workers restarted since the last call, and reset them."""
        with self._cond:
            restarts = sum(handle.restarts for handle in self.workers)
            stats = self.waits | {"restarts": restarts - self._restarts}
            self.waits, self._restarts = dict.fromkeys(self.waits, 0.0), restarts
        return stats

    def close(self) -> None:
        """Stop the feeders (a rollout in progress finishes or fails first, as its worker is ended; one waiting for
        weights, paced by the trainer, goes on without them)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for handle in self.workers:
            try:
                handle.release()
            except WorkerDied:
                pass

    def join(self, timeout: float = 30.0) -> None:
        for thread in self._threads:
            thread.join(timeout)

    # ------------------------------------------------------------------------------ checkpoints
    def snapshot(self) -> dict:
        """What a checkpoint keeps: the finished groups not yet trained (as they are) and the in-flight and retried
        tickets (to draw again), with the counters. Hold `frozen()` around it and the session state's save."""
        return {"consumed": self.consumed, "next_index": self._next_index, "version": self.version,
                "done": {i: {"tensors": b.tensors, "lists": b.lists, "meta": b.meta} for i, b in self._done.items()},
                "retry": sorted([(t.index, t.example, t.seed) for t in self._retry + [
                    t for flight in self._flight.values() for t in flight]])}

    def frozen(self):
        """Hold the buffer still (no ticket drawn or finished): a checkpoint's consistent moment."""
        return self._cond

    def restore(self, snapshot: dict) -> None:
        """Continue from a checkpoint's `snapshot` (before `start`): its groups first, then its in-flight tickets."""
        with self._cond:
            self.consumed = self._base = snapshot["consumed"]
            self._next_index, self.version = snapshot["next_index"], snapshot["version"]
            self._done = {int(i): Batch(**b) for i, b in snapshot["done"].items()}
            self._retry = [Ticket(i, example, seed) for i, example, seed in snapshot["retry"]]

    # -------------------------------------------------------------------------------- feeders
    def _feed(self, w: int) -> None:
        while True:
            tickets, min_version, trained_by = self._admit(w)
            if not tickets:
                return
            try:
                try:
                    batch = self._sample(self.workers[w], tickets, min_version, trained_by)
                except WorkerDied:
                    if not self._replace(w, tickets):
                        return
                    continue
            except BaseException as error:  # surfaces at the trainer's next take()
                with self._cond:
                    self._flight.pop(w, None)
                    if not self._closing:
                        self._error = error
                    self._cond.notify_all()
                return
            rows = len(batch) // len(tickets)
            with self._cond:
                for j, ticket in enumerate(tickets):
                    self._done[ticket.index] = batch[j * rows: (j + 1) * rows]
                self._flight.pop(w, None)
                self._cond.notify_all()

    def _admit(self, w: int) -> tuple[list[Ticket], int, int]:
        """Wait until the bound lets worker w start a ticket; give it up to its share of a step's tickets, the
        weights version the newest of them needs and the version that trains the oldest. ([], 0, 0) when closing."""
        share = -(-self.groups_per_step // len(self.workers))
        start = time.perf_counter()
        with self._cond:
            while not self._closing and self._error is None and (self._paused or not self._admissible(self._peek())):
                self._cond.wait()
            self.waits["sampler_wait_s"] += time.perf_counter() - start
            if self._closing or self._error is not None:
                return [], 0, 0
            tickets = []
            while len(tickets) < share and self._admissible(self._peek()):
                tickets.append(self._pop())
            self._flight[w] = tickets
            indices = [t.index for t in tickets]
            return (tickets, max(self._trained_by(max(indices)) - self.max_staleness, 0),
                    self._trained_by(min(indices)))

    def _trained_by(self, index: int) -> int:
        """The latest weights version ticket `index` can be trained by. The step in progress trains `version`; it has
        taken `consumed - base` tickets (0, or P or more: it may take more) and each later step takes P or more, so
        ticket i is trained by version + (i - base') // P, base' = max(base, consumed - P); sooner if the step in
        progress waits for it."""
        if index < self._wanted:
            return self.version
        return self.version + (index - max(self._base, self.consumed - self.groups_per_step)) // self.groups_per_step

    def _admissible(self, index: int) -> bool:
        return self._trained_by(index) - self.version <= self.max_staleness

    def _peek(self) -> int:
        return min(t.index for t in self._retry) if self._retry else self._next_index

    def _pop(self) -> Ticket:
        if self._retry:
            ticket = min(self._retry, key=lambda t: t.index)
            self._retry.remove(ticket)
            return ticket
        example, seed = self._draw()
        self._next_index += 1
        return Ticket(self._next_index - 1, example, seed)

    def _replace(self, w: int, tickets: list[Ticket]) -> bool:
        """Worker w died: its tickets go back first, a new worker takes its place with the newest weights.
        False when closing (the session ended its workers)."""
        with self._cond:
            self._flight.pop(w, None)
            self._retry += tickets
            if self._closing:
                return False
        self._restart(w)
        return True


def _stop_at_exit(ref: weakref.ref) -> None:
    rollouts = ref()
    if rollouts is not None:
        rollouts.close()
        rollouts.join()
