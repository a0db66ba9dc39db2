"""The environment contract: what an agentic task's `env=` is. Two kinds, stated by the base class.

`Env`: the model talks to it through tools. One instance per episode: `reset(**example_fields)` gives the first
user turn, the methods marked `@rl.tool` are the tools the model may call (each call runs on this episode's
instance), `reward(episode)` scores the finished episode, `close()` ends it.

`Game`: each assistant turn is an action. `step(action_text)` returns (observation, reward, done): the
observation comes back as the next user message, the rewards are per-turn rewards, `done` ends the episode.

A method is a tool only when marked (or when it overrides a marked one): a documented helper stays a helper,
and a game stays a game whatever methods it has. Any of the methods (`reset`, a tool, `step`, `reward`, `close`) may
be `async def`: the environment worker awaits it on its event loop, under the same time limit. `check(env)` is what
`rl.tasks.AgentTask` runs on its `env=`: every mistake in the contract is named when the task is made, not found
mid-rollout.

A task may hold several environments, `env={"calc": Calculator, "lookup": Lookup}, route="env"`: each example's
"env" field names the environment its episodes run in (`environments` checks them all, `pick` finds an example's),
and each episode's prompt declares its own environment's tools only.
"""

from __future__ import annotations

import inspect

from rlbench.agents.tools import Tool


class Env:
    """An environment with tools, one instance per episode (abstract: subclass it). A worked example:

        class Lookup(rl.Env):
            def reset(self, prompt, answer):       # the example's fields, those the signature names
                self.answer, self.looked_up = answer, 0
                return prompt                      # the first user turn: a string or chat messages

            @rl.tool
            def lookup(self, key: str) -> str:
                \"\"\"The value stored under a key.

                Args:
                    key: e.g. "capital-of-france".
                \"\"\"
                self.looked_up += 1
                return TABLE.get(key, "not found")

            def reward(self, episode) -> dict[str, float]:  # a number, a dict of components, or per-turn values
                right = float(episode.final_text.strip() == self.answer)
                return {"score": right - 0.1 * (self.looked_up > 3), "acc": right}

        task = rl.tasks.AgentTask(train, test, env=Lookup, max_turns=4)

    The model sees `lookup`'s JSON schema (from its type hints and docstring); a call with a wrong argument,
    an unknown tool or a tool that raises becomes an error message for the model, never the trainer's exception.
    `reward` runs once, when the episode ends; the task's `reward=` replaces it.
    """

    def reset(self, **fields) -> str | list[dict]:
        """Start an episode of an example (its fields as keywords); the first user turn. Default: its "prompt"."""
        return fields["prompt"]

    def reward(self, episode) -> float | dict[str, float] | list[float]:
        """The finished episode's reward: a number, a dict of components ("score" or their sum is the score;
        "turns": per-turn rewards), or a list of per-turn rewards (the score is their sum)."""
        raise NotImplementedError(f"{type(self).__name__} defines no reward(episode): define it, or give the "
                                  f"task reward=")

    def close(self) -> None:
        """The episode is over (scored, or abandoned): release what `reset` took."""


class Game(Env):
    """An environment played by its turns (abstract: subclass it): each assistant turn is an action for
    `step`, whose observation is the next user message. A worked example:

        class Guess(rl.Game):
            def reset(self, secret, **_):
                self.secret, self.tries = secret, 0
                return "Guess my number (1-100)."

            def step(self, action: str) -> tuple[str, float, bool]:
                self.tries += 1
                guess = int(action) if action.strip().isdigit() else -1
                if guess == self.secret:
                    return "", 1.0, True                   # right: reward 1, done
                return ("higher" if guess < self.secret else "lower"), 0.0, self.tries == 5

        task = rl.tasks.AgentTask(train, test, env=Guess, max_turns=5)

    A game has no tools. Its reward is the sum of its step rewards unless it defines `reward(episode)`.
    """

    def step(self, action: str) -> tuple[str, float, bool]:
        """Play one assistant turn's text: (the observation, this turn's reward, whether the game is over)."""
        raise NotImplementedError(f"{type(self).__name__} is a Game without step(action)")

    def reward(self, episode) -> list[float]:
        """The step rewards, one per turn (the score is their sum)."""
        return [turn.reward or 0.0 for turn in episode.turns]


def is_game(env: type | None) -> bool:
    """Whether the episodes of `env` are played as a game (its turns are actions)."""
    return isinstance(env, type) and issubclass(env, Game)


def tools_of(env: object, extra: list | tuple = ()) -> dict[str, Tool]:
    """The tools by name of an environment instance (bound to it) or class: its methods marked `@rl.tool` (a
    subclass's override of one is a tool too), then `extra` (functions or `Tool`s). ValueError on two tools with
    the same name."""
    found: dict[str, Tool] = {}
    if env is not None:
        owner = env if isinstance(env, type) else type(env)
        marked = {name for klass in owner.__mro__ for name, value in vars(klass).items() if isinstance(value, Tool)}
        for name in sorted(marked):
            member = getattr(env, name)
            tool = member if isinstance(member, Tool) else Tool(member, name)
            found[tool.name] = tool
    for item in extra:
        tool = item if isinstance(item, Tool) else Tool(item)
        if tool.name in found:
            raise ValueError(f"two tools are named {tool.name!r}")
        found[tool.name] = tool
    return found


def check(env: type | None, tools: tuple, reward) -> None:
    """ValueError naming what breaks the contract: `env` is neither an `Env` nor a `Game` class, a game with
    tools, an environment with no tools, no reward anywhere."""
    if env is None:
        if reward is None:
            raise ValueError("an AgentTask needs env= (an rl.Env with reward(episode), or an rl.Game) or reward=")
        if not tools:
            raise ValueError("an AgentTask without env= needs tools=")
        tools_of(None, tools)
        return
    if not (isinstance(env, type) and issubclass(env, Env)):
        what = env.__name__ if isinstance(env, type) else repr(env)
        raise ValueError(f"env={what} is not an environment class: subclass rl.Env (tools marked @rl.tool) or "
                         f"rl.Game (each turn an action for step(action) -> (observation, reward, done))")
    if is_game(env):
        marked = tools_of(env, tools)
        if marked:
            raise ValueError(f"{env.__name__} is an rl.Game (each turn is an action for step), so it has no tools; "
                             f"it has {', '.join(marked)}: make it an rl.Env to be driven by tools")
        if env.step is Game.step:
            raise ValueError(f"{env.__name__} is an rl.Game without step(action)")
        return
    if not tools_of(env, tools):
        helpers = [name for name, member in inspect.getmembers(env, inspect.isfunction)
                   if not name.startswith("_") and name not in vars(Env) and inspect.getdoc(member)]
        unmarked = f" ({', '.join(helpers)} {'is' if len(helpers) == 1 else 'are'} not marked)" if helpers else ""
        raise ValueError(f"{env.__name__} has no tools{unmarked}: mark a tool method with @rl.tool, or give the "
                         f"task tools=")
    if env.reward is Env.reward and reward is None:
        raise ValueError(f"{env.__name__} defines no reward(episode): define it, or give the task reward=")


def environments(env, route: str | None, tools: tuple, reward) -> dict[str | None, type | None]:
    """A task's environment classes by the value of the example field `route` that picks them (`{None: env}` for a
    task of one environment), each checked with `check`; ValueError naming what is wrong: a dict without `route`
    (or `route` without a dict), a name that is not a string, an environment that breaks the contract, games mixed
    with tool environments (one task's episodes are all played by their turns, or all driven by tools)."""
    if not isinstance(env, dict):
        if route is not None:
            raise ValueError(f"route={route!r} picks each example's environment from env= given as a dict "
                             f"({{name: class}}); env= is {getattr(env, '__name__', env)!r}: give a dict, or no route")
        check(env, tools, reward)
        return {None: env}
    if not (isinstance(route, str) and route):
        raise ValueError(f"env= is a dict of environments ({', '.join(map(repr, env))}): route= names the example "
                         f"field whose value picks each example's, e.g. route=\"env\"")
    if not env:
        raise ValueError("env= is an empty dict: give {name: environment class}")
    for name, klass in env.items():
        if not isinstance(name, str):
            raise ValueError(f"env= names its environments by strings (an example's {route!r} value), got {name!r}")
        if klass is None:
            raise ValueError(f"env[{name!r}] is None: give an rl.Env or rl.Game class")
        try:
            check(klass, tools, reward)
        except ValueError as error:
            raise ValueError(f"env[{name!r}]: {error}") from None
    games = [name for name, klass in env.items() if is_game(klass)]
    if games and len(games) < len(env):
        raise ValueError(f"env= mixes games ({', '.join(games)}) with tool environments "
                         f"({', '.join(n for n in env if n not in games)}): one task's environments are all rl.Game "
                         f"or all rl.Env")
    return dict(env)


def pick(choices: dict, route: str | None, example: dict):
    """The entry of `choices` (keyed like `environments`' result) for `example`: its `route` field's value, or the
    one entry None without a route; ValueError naming the field and the names there are."""
    if route is None:
        return choices[None]
    value = example.get(route)
    if isinstance(value, str) and value in choices:
        return choices[value]
    what = f"no {route!r} field" if route not in example else f"{route}={value!r}, which names no environment"
    raise ValueError(f"the example has {what}: route={route!r} picks its environment, one of "
                     f"{', '.join(map(repr, choices))}")
