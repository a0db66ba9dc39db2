"""Ctrl-C while the session changes its state: the step, update or save in progress finishes first (a step is
recorded, and in `run()` the checkpoint due after it is written), so that the step count, the optimizer's steps, the
sampler's weights, the data position, the logs and the checkpoints always agree.

During a step or an update, a second Ctrl-C within `ABORT_WINDOW_S` of the first stops at once; the session then
refuses to go on (its bookkeeping may not match its weights) and says to restore a checkpoint. A save is never
stopped midway: that would cut a file torch is writing (or end the whole process from inside torch's writer), so
every Ctrl-C during a save waits for it. Signals reach only the main thread, so a step run from another thread (a
dashboard's) is not guarded: stop that one with `request_stop()`.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager

ABORT_WINDOW_S = 1.0
"""A second Ctrl-C within this many seconds of the first aborts the step or update at once."""


class StepAborted(KeyboardInterrupt):
    """Ctrl-C twice: the step or update in progress was stopped midway; the session must be restored from a
    checkpoint."""


@contextmanager
def finishes_first(what: str, *, abortable: bool = True):
    """Hold a Ctrl-C (SIGINT) until the block ends, then raise KeyboardInterrupt saying `what` finished first. In an
    `abortable` block a second one within `ABORT_WINDOW_S` raises `StepAborted` at once; in another one it is held
    too. A block inside another is part of it: the outer one holds the signal and raises it once, at its end (the
    inner one only says whether it may be stopped midway). Outside the main thread: nothing held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = signal.getsignal(signal.SIGINT)
    if isinstance(outer, _Hold):
        before, outer.abortable = outer.abortable, abortable
        try:
            yield
        finally:
            outer.abortable = before
        return
    hold = _Hold(what, abortable)
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, outer)
    if hold.received:
        raise KeyboardInterrupt(f"interrupted: {what} finished first")


class _Hold:
    """The SIGINT handler of the outermost guarded block: it keeps the times of the Ctrl-Cs it held (the block's
    state lives here, so that nothing outlives the block)."""

    def __init__(self, what: str, abortable: bool):
        self.what, self.abortable, self.received = what, abortable, []

    def __call__(self, signum, frame) -> None:
        now = time.monotonic()
        if self.abortable and self.received and now - self.received[-1] < ABORT_WINDOW_S:
            raise StepAborted(f"interrupted twice during {self.what}: stopped midway, so this session's step count, "
                              f"weights, sampler and data position may disagree; Session.restore(...) a checkpoint")
        self.received.append(now)
        then = (f"Ctrl-C again within {ABORT_WINDOW_S:g} s to stop at once" if self.abortable
                else "it cannot be stopped midway")
        print(f"rlbench: finishing {self.what} before stopping ({then})", file=sys.stderr, flush=True)
