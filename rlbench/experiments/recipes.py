"""Recipes: one TOML file per setting (`algorithms/<algorithm>/<setting>.toml`), read into a checked `Recipe`.

A recipe holds the `rl.Session` keyword arguments (the fields of `rl.Config`, nothing else) under
`[session]`, the number of training steps, the hardware it needs and, where one exists, the result it
reproduces with its source:

    description = "GRPO teaches tiny-arith two-digit addition"
    hardware = "CPU, 2 cores, about 2 minutes"
    steps = 150

    [target]                       # what `rlbench reproduce` checks: pass when metric >= value - tolerance
    metric = "greedy_accuracy"     # a key of Session.evaluate()
    value = 0.78
    tolerance = 0.1
    source = "rlbench measured: ..."

    [session]
    model = "tiny-arith"
    task = "arithmetic"            # or a table: {name = "countdown", count = 4}  (a built-in task's options)
                                   #          or {train = "data/gsm8k/train.parquet", test = "data/gsm8k/test.parquet"}
                                   #          or {name = "tool_math", train = "data/math/train.parquet"}  (a built-in
                                   #             task over files)
    algorithm = "grpo"             # or a table: {preset = "grpo", kl_coef = 0.0}  (a preset with fields changed)
                                   #          or {name = "mine", advantage = "rloo", loss = "gpg"}  (a new one)
    lr = 1e-4

Overrides are `KEY=VALUE` with dotted keys into that structure (`session.lr=3e-4`, `steps=20`,
`session.algorithm.kl_coef=0`); VALUE is a TOML value, a bare word is a string, `none` is None.
Every key is checked when the recipe is loaded, without reading data files or model weights: an error
(`RecipeError`) names the key and the accepted keys, type or values.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbench import algorithms, tasks
from rlbench.config import Config, make_config, mismatch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as the tomli package
    import tomli as tomllib

EVAL_METRICS = ("greedy_accuracy", "sampled_accuracy", "greedy_reward", "sampled_reward")
"""What `Session.evaluate()` returns: the metrics a target may name."""

_TOP = {"description": str, "hardware": str, "steps": int, "target": dict, "session": dict}
_TARGET = {"metric": str, "value": float, "tolerance": float, "source": str}
_TABLE_HEADS = {"task": "name", "algorithm": "preset"}
"""A session key that may be a table, and the key its plain-string form becomes in the table."""


class RecipeError(ValueError):
    """A recipe or an override that cannot work; the message starts with the dotted key at fault."""


@dataclass(frozen=True)
class Target:
    """A result to reproduce: `metric` of `Session.evaluate()` after training, `value` within `tolerance`."""

    metric: str
    value: float
    tolerance: float
    source: str

    def passed(self, result: float) -> bool:
        return result >= self.value - self.tolerance


@dataclass(frozen=True)
class Recipe:
    path: str
    steps: int
    """Training steps of `rlbench run` and `rlbench reproduce`."""
    session: dict
    """`rl.Session` keyword arguments as written: `task` and `algorithm` may still be tables."""
    description: str = ""
    hardware: str = ""
    target: Target | None = None

    def config(self) -> Config:
        """The checked `Config` (task and algorithm as written); reads no data file and no weights."""
        return make_config(**self.session)

    def session_kwargs(self) -> dict:
        """`rl.Session(**recipe.session_kwargs())`: the task and algorithm tables built (data files are read)."""
        return session_kwargs(self.session)


def load(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> Recipe:
    """Read a recipe file, apply `KEY=VALUE` overrides, check every key; a `RecipeError` names the culprit."""
    return from_dict(read_toml(path, overrides), path=str(path))


def read_toml(path: str | os.PathLike, overrides: typing.Sequence[str]) -> dict:
    """A TOML file's structure with the overrides applied (unchecked)."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise RecipeError(f"{path}: {e}") from None
    for assignment in overrides:
        apply_override(raw, assignment)
    return raw


def from_dict(raw: dict, *, path: str = "<dict>") -> Recipe:
    """A checked `Recipe` from the parsed structure of a recipe file."""
    check_keys("", raw, _TOP)
    for key in ("steps", "session"):
        if key not in raw:
            raise RecipeError(f"{key}: missing (a recipe needs steps and a [session] table)")
    if raw["steps"] <= 0:
        raise RecipeError(f"steps: must be a positive integer, got {raw['steps']!r}")
    target = None
    if "target" in raw:
        check_keys("target.", raw["target"], _TARGET)
        missing = sorted(set(_TARGET) - set(raw["target"]) - {"tolerance"})
        if missing:
            raise RecipeError(f"target.{missing[0]}: missing; a target needs {', '.join(_TARGET)}")
        check_choice("target.metric", raw["target"]["metric"], EVAL_METRICS)
        target = Target(**{"tolerance": 0.0} | raw["target"])
    session = check_session(raw["session"], "session.")
    return Recipe(path=path, steps=raw["steps"], session=session, description=raw.get("description", ""),
                  hardware=raw.get("hardware", ""), target=target)


def check_session(settings: dict, prefix: str) -> dict:
    """`settings` (Session keyword arguments, task / algorithm possibly tables) checked: returns them with
    numbers coerced to their field's type; a `RecipeError` names `prefix + key`."""
    out = dict(settings)
    check_keys(prefix, out, typing.get_type_hints(Config))
    for key, head in _TABLE_HEADS.items():
        value = out.get(key, getattr(Config, key))
        if isinstance(value, str):
            value = {head: value}
        if not isinstance(value, dict):
            raise RecipeError(f"{prefix}{key}: expected a name or a table, got {value!r}")
        if key == "task":
            _check_task(value, f"{prefix}task.")
        else:
            _check_algorithm(value, f"{prefix}algorithm")
    try:
        make_config(**out)
    except (TypeError, ValueError) as e:
        longest_first = sorted(Config.fields(), key=len, reverse=True)  # "lr_schedule=..." is not about lr
        field = next((name for name in longest_first if str(e).startswith(name)), None)
        raise RecipeError(f"{prefix}{field}: {e}" if field else f"{prefix.rstrip('.')}: {e}") from None
    return out


def session_kwargs(settings: dict) -> dict:
    """Checked session settings with their `task` and `algorithm` tables (or names) built into objects."""
    builders = {"task": build_task, "algorithm": build_algorithm}
    return settings | {key: build(settings[key]) for key, build in builders.items() if key in settings}


def build_task(spec: str | dict):
    """A task from a recipe's `task`: a built-in name, {name = ..., option = ...} (a built-in's options may name
    files: {name = "tool_math", train = FILE}), or {train = FILE, ...} (a task of the file's rows)."""
    if isinstance(spec, str):
        return tasks.get(spec)
    options = dict(spec)
    if _file_table(options):
        train = options.pop("train")
        reader = tasks.from_jsonl if str(train).endswith(".jsonl") else tasks.from_parquet
        return reader(os.path.expanduser(train), **options)
    return tasks.get(options.pop("name"), **options)


def build_algorithm(spec: str | dict) -> algorithms.Algorithm:
    """An algorithm from a recipe's `algorithm`: a preset name, {preset = NAME, field = value, ...} (the preset
    with those fields changed), or the fields of a new `rl.algorithms.Algorithm` (name, advantage, loss, ...)."""
    if isinstance(spec, str):
        return algorithms.get(spec)
    if "preset" not in spec:
        return algorithms.Algorithm(**spec)
    return algorithms.get(spec["preset"]).replace(**{k: v for k, v in spec.items() if k != "preset"})


def apply_override(raw: dict, assignment: str) -> None:
    """Set one dotted `KEY=VALUE` in a parsed recipe (checked later, with the rest, by `from_dict`)."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise RecipeError(f"override {assignment!r} is not KEY=VALUE (for example session.lr=3e-4)")
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        child = node.get(part, {})
        if isinstance(child, str) and part in _TABLE_HEADS:
            child = {_TABLE_HEADS[part]: child}
        if not isinstance(child, dict):
            raise RecipeError(f"{key}: {part} is {child!r}, not a table")
        node[part] = child
        node = child
    node[leaf] = parse_value(text.strip())


def parse_value(text: str):
    """A TOML value (`3e-4`, `true`, `[0.9, 0.95]`, `"x"`); `none` is None; anything else a bare string."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _file_table(spec: dict) -> bool:
    """A task table of a file's rows ({train = FILE, ...}), not a built-in task's options: no built-in name, or
    one whose factory takes no `train` (there `name` is the file task's label, an option of `from_parquet`)."""
    if "train" not in spec:
        return False
    name = spec.get("name")
    return name not in tasks.names() or "train" not in inspect.signature(tasks.factory(name)).parameters


def _check_task(spec: dict, prefix: str) -> None:
    if _file_table(spec):
        accepted = {"train": str} | {k: v for k, v in typing.get_type_hints(tasks.from_parquet).items()
                                     if k not in ("path", "reward", "return")}
        check_keys(prefix, spec, accepted)
        return
    if "name" not in spec:
        raise RecipeError(f"{prefix}name: missing; a task table has a built-in name or a train file")
    check_choice(f"{prefix}name", spec["name"], tasks.names())
    factory = tasks.factory(spec["name"])  # its signature: nothing is built, no file is read
    hints = typing.get_type_hints(factory)
    options = {p: hints.get(p, Any) for p in inspect.signature(factory).parameters}
    check_keys(prefix, spec, {"name": str} | options)


def _check_algorithm(spec: dict, key: str) -> None:
    """Check an algorithm table: its keys and types, then that the preset accepts the changes."""
    hints = typing.get_type_hints(algorithms.Algorithm)
    check_keys(f"{key}.", spec, {"preset": str} | {f.name: hints[f.name] for f in
                                                     dataclasses.fields(algorithms.Algorithm)})
    if "preset" in spec:
        check_choice(f"{key}.preset", spec["preset"], algorithms.names())
    try:
        build_algorithm(spec)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{key}: {e}") from None


def check_keys(prefix: str, table: dict, accepted: Mapping[str, Any]) -> None:
    """Every key of `table` is accepted and its value has the accepted type (ints become floats where a float
    is expected, lists tuples where a tuple is)."""
    if not isinstance(table, dict):
        raise RecipeError(f"{prefix.rstrip('.')}: expected a table, got {table!r}")
    for key, value in table.items():
        if key not in accepted:
            raise RecipeError(f"{prefix}{key}: unknown key; accepted: {', '.join(accepted)}")
        hint = accepted[key]
        problem = mismatch(value, hint)
        if problem:
            raise RecipeError(f"{prefix}{key}: {problem}")
        if isinstance(value, int) and not isinstance(value, bool) and not _takes_int(hint):
            table[key] = float(value)
        elif isinstance(value, list) and typing.get_origin(hint) is tuple:
            table[key] = tuple(value)


def check_choice(key: str, value, valid) -> None:
    if value not in valid:
        raise RecipeError(f"{key}: {value!r} is not one of: {', '.join(map(str, valid))}")


def _takes_int(hint) -> bool:
    return hint is Any or hint is int or int in typing.get_args(hint)


@dataclass(frozen=True)
class Leaderboard:
    """The CPU leaderboard's settings (`algorithms/leaderboard.toml`): every preset on every task, per seed."""

    path: str
    workers: int
    """Runs at once, each a Ray task with one CPU and one torch thread (1: one after another in this process)."""
    presets: tuple[str, ...]
    """Presets to run (empty: every preset; each task runs those it can, `cli.cannot_run`)."""
    tasks: dict
    """Label -> Session keyword arguments (no algorithm, no seed: the leaderboard sets them)."""
    budgets: dict
    """Label -> {"steps": training steps, "evaluate_every": steps between held-out evaluations, "seeds": [...]} of its
    runs (a task's own `steps` / `evaluate_every` / `seeds`, else the file's)."""


_LEADERBOARD = {"description": str, "steps": int, "evaluate_every": int, "seeds": list, "workers": int,
                "presets": list, "tasks": dict}
_BUDGET = {"steps": int, "evaluate_every": int, "seeds": list}


def check_seeds(seeds, key: str) -> list[int]:
    """`seeds` as a list, when it is a non-empty sequence of integers >= 0; else a RecipeError naming `key`."""
    if not isinstance(seeds, (list, tuple, range)) or not seeds or not all(
            isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0 for seed in seeds):
        raise RecipeError(f"{key}: expected one or more integers >= 0, got {seeds!r}")
    if len(set(seeds)) < len(seeds):
        raise RecipeError(f"{key}: seed {next(s for s in seeds if list(seeds).count(s) > 1)} appears more than once "
                          f"in {list(seeds)!r} (each seed is one run)")
    return list(seeds)


def load_leaderboard(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> Leaderboard:
    """Read and check a leaderboard file with `KEY=VALUE` overrides (as `load` does for a recipe). A task's table
    may set its own `steps`, `evaluate_every` and `seeds` (its budget) besides Session settings."""
    raw = read_toml(path, overrides)
    check_keys("", raw, _LEADERBOARD)
    if "steps" not in raw:
        raise RecipeError("steps: missing (the training steps of every run, unless a task sets its own)")
    for key in ("steps", "evaluate_every", "workers"):
        if raw.get(key, 1) <= 0:
            raise RecipeError(f"{key}: must be a positive integer, got {raw[key]!r}")
    for preset in raw.get("presets", []):
        check_choice("presets", preset, algorithms.names())
    if not raw.get("tasks"):
        raise RecipeError("tasks: a leaderboard needs at least one [tasks.LABEL] table")
    defaults = {"steps": raw["steps"], "evaluate_every": raw.get("evaluate_every", raw["steps"]),
                "seeds": raw.get("seeds", [])}
    budgets = {}
    for label, settings in raw["tasks"].items():
        for key in ("algorithm", "seed"):
            if key in settings:
                raise RecipeError(f"tasks.{label}.{key}: set by the leaderboard (presets, seeds), not per task")
        budgets[label] = {key: settings.pop(key, default) for key, default in defaults.items()}
        check_keys(f"tasks.{label}.", budgets[label], _BUDGET)
        for key in ("steps", "evaluate_every"):
            if budgets[label][key] <= 0:
                raise RecipeError(f"tasks.{label}.{key}: must be a positive integer, got {budgets[label][key]!r}")
        check_seeds(budgets[label]["seeds"], f"tasks.{label}.seeds")
        check_session(settings, f"tasks.{label}.")
    return Leaderboard(path=str(path), workers=raw.get("workers", 1),
                       presets=tuple(raw.get("presets") or algorithms.names()), tasks=raw["tasks"], budgets=budgets)
