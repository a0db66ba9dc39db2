"""One call at a time: a session refuses a training, sampling or saving call while another thread is inside one.

The dashboard trains in a background thread (`run()`); a notebook cell meanwhile calling `step()` or `evaluate()`
would share the sampler's decoding caches and the policy's gradients with the run: a corrupted rollout, a dead run.
So the first thread in holds the session until its outermost call returns; its own nested calls (`step()` calls
`rollout()`) go on, and so do the threads of the rollout modes (named `rlbench-rollout...`: rl.Overlap's next batch,
rl.Async's feeders), which work for the call in progress. Another thread's call raises, saying which call holds the
session and how to wait for it or stop it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

HELPERS = "rlbench-rollout"
"""The name prefix of the threads the rollout modes start (they call the session for the call in progress)."""


class Calls:
    """Who is inside a session's calls: the holding thread, what it called, and how deep."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holder: threading.Thread | None = None
        self._what = ""
        self._depth = 0

    @contextmanager
    def enter(self, what: str) -> Iterator[None]:
        me = threading.current_thread()
        if me.name.startswith(HELPERS):
            yield
            return
        with self._lock:
            if self._holder not in (None, me):
                raise RuntimeError(
                    f"{what}: the session is busy with {self._what}() in thread {self._holder.name!r} (a dashboard's "
                    f"or your own background run?), and one call runs at a time (two would share the sampler's caches "
                    f"and the policy's gradients). Wait for it to end (dash.wait() under the dashboard), or ask it "
                    f"to stop after its step with session.request_stop()")
            if self._holder is None:
                self._holder, self._what = me, what
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._holder, self._what = None, ""


def one_at_a_time(method: Callable) -> Callable:
    """A `Session` method that holds the session (`Calls.enter`) while it runs."""
    @functools.wraps(method)
    def held(session, *args, **kwargs):
        with session.calls.enter(method.__name__):
            return method(session, *args, **kwargs)
    return held
