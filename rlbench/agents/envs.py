"""The environment worker: one environment instance per episode, tools run in threads with a time limit.

Every kind of environment (`rlbench.agents.env`: an `Env` with tools, a `Game`, or function tools alone, the
example's prompt starting the episode) is driven the same way. `EnvPool` holds the instances of running
episodes, in the controller's process (inline) or in a Ray actor of its own (the environments then run off the
driver). Work is submitted per episode and collected by `poll`: a tool that takes long holds up only its own
episode, never the others. Everything that goes wrong (a reset that raises, a malformed or unknown call, bad
arguments, a tool that raises or outlives its time limit, a reward that raises) comes back as a message and a
reason, never as an exception out of the pool.
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
        """Start one episode per key: (its first messages, None), or (None, why its environment failed to start)."""
        out = []
        for key, example in zip(keys, examples):
            try:
                env = self.env_class() if self.env_class is not None else None
                first = _call_with_fields(env.reset, example) if env is not None else example["prompt"]
                messages = [{"role": "user", "content": first}] if isinstance(first, str) else [dict(m) for m in first]
                if self.system and not (messages and messages[0]["role"] == "system"):
                    messages.insert(0, {"role": "system", "content": self.system})
                self.envs[key], self.tools[key] = env, tools_of(env, self.extra_tools)
                out.append((messages, None))
            except Exception as error:  # noqa: BLE001 - any failure of the user's environment is the episode's
                out.append((None, f"reset raised {_describe(error)}"))
        return out

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
        list of per-turn rewards), or a list of per-turn rewards (the score is their sum)."""
        env = self.envs.get(key)
        try:
            if self.reward_fn is not None:
                value = self.reward_fn(episode, episode.example)
            elif env is None:  # its reset failed (the episode records why): nothing to score
                return 0.0, {}, [], None
            else:
                value = env.reward(episode)
            return (*_reward_parts(value), None)
        except Exception as error:  # noqa: BLE001
            return 0.0, {}, [], f"reward raised {_describe(error)}"
        finally:
            self.close([key])

    def close(self, keys: list[int]) -> None:
        """End these episodes' environments (`close()`)."""
        for key in keys:
            env = self.envs.pop(key, None)
            self.tools.pop(key, None)
            if env is not None:
                try:
                    env.close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass

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
        out = self._timed(lambda: self.envs[key].step(action), "step")
        if out[1] is not None:
            return "", 0.0, True, out[1]
        observation, reward, done = out[0]
        return str(observation or ""), float(reward or 0.0), bool(done), None

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


def _reward_parts(value) -> tuple[float, dict[str, float], list[float]]:
    """(score, components, per-turn rewards) of what a reward returned; ValueError on anything else."""
    if isinstance(value, dict):
        turns = [_number(v, "turns") for v in value.get("turns", [])]
        components = {k: _number(v, k) for k, v in value.items() if k != "turns"}
        score = components.get("score", sum(components.values()) if components else sum(turns))
        return score, {k: v for k, v in components.items() if k != "score"}, turns
    if isinstance(value, (list, tuple)):
        turns = [_number(v, "turns") for v in value]
        return sum(turns), {}, turns
    return _number(value, "score"), {}, []


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
