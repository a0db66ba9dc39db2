"""rollout_mode="overlap": the next step's batch, sampled and scored while this step's update runs.

Its lifecycle: `during(update)` starts collecting the next batch and waits for it when the update ends (the
sampler takes the new weights only when idle); the next step `take()`s it. A failure while collecting
surfaces at `take()`, after the step that started it is recorded. `pending()` is what a checkpoint keeps,
`put()` what a restored session hands back; `close()` ends the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager

from rlbench.batch import Batch


class Prefetch:
    def __init__(self):
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rlbench-rollout")
        self._next: Future | None = None

    def take(self) -> Batch | None:
        """The batch collected during the last update (its error, if collecting failed), or None."""
        pending, self._next = self._next, None
        return None if pending is None else pending.result()

    @contextmanager
    def during(self, collect: Callable[[], Batch], set_before_backward: Callable | None):
        """Collect the next batch while the block (an update) runs. In one process (`set_before_backward`
        given: the policy's hook) collecting starts at the update's first backward: the sampler's many small
        ops and the forward contend for Python's GIL (a quarter more update time), the backward runs without it."""
        start = threading.Event()
        if set_before_backward is not None:
            set_before_backward(start.set)
        else:
            start.set()
        self._next = self._thread.submit(lambda: start.wait() and collect())
        try:
            yield
        finally:
            start.set()  # an update that failed before its backward
            wait([self._next])
            if set_before_backward is not None:
                set_before_backward(None)

    def pending(self) -> Batch | None:
        """The collected next batch, if collecting succeeded (what a checkpoint keeps)."""
        if self._next is None or self._next.exception() is not None:
            return None
        return self._next.result()

    def put(self, batch: Batch | None) -> None:
        """Make `batch` the next one (a restored checkpoint's), or forget any (None)."""
        self._next = None
        if batch is not None:
            self._next = Future()
            self._next.set_result(batch)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
