"""`AgentTask`: examples whose episodes are multi-turn conversations with an environment and tools.

    task = rl.tasks.AgentTask(train, test, env=Calculator, max_turns=4)
    task = rl.tasks.AgentTask(train, test, tools=[calculator], reward=lambda episode, example: ...)
    task = rl.tasks.AgentTask(train, test, env={"calc": Calculator, "lookup": Lookup}, route="env")

The environment is an `rl.Env` class (one instance per episode: `reset(**example) -> first user turn`, tools
marked `@rl.tool`, `reward(episode)`) or an `rl.Game` class (`step(action_text) -> observation, reward, done`);
see `rlbench.agents.env`. With several, each example's `route` field names its own, and its episodes' prompts
declare that environment's tools only. The task only carries them: the session's environment worker runs them.
Every mistake (in an environment's contract, an example without a known environment, a setting) is a ValueError
when the task is made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rlbench.agents.env import environments, pick
from rlbench.agents.envs import check_tool_concurrency


@dataclass(frozen=True)
class AgentTask:
    """A Task whose examples are played as episodes (see the module docstring)."""

    train: Sequence[dict] = field(repr=False)
    test: Sequence[dict] = field(default=(), repr=False)
    env: type | dict[str, type] | None = None
    """The environment class (`rl.Env` or `rl.Game`), instantiated once per episode; or several by name
    (`{"calc": Calculator, "lookup": Lookup}`, all games or all tool environments), picked by `route`."""
    route: str | None = None
    """With several environments: the example field whose value names an example's environment."""
    tools: tuple = ()
    """Function tools (`@rl.tool`), besides the environment's own."""
    reward: Callable | None = None
    """`reward(episode, example) -> float | dict | list` when the environment has no `reward(episode)` (or there
    is none). A dict: components ("turns": per-turn rewards); a list: per-turn rewards."""
    max_turns: int = 4
    """Most assistant turns per episode (a call in the last one is not run: the episode ends, "max_turns")."""
    parser: object = "hermes"
    """How tool calls are read from a turn: a built-in name or a parser object (`rl.agents.Parser`). "hermes" lets a
    turn run to EOS and reads every call in it; `rl.agents.HermesParser(stop_at_call=True)` ends it at its first."""
    system: str | None = None
    """A system message before the first user turn (the chat template adds the tools' schemas)."""
    tool_timeout_s: float | None = 10.0
    """A tool call running longer gives the model an error message (its thread is left behind; an async tool is
    cancelled); a `reset`, game `step` or `reward` running longer ends its episode with the reason recorded. None:
    no limit."""
    tool_concurrency: int | None = None
    """Most tool calls running at once in the environment worker, over all episodes and the calls of each turn
    (a call waits for a slot before its time limit starts). None: no limit."""
    max_context_tokens: int | None = None
    """Most tokens of an episode, prompt included (None: the model's context length)."""
    name: str = "agent"
    truncated_reward: float | None = None
    """Unused by episodes (an episode that hits max_new_tokens ends: its environment scores it)."""
    settings: dict = field(default_factory=dict)
    """Session settings the task needs, used unless the session is given them (`Task.settings`), e.g.
    `{"max_new_tokens": 64}` where a tool call is longer than the default turn."""

    def __post_init__(self):
        object.__setattr__(self, "train", tuple(self.train))
        object.__setattr__(self, "test", tuple(self.test))
        object.__setattr__(self, "tools", tuple(self.tools))
        if isinstance(self.env, dict):
            object.__setattr__(self, "env", dict(self.env))
        classes = environments(self.env, self.route, self.tools, self.reward)
        check_tool_concurrency(self.tool_concurrency)
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {self.max_turns}")
        if not self.train:
            raise ValueError(f"task {self.name!r} has no train examples")
        for split in ("train", "test"):
            for i, example in enumerate(getattr(self, split)):
                if not isinstance(example, dict):
                    raise ValueError(f"{split} example {i} of task {self.name!r} is a {type(example).__name__}, "
                                     f"not a dict of fields")
                try:
                    pick(classes, self.route, example)
                except ValueError as error:
                    raise ValueError(f"{split} example {i} of task {self.name!r}: {error}") from None
