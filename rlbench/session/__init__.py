"""The controller's loop and what it keeps: `Session` (`loop.py`: rollout → score → advantage → update, `step()`,
`run()`), its counters and data order (`state.py`), the rollout modes and their sources (`sources.py`, with rl.Overlap's
background batch in `prefetch.py` and rl.Async's buffer in `async_buffer.py`), save / restore and worker recovery
(`resume.py`), a step's metrics (`metrics.py`), start-up checks (`preflight.py`), Ctrl-C (`interrupts.py`) and one call
at a time (`calls.py`)."""

from rlbench.session.loop import Session

__all__ = ["Session"]
