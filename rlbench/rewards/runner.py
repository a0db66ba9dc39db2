"""Scoring completions, in parallel and with a time limit per sample.

Every failure is recorded on its sample with the reason, never turned silently into a number:

    exception           "ZeroDivisionError: even operand"
    not an Exception    "KeyboardInterrupt raised by the reward", "SystemExit(3) raised by the reward"
    hang                "timed out after 2.0 s"
    NaN / inf           "reward 'score' is nan"
    wrong type          "reward 'score' must be a number, got str 'yes'"
    wrong count         "batched reward returned 3 scores for 4 samples"   (every sample of the batch)
    dead worker         "the reward's worker process died (exit code -9)"

With `on_error="raise"` the first failure stops scoring with a `RewardError` naming the sample; with
"zero" a failed sample scores 0 and keeps its reason in `Scores.error`.

Each call gets its own copy of its example (`own_copy`): a reward that writes into it changes neither the task's
data nor the next sample's.

Where rewards run:
- `workers=1`, no `timeout_s`: one after another in the calling thread (`breakpoint()` works in a reward).
  There a KeyboardInterrupt cannot be told from the user's Ctrl-C, so it stops scoring; elsewhere it is the
  reward's failure, recorded on its sample.
- threads (default otherwise): `workers` at a time. A sample past its `timeout_s` is recorded and left
  behind: a Python thread cannot be killed, so a reward stuck in a busy loop keeps a core (and the GIL)
  until it returns. Right for rewards that wait (HTTP judges, sandboxed subprocesses, a model on a GPU).
- `processes=True`: `workers` forked processes. A sample past its timeout is killed with its process,
  which is replaced. Right for CPU-bound pure-Python rewards (math-verify, sympy), which then also run in
  parallel. The reward, completions and examples reach the children by fork (closures defined in a
  notebook work); results come back pickled; side effects of a reward (a cache) stay in the child.
  Do not use it for rewards that run torch models (fork after torch's threads started is unsafe).

A Ctrl-C reaches the calling thread only (the worker processes ignore SIGINT): it stops scoring at once, the
worker processes are killed and the worker threads take no further sample.
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import numbers
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_connections
from typing import Any

Outcome = tuple[Any, "str | None"]
"""(value, None) when the reward returned, (None, reason) when it failed."""


class RewardError(RuntimeError):
    """A reward function failed on a sample and the session was told to stop (`on_reward_error="raise"`)."""


@dataclass
class Scores:
    score: list[float]
    """One float per sample (0.0 where the reward failed)."""
    components: dict[str, list[float]] = field(default_factory=dict)
    """Named parts of dict rewards (e.g. "acc"), one float per sample."""
    error: list[str | None] = field(default_factory=list)
    """Why scoring sample i failed, or None."""

    @property
    def failed(self) -> list[int]:
        """Indices of the samples whose reward failed."""
        return [i for i, e in enumerate(self.error) if e is not None]


def batched(reward: Callable[[Sequence[str], Sequence[dict]], Sequence]) -> Callable:
    """Mark `reward(completions, examples) -> list` as batched: `score_all` calls it once per batch.

    It must return one float or dict per sample; an element that is an Exception records that sample's
    failure. The runner's `timeout_s` then limits the whole call. (Reward models and judges are batched.)
    """
    reward.batched = True
    return reward


def score_all(reward: Callable[[str, dict], Any], completions: Sequence[str], examples: Sequence[dict], *,
              on_error: str = "raise", timeout_s: float | None = None, workers: int = 1,
              processes: bool = False) -> Scores:
    """Call `reward(completion, example)` on every sample (or a `batched` reward once on all of them).

    A reward returns a float (or int / bool), or a dict with a float "score" and other float components.
    An exception, a timeout, a non-finite value or another return type is a failure: with
    `on_error="raise"` a RewardError names the sample; with "zero" the sample scores 0 and keeps the reason.
    """
    if on_error not in ("raise", "zero"):
        raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
    if len(completions) != len(examples):
        raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
    if getattr(reward, "batched", False):
        outcomes = _call_batched(reward, completions, examples, timeout_s)
    else:
        outcomes = run_each(lambda i: reward(completions[i], own_copy(examples[i])), len(completions),
                            workers=workers, timeout_s=timeout_s, processes=processes)
    results = [_validate(value) if error is None else (None, error) for value, error in outcomes]
    return _collect(results, completions, on_error)


def _collect(results: list[Outcome], completions: Sequence[str], on_error: str) -> Scores:
    names = sorted({k for value, _ in results if value is not None for k in value if k != "score"})
    scores = Scores(score=[], components={k: [] for k in names}, error=[])
    for i, (value, error) in enumerate(results):
        if error is not None and on_error == "raise":
            failed = sum(e is not None for _, e in results)
            raise RewardError(f"reward failed on sample {i} (completion {completions[i][:200]!r}): {error}"
                              + (f" ({failed - 1} other samples failed too)" if failed > 1 else ""))
        value = value or {}
        scores.score.append(value.get("score", 0.0))
        for k in names:
            scores.components[k].append(value.get(k, 0.0))
        scores.error.append(error)
    return scores


def _validate(value) -> Outcome:
    """({name: float}, None) for a valid reward value, else (None, why not)."""
    parts = value if isinstance(value, dict) else {"score": value}
    if "score" not in parts:
        return None, f"a dict reward needs a 'score' key, got keys {sorted(parts)}"
    for name, v in parts.items():
        if not isinstance(v, numbers.Real):
            return None, f"reward {name!r} must be a number, got {type(v).__name__} {v!r:.100}"
        if not math.isfinite(v):
            return None, f"reward {name!r} is {v}"
    return {k: float(v) for k, v in parts.items()}, None


def own_copy(example: dict) -> dict:
    """A copy of `example` for one reward call. Its pictures (`images`, `videos`: read, never written, and large)
    are shared, not copied."""
    media = [value for key in ("images", "videos") for value in example.get(key) or ()]
    return copy.deepcopy(example, {id(value): value for value in media})


def _call_batched(reward, completions, examples, timeout_s) -> list[Outcome]:
    n = len(completions)
    [(values, error)] = run_each(lambda _: reward(completions, [own_copy(e) for e in examples]), 1, workers=1,
                                 timeout_s=timeout_s)
    if error is None and (isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__")):
        error = f"a batched reward must return a list of {n} scores, got {type(values).__name__}"
    elif error is None and len(values) != n:
        error = f"batched reward returned {len(values)} scores for {n} samples"
    if error is not None:
        return [(None, error)] * n
    return [(None, _reason(v)) if isinstance(v, BaseException) else (v, None) for v in values]


# ------------------------------------------------------------------------------ running with a time limit
def run_each(fn: Callable[[int], Any], n: int, *, workers: int = 1, timeout_s: float | None = None,
             processes: bool = False) -> list[Outcome]:
    """[(fn(i), None) or (None, why it failed) for i in range(n)], `workers` at a time, each within `timeout_s`."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if processes:
        return _run_in_processes(fn, n, workers, timeout_s)
    if workers == 1 and timeout_s is None:
        return [_call(fn, i, in_caller=True) for i in range(n)]
    return _run_in_threads(fn, n, workers, timeout_s)


def _call(fn, i, *, in_caller: bool = False) -> Outcome:
    """A reward's failure is reported on its sample, whatever it raised, except a KeyboardInterrupt `in_caller`:
    the calling thread is where the user's Ctrl-C lands, so there it stops scoring."""
    try:
        return fn(i), None
    except BaseException as e:  # an Exception, SystemExit, GeneratorExit, KeyboardInterrupt
        if in_caller and isinstance(e, KeyboardInterrupt):
            raise
        return None, _reason(e)


def _reason(e: BaseException) -> str:
    if isinstance(e, Exception):
        return f"{type(e).__name__}: {e}"
    arguments = f"({', '.join(map(repr, e.args))})" if e.args else ""  # SystemExit(3), not "SystemExit: 3"
    return f"{type(e).__name__}{arguments} raised by the reward"  # not the user's Ctrl-C, not an exit


def _timed_out(timeout_s: float) -> Outcome:
    return None, f"timed out after {timeout_s:g} s"


def _run_in_threads(fn, n: int, workers: int, timeout_s: float | None) -> list[Outcome]:
    """`workers` daemon threads take samples from a queue (a hung one never blocks interpreter exit). A sample
    past its timeout is recorded and its thread left behind, replaced by a new one; its late result is dropped.
    If the caller stops waiting (Ctrl-C), the queue is emptied: each thread ends when its reward returns."""
    results: list[Outcome | None] = [None] * n
    todo, finished = queue.SimpleQueue(), queue.SimpleQueue()
    for i in range(n):
        todo.put(i)
    started: dict[int, float] = {}  # sample -> when a worker took it

    def work():
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            started[i] = time.monotonic()
            finished.put((i, _call(fn, i)))

    def spawn():
        threading.Thread(target=work, daemon=True, name="reward-worker").start()

    try:
        for _ in range(min(workers, n)):
            spawn()
        while any(r is None for r in results):
            running = {i: t for i, t in list(started.items()) if results[i] is None}
            try:
                done = [finished.get(timeout=_time_left(running, timeout_s))]
                while not finished.empty():
                    done.append(finished.get())
            except queue.Empty:
                done = []
            for i, outcome in done:
                results[i] = results[i] or outcome  # a late result of a timed-out sample is dropped
            for i in _expired(running, timeout_s):
                if results[i] is None:
                    results[i] = _timed_out(timeout_s)
                    spawn()
    finally:
        while not todo.empty():
            todo.get_nowait()
    return results


def _run_in_processes(fn, n: int, workers: int, timeout_s: float | None) -> list[Outcome]:
    """Forked workers, one sample at a time each; a worker past the timeout is killed and replaced. Whatever
    stops the loop (a Ctrl-C between any two lines), every worker in `alive` is killed."""
    context = multiprocessing.get_context("fork")
    results: list[Outcome | None] = [None] * n
    todo, idle = deque(range(n)), []
    alive, busy = {}, {}  # connection -> its process; connection -> (its sample, when it started)

    def spawn():
        parent_end, child_end = context.Pipe()
        process = context.Process(target=_worker, args=(fn, child_end), daemon=True, name="reward-worker")
        process.start()
        child_end.close()
        alive[parent_end] = process
        idle.append(parent_end)

    def retire(connection) -> int:
        """Kill the worker (if still running), reap it, forget it; its exit code."""
        process = alive.pop(connection)
        process.kill()
        process.join()
        connection.close()
        return process.exitcode

    try:
        for _ in range(min(workers, n)):
            spawn()
        while todo or busy:
            while todo and idle:
                connection, i = idle.pop(), todo.popleft()
                connection.send(i)
                busy[connection] = (i, time.monotonic())
            starts = {i: start for i, start in busy.values()}
            for connection in wait_for_connections(list(busy), timeout=_time_left(starts, timeout_s)):
                i, _ = busy.pop(connection)
                try:
                    results[i] = connection.recv()
                    idle.append(connection)
                except EOFError:  # it died: os._exit, a segfault, the OOM killer
                    alive[connection].join()  # its own exit code, not the kill's
                    results[i] = (None, f"the reward's worker process died (exit code {retire(connection)})")
                    spawn()
            expired = set(_expired(starts, timeout_s))
            for connection, (i, _) in list(busy.items()):
                if i in expired:
                    del busy[connection]
                    retire(connection)
                    results[i] = _timed_out(timeout_s)
                    spawn()
    finally:
        for connection in list(alive):
            retire(connection)
    return results


def _worker(fn, connection) -> None:
    # A Ctrl-C at the terminal signals the whole process group; the parent alone acts on it (and kills this
    # process). A handler that does nothing, not SIG_IGN, which programs the reward runs would inherit.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    while (i := connection.recv()) is not None:
        outcome = _call(fn, i)
        try:
            connection.send(outcome)
        except Exception as e:  # e.g. a result that cannot be pickled
            connection.send((None, f"the reward's result could not be sent back from its process: {_reason(e)}"))


def _time_left(started: dict[int, float], timeout_s: float | None) -> float | None:
    if timeout_s is None or not started:
        return None
    return max(0.0, min(started.values()) + timeout_s - time.monotonic())


def _expired(started: dict[int, float], timeout_s: float | None) -> list[int]:
    if timeout_s is None:
        return []
    now = time.monotonic()
    return [i for i, start in started.items() if now - start >= timeout_s]
