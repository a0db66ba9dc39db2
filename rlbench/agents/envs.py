"""The environment worker: one environment instance per episode; every call into it runs in a thread with a time
limit.

Every kind of environment (`rlbench.agents.env`: an `Env` with tools, a `Game`, or function tools alone, the
example's prompt starting the episode) is driven the same way. `EnvPool` holds the instances of running
episodes, in the controller's process (inline) or in a Ray actor of its own (the environments then run off the
driver). Work is submitted per episode and collected by `poll`: a tool that takes long holds up only its own
episode, never the others. Every call into the user's code (the class, `reset`, a tool, `step`, `reward`,
`close`) runs under the task's `tool_timeout_s`, and everything that goes wrong (one of them raising, taking
longer or returning the wrong thing, a malformed or unknown call, bad arguments) comes back as a message and a
reason, never as an exception out of the pool or a wait without end.
"""

from __future__ import annotations

import inspect
import math
import numbers
import threading
import time
from collections.abc import Callable

from rlbench.agents.env import check, is_game, tools_of
from rlbench.agents.parsers import ToolCall
from rlbench.agents.render import chat_messages
from rlbench.agents.tools import Tool


class EnvPool:
    """Environment instances by episode key (see the module docstring); every method returns, none raises
    for an environment's failure."""

    def __init__(self, env: type | None, tools: tuple = (), reward: Callable | None = None,
                 system: str | None = None, tool_timeout_s: float | None = 10.0):
        check(env, tuple(tools), reward)
        self.env_class, self.extra_tools, self.reward_fn = env, tuple(tools), reward
        self.system, self.tool_timeout_s = system, tool_timeout_s
        self.game = is_game(env)
        """A game: each assistant turn is an action for `step`."""
        self.envs: dict[int, object] = {}
        self.tools: dict[int, dict[str, Tool]] = {}
        self.done: dict[int, object] = {}  # key -> finished job's result
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)

    def open(self, keys: list[int], examples: list[dict]) -> list[tuple[list[dict] | None, str | None]]:
        """Start one episode per key: (its first messages, None), or (None, why its environment failed to start:
        the class or `reset` raised, took longer than the time limit, or returned something other than a first
        turn)."""
        out = []
        for key, example in zip(keys, examples):
            started, error = self._timed(lambda: self._reset(example), "reset")
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

    def _reset(self, example: dict):
        env = self.env_class() if self.env_class is not None else None
        return env, _call_with_fields(env.reset, example) if env is not None else example["prompt"]

    def info(self) -> dict:
        """{"schemas": the tools' JSON schemas, "game": whether turns are actions for `step`}."""
        return {"schemas": [t.schema for t in tools_of(self.env_class, self.extra_tools).values()], "game": self.game}

    def submit(self, key: int, calls: list[ToolCall] | None = None, action: str | None = None) -> None:
        """Run an episode's tool calls in order (or, for a game, its action) in a thread of their own; `poll`
        returns the result: a list of (tool message, error or None), or (observation, reward, done, error)."""
        job = (lambda: self._run_calls(key, calls)) if action is None else (lambda: self._run_step(key, action))

        def run():
            result = job()
            with self.ready:
                self.done[key] = result
                self.ready.notify_all()

        threading.Thread(target=run, name=f"rlbench-episode-{key}", daemon=True).start()

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
        results = []
        for call in calls:
            tool = self.tools.get(key, {}).get(call.name)
            if tool is None:
                known = ", ".join(self.tools.get(key, {})) or "none"
                results.append(_error(f"unknown tool {call.name!r}; tools: {known}"))
                continue
            try:
                arguments = tool.check(call.arguments)
            except ValueError as error:
                results.append(_error(str(error)))
                continue
            results.append(self._timed(lambda: str(tool(**arguments)), f"tool {call.name}"))
        return results

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
        """(fn(), None), or (an error message for the model, the reason) when it raised or took too long."""
        box: dict = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as error:  # noqa: BLE001 - a tool's SystemExit / KeyboardInterrupt is its failure
                box["error"] = error

        thread = threading.Thread(target=run, name=f"rlbench-{what}", daemon=True)
        start = time.monotonic()
        thread.start()
        thread.join(self.tool_timeout_s)
        if thread.is_alive():  # a Python thread cannot be killed: it is left behind, the episode goes on
            return _error(f"{what} timed out after {time.monotonic() - start:.3g} s")
        if "error" in box:
            return _error(f"{what} raised {_describe(box['error'])}")
        return box["value"], None


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
