"""The environment worker: one environment instance per episode; every call into it runs in a thread with a time
limit.

Every kind of environment (`rlbench.agents.env`: an `Env` with tools, a `Game`, or function tools alone, the
example's prompt starting the episode; several of them routed by a field of the example) is driven the same way.
`EnvPool` holds the instances of running episodes, in the controller's process (inline) or in a Ray actor of its
own (the environments then run off the driver). Work is submitted per episode and collected by `poll`: a tool that
takes long holds up only its own episode, never the others. Every call into the user's code (the class, `reset`, a
tool, `step`, `reward`, `close`) runs under the task's `tool_timeout_s`, and everything that goes wrong (one of
them raising, taking longer or returning the wrong thing, a malformed or unknown call, bad arguments) comes back
as a message and a reason, never as an exception out of the pool or a wait without end.

The calls of one assistant turn run at once, each in a thread with its own time limit (threads are reused), on the episode's
instance (a tool that changes the instance's state shares it with the turn's other calls); their messages come
back in the order of the calls. `tool_concurrency` caps the tool calls running at once across the pool (every
episode's): a call waits for a free slot before its time limit starts, and holds it until it returns or its time
is up. A method that is `async def` runs on the pool's event loop (one thread, started at the first such call): a
turn's async calls run concurrently there (an async tool that blocks instead of awaiting holds up the others), and
one past its time limit is cancelled (a sync one cannot be: its thread is left behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import numbers
import queue
import threading
import time
import weakref
from collections.abc import Callable

from rlbench.agents.env import environments, is_game, pick, tools_of
from rlbench.agents.parsers import ToolCall
from rlbench.agents.render import chat_messages
from rlbench.agents.tools import Tool
from rlbench.models.vision import has_pictures


class EnvPool:
    """Environment instances by episode key (see the module docstring); every method returns, none raises
    for an environment's failure."""

    def __init__(self, env: type | dict[str, type] | None, tools: tuple = (), reward: Callable | None = None,
                 system: str | None = None, tool_timeout_s: float | None = 10.0, *, route: str | None = None,
                 tool_concurrency: int | None = None):
        self.env_classes = environments(env, route, tuple(tools), reward)
        """The environment classes by the value of the examples' `route` field ({None: env} for one)."""
        check_tool_concurrency(tool_concurrency)
        self.route, self.extra_tools, self.reward_fn = route, tuple(tools), reward
        self.system, self.tool_timeout_s = system, tool_timeout_s
        self.slots = threading.Semaphore(tool_concurrency) if tool_concurrency else contextlib.nullcontext()
        """Held by each running tool call: `tool_concurrency` of them at most."""
        self.game = is_game(next(iter(self.env_classes.values())))
        """A game: each assistant turn is an action for `step`."""
        self.envs: dict[int, object] = {}
        self.tools: dict[int, dict[str, Tool]] = {}
        self.done: dict[int, object] = {}  # key -> finished job's result
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.loop: asyncio.AbstractEventLoop | None = None
        """Where `async def` methods run (started at the first)."""
        self.threads = Threads()
        """Where submitted work and each timed call run: threads reused from one call to the next."""
        weakref.finalize(self, self.threads.stop)

    def open(self, keys: list[int], examples: list[dict]) -> list[tuple[list[dict] | None, str | None]]:
        """Start one episode per key: (its first messages, None), or (None, why its environment failed to start:
        its example names no environment, the class or `reset` raised, took longer than the time limit, or returned
        something other than a first turn)."""
        out = []
        for key, example in zip(keys, examples):
            try:
                env_class = pick(self.env_classes, self.route, example)
            except ValueError as bad:
                out.append((None, str(bad)))
                continue
            started, error = self._timed(lambda: self._reset(env_class, example), "reset")
            env, first = started if error is None else (None, None)
            if error is None:
                try:
                    messages = chat_messages(first)
                except ValueError as bad:
                    error = f"reset returned {bad}"
            if error is not None:
                out.append((None, error))
                self._close(env)
                continue
            if self.system and not (messages and messages[0]["role"] == "system"):
                messages.insert(0, {"role": "system", "content": self.system})
            self.envs[key], self.tools[key] = env, tools_of(env, self.extra_tools)
            out.append((messages, None))
        return out

    def _reset(self, env_class: type | None, example: dict):
        """(the instance, its first turn); a coroutine giving them when `reset` is async."""
        if env_class is None:
            return None, example["prompt"]
        env = env_class()
        first = _call_with_fields(env.reset, example)
        if inspect.isawaitable(first):
            async def started():
                return env, await first
            return started()
        return env, first

    def info(self) -> dict:
        """{"schemas": {route value: the JSON schemas of that environment's tools} ({None: ...} for one environment),
        "route": the example field that picks an episode's environment, "game": whether turns are actions for
        `step`}."""
        schemas = {name: [t.schema for t in tools_of(klass, self.extra_tools).values()]
                   for name, klass in self.env_classes.items()}
        return {"schemas": schemas, "route": self.route, "game": self.game}

    def submit(self, key: int, calls: list[ToolCall] | None = None, action: str | None = None) -> None:
        """Run an episode's tool calls (at once, see the module docstring) or, for a game, its action, in a thread of
        their own; `poll` returns the result: a list of (tool message, error or None) in the calls' order, or
        (observation, reward, done, error)."""
        job = (lambda: self._run_calls(key, calls)) if action is None else (lambda: self._run_step(key, action))

        def run():
            result = job()
            with self.ready:
                self.done[key] = result
                self.ready.notify_all()

        self.threads.start(run)

    def poll(self, wait_s: float = 0.0) -> dict[int, object]:
        """The results of submitted work that finished, by key; waits up to `wait_s` for one when none has."""
        with self.ready:
            if not self.done and wait_s > 0:
                self.ready.wait(wait_s)
            done, self.done = self.done, {}
        return done

    def score(self, key: int, episode) -> tuple[float, dict[str, float], list[float], str | None]:
        """(score, components, per-turn rewards, error) of a finished episode, then its environment is closed.
        A reward returns a number, a dict of numbers (components; "score" or their sum is the score; "turns": a
        list of per-turn rewards, one per turn of the episode), or a list of per-turn rewards (the score is their
        sum). A reward that raises, takes longer than the time limit or returns anything else scores 0, saying why."""
        env = self.envs.get(key)
        if self.reward_fn is None and env is None:  # its reset failed (the episode records why): nothing to score
            return 0.0, {}, [], None
        reward = (lambda: self.reward_fn(episode, episode.example)) if self.reward_fn is not None \
            else (lambda: env.reward(episode))
        value, error = self._timed(reward, "reward")
        self.close([key])
        if error is not None:
            return 0.0, {}, [], error
        try:
            return (*_reward_parts(value, len(episode.turns)), None)
        except ValueError as bad:
            return 0.0, {}, [], f"reward raised ValueError: {bad}"

    def close(self, keys: list[int]) -> None:
        """End these episodes' environments (`close()`)."""
        for key in keys:
            self.tools.pop(key, None)
            self._close(self.envs.pop(key, None))

    def _close(self, env) -> None:
        if env is not None:  # best effort, within the time limit
            self._timed(env.close, "close")

    def _run_calls(self, key: int, calls: list[ToolCall]) -> list[tuple[str, str | None]]:
        """Every call at once, a thread each (one call: in this thread); (tool message, error or None) per call, in
        their order."""
        if len(calls) == 1:
            return [self._run_call(key, calls[0])]
        results: list = [None] * len(calls)
        finished = [threading.Event() for _ in calls]

        def run(i: int) -> None:
            results[i] = self._run_call(key, calls[i])
            finished[i].set()

        for i in range(len(calls)):
            self.threads.start(lambda i=i: run(i))
        for event in finished:  # each ends within its wait for a slot and its time limit
            event.wait()
        return results

    def _run_call(self, key: int, call: ToolCall) -> tuple[str, str | None]:
        tool = self.tools.get(key, {}).get(call.name)
        if tool is None:
            known = ", ".join(self.tools.get(key, {})) or "none"
            return _error(f"unknown tool {call.name!r}; tools: {known}")
        try:
            arguments = tool.check(call.arguments)
        except ValueError as error:
            return _error(str(error))
        with self.slots:
            return self._timed(lambda: _message(tool(**arguments)), f"tool {call.name}")

    def _run_step(self, key: int, action: str):
        """(observation, reward, done, None), or ("", 0.0, True, why) when `step` failed: raised, took too long,
        or returned anything other than (observation, a finite number, done)."""
        out, error = self._timed(lambda: self.envs[key].step(action), "step")
        if error is None:
            try:
                observation, reward, done = out
                return str(observation or ""), _number(reward or 0.0, "step"), bool(done), None
            except (TypeError, ValueError) as bad:
                error = f"step returned {out!r:.80}: expected (observation, reward, done) ({bad})"
        return "", 0.0, True, error

    def _timed(self, fn: Callable, what: str):
        """(fn(), None), or (an error message for the model, the reason) when it raised or took too long. What fn
        returns is awaited on the pool's event loop when it is awaitable (an `async def` method's coroutine)."""
        box: dict = {}

        def run():
            try:
                value = fn()
                if inspect.isawaitable(value):
                    box["future"] = asyncio.run_coroutine_threadsafe(_awaited(value), self._event_loop())
                    value = box["future"].result()
                box["value"] = value
            except BaseException as error:  # noqa: BLE001 - a tool's SystemExit / KeyboardInterrupt is its failure
                box["error"] = error

        finished = threading.Event()
        start = time.monotonic()
        self.threads.start(lambda: (run(), finished.set()))
        if not finished.wait(self.tool_timeout_s):  # a Python thread cannot be killed: it is left behind, the episode goes on
            if "future" in box:  # a coroutine can be stopped: it is cancelled
                box["future"].cancel()
            return _error(f"{what} timed out after {time.monotonic() - start:.3g} s")
        if "error" in box:
            return _error(f"{what} raised {_describe(box['error'])}")
        return box["value"], None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop of `async def` methods: a thread of its own, started here the first time, stopped (and the loop
        closed) when the pool is collected."""
        with self.lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=_serve, args=(self.loop,), name="rlbench-env-loop", daemon=True).start()
                weakref.finalize(self, self.loop.call_soon_threadsafe, self.loop.stop)
            return self.loop


class Threads:
    """Daemon threads that run jobs, each reused for the next job once it finishes its own: a job goes to an idle
    thread, or to a new one when none is idle (a job that never returns keeps its thread, as a thread of its own
    would; the others go on). Starting a thread per call cost more than the calculator's tool itself."""

    def __init__(self):
        self.idle: list[queue.SimpleQueue] = []  # the inboxes of the threads waiting for a job
        self.lock = threading.Lock()
        self.stopped = False

    def start(self, job: Callable[[], object]) -> None:
        """Run `job()` in an idle thread, or a new one."""
        with self.lock:
            inbox = self.idle.pop() if self.idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="rlbench-env-call", daemon=True).start()
        inbox.put(job)

    def stop(self) -> None:
        """End the idle threads (those in a job end with it)."""
        with self.lock:
            idle, self.idle, self.stopped = self.idle, [], True
        for inbox in idle:
            inbox.put(None)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while (job := inbox.get()) is not None:
            job()
            with self.lock:
                if self.stopped:
                    return
                self.idle.append(inbox)


def check_tool_concurrency(tool_concurrency) -> None:
    """ValueError unless `tool_concurrency` is None (no limit) or a positive integer."""
    if tool_concurrency is not None and (isinstance(tool_concurrency, bool) or not isinstance(tool_concurrency, int)
                                         or tool_concurrency < 1):
        raise ValueError(f"tool_concurrency must be a positive integer (the most tool calls running at once) or None "
                         f"(no limit), got {tool_concurrency!r}")


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.run_forever()
    finally:
        loop.close()


async def _awaited(awaitable):
    return await awaitable


def _message(value):
    """A tool's value as its message: its text, or a value with pictures as it is (a PIL image, or a list of texts and
    PIL images: the episode places them, `rl.models.vision.content_of`); for an async tool's coroutine, a coroutine
    giving that."""
    if inspect.isawaitable(value):
        async def message():
            return _message(await value)
        return message()
    return value if has_pictures(value) else str(value)


def _call_with_fields(fn: Callable, example: dict):
    """`fn(**example)`, passing only the fields its signature names (all of them if it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(**example)
    return fn(**{k: v for k, v in example.items() if k in params})


def _reward_parts(value, turns: int) -> tuple[float, dict[str, float], list[float]]:
    """(score, components, per-turn rewards) of what a reward returned for an episode of `turns` turns; ValueError
    on anything else, per-turn rewards of another length included."""
    if isinstance(value, dict):
        per_turn = [_number(v, "turns") for v in value.get("turns", [])]
        components = {k: _number(v, k) for k, v in value.items() if k != "turns"}
        score = components.get("score", sum(components.values()) if components else sum(per_turn))
    elif isinstance(value, (list, tuple)):
        per_turn, components = [_number(v, "turns") for v in value], {}
        score = sum(per_turn)
    else:
        return _number(value, "score"), {}, []
    if per_turn and len(per_turn) != turns:
        raise ValueError(f"reward gave {len(per_turn)} per-turn rewards for an episode of {turns} turns")
    return score, {k: v for k, v in components.items() if k != "score"}, per_turn


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"reward {name!r} must be a number, got {type(value).__name__} {value!r:.40}")
    if not math.isfinite(value):
        raise ValueError(f"reward {name!r} is {value}")
    return float(value)


def _error(message: str) -> tuple[str, str]:
    return f"error: {message}", message


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
