"""Ctrl-C during a step: the step finishes (and is recorded) first, so that the step count, the optimizer's steps,
the sampler's weights, the data position and the logs always agree.

A second Ctrl-C within `ABORT_WINDOW_S` of the first stops at once; the session then refuses to go on (its
bookkeeping may not match its weights) and says to restore a checkpoint. Signals reach only the main thread,
so a step run from another thread (a dashboard's) is not guarded: stop that one with `request_stop()`.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager

ABORT_WINDOW_S = 1.0
"""A second Ctrl-C within this many seconds of the first aborts the step at once."""


class StepAborted(KeyboardInterrupt):
    """Ctrl-C twice: the step in progress was stopped midway; the session must be restored from a checkpoint."""


@contextmanager
def step_finishes_first(what: str):
    """Hold a first SIGINT (Ctrl-C) until the block ends, then raise KeyboardInterrupt; a second one within
    `ABORT_WINDOW_S` raises `StepAborted` at once. Outside the main thread: nothing held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[float] = []

    def hold(signum, frame):
        now = time.monotonic()
        if received and now - received[-1] < ABORT_WINDOW_S:
            raise StepAborted(f"interrupted twice during {what}: stopped midway, so this session's step count, "
                              f"weights, sampler and data position may disagree; Session.restore(...) a checkpoint")
        received.append(now)
        print(f"rlbench: finishing {what} before stopping (Ctrl-C again within {ABORT_WINDOW_S:g} s to stop at once)",
              file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt(f"interrupted: {what} finished and was recorded first")
