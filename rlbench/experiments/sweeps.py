"""Sweeps: a grid of Session settings x seeds, each run a Ray task, into one table of learning curves.

    sw = rl.sweep({"algorithm": ["grpo", "dapo"], "lr": [1e-4, 3e-4]}, settings={"model": "tiny-arith"},
                  steps=300, seeds=[0, 1, 2], evaluate_every=25, out_dir="runs/sweeps/lr")
    sw.table                            # one row per run and evaluation point (greedy accuracy, tokens, reward, time)
    sw.runs                             # one row per run: its settings, seed, status and error
    sw.summary()                        # per arm: final accuracy, AUC, accuracy at a token budget, 95% intervals
    sw.compare({"algorithm": "grpo"})   # each arm minus its grpo arm, with intervals (`rlbench.experiments.stats`)
    sw.plot()                           # learning curves: per arm the mean over seeds and its interval as a band

A run is `steps` training steps of one Session (inline, in its Ray task, with `cpus_per_run` CPUs and one torch
thread per CPU; a GPU each where the cluster has them), held-out `evaluate()` at step 0, every `evaluate_every`
steps and at the end, and a checkpoint at each evaluation. Its folder, `OUT_DIR/RUN_ID/`, holds `evals.jsonl` (the
table's rows), `log.jsonl` (its events: start, restored from a checkpoint, done, error with the traceback), the session's `metrics.jsonl` (one
row per step) and, while it runs, `checkpoints/`. The run id is made of the run's settings, seed and budget (the
same on every machine), so calling the same sweep again with the same `out_dir` skips the runs that finished,
resumes interrupted ones from their last checkpoint, and tries again those that raised. A run that raises is
recorded (status "error", the exception in `sw.runs` and its log) and the others go on.

Settings are plain values, as in a recipe (`rlbench.experiments.recipes`): a task or an algorithm may be a table (`{"preset":
"grpo", "kl_coef": 0.0}`), built into objects here, in the driver, and shipped to the runs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import shutil
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from rlbench.config import Config
from rlbench.experiments import recipes, stats
from rlbench.runs import checkpoints
from rlbench.runs.progress import bar as progress_bar
from rlbench.runs.progress import in_notebook
from rlbench.runs.sinks import read_jsonl
from rlbench.workers.cluster import Ray, acquire_ray, check_resources, release_ray, worker_runtime_env

SET_BY_THE_SWEEP = ("seed", "cluster", "log_dir", "run_name", "save_dir", "save_every")
"""Session settings a sweep chooses for every run (seeds, its cluster, the run's folder)."""
BUDGET_KEYS = {"steps": int, "evaluate_every": int}
"""Keys a grid point may also set (a budget per task, say), besides Session settings and its own `seeds`."""


@dataclass(frozen=True)
class Run:
    """One run of a sweep: Session settings (plain values), a seed and a budget."""

    settings: dict
    seed: int
    steps: int
    evaluate_every: int | None

    @property
    def run_id(self) -> str:
        """E.g. "dapo-seed1-3f9c2a7b10": the algorithm, the seed and a hash of everything that defines the run."""
        text = json.dumps({"settings": self.settings, "seed": self.seed, "steps": self.steps,
                           "evaluate_every": self.evaluate_every}, sort_keys=True, default=repr)
        algorithm = self.settings.get("algorithm", Config.algorithm)
        name = algorithm if isinstance(algorithm, str) else algorithm.get("preset", algorithm.get("name", "custom"))
        return f"{name}-seed{self.seed}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"

    def stops(self) -> list[int]:
        """The steps at which the run is evaluated (and checkpointed), after step 0."""
        every = self.evaluate_every or self.steps
        return sorted({*range(every, self.steps, every), self.steps})


def plan(grid: dict | Sequence[dict], *, steps: int, seeds: Sequence[int], evaluate_every: int | None = None,
         settings: dict | None = None) -> list[Run]:
    """The runs of a sweep, checked: `grid` is {key: [values]} (every combination) or a list of points (dicts);
    each point's settings are `settings` with the point's put in; a point may set its own `steps`,
    `evaluate_every` and `seeds`. A `RecipeError` names the key at fault (`grid.lr`, `settings.model`) and what it
    accepts."""
    recipes.check_seeds(seeds, "seeds")
    settings = recipes.check_session(_session_part(settings or {}, "settings."), "settings.")
    points = list(_points(grid))
    runs = []
    for i, point in enumerate(points):
        prefix = "grid." if isinstance(grid, dict) else f"grid[{i}]."
        budget = {"steps": steps, "evaluate_every": evaluate_every} | {k: point[k] for k in BUDGET_KEYS if k in point}
        for key, value in budget.items():
            if not (value is None and key == "evaluate_every") and not (isinstance(value, int) and value > 0):
                raise recipes.RecipeError(f"{prefix if key in point else ''}{key}: must be a positive integer, got "
                                          f"{value!r}")
        merged = recipes.check_session(settings | _session_part(point, prefix), prefix)
        point_seeds = recipes.check_seeds(point["seeds"], f"{prefix}seeds") if "seeds" in point else seeds
        runs += [Run(merged, seed, budget["steps"], budget["evaluate_every"]) for seed in point_seeds]
    if not runs:
        raise recipes.RecipeError("grid: a sweep needs at least one point")
    first: dict[str, Run] = {}
    for run in runs:  # a repeated value (lr: [1e-4, 0.0001]) would train one run twice into one folder
        if (same := first.setdefault(run.run_id, run)) is not run:
            raise recipes.RecipeError(f"grid: two points make the same run {run.run_id} (seed {run.seed}, "
                                      f"{json.dumps(same.settings, sort_keys=True, default=repr):.200}): drop the "
                                      f"repeated value")
    return runs


def _points(grid: dict | Sequence[dict]) -> Iterator[dict]:
    """The grid's points: every combination of a {key: [values]} grid, or a list of points as given."""
    if not isinstance(grid, dict):
        yield from (dict(point) for point in grid)
        return
    for key, values in grid.items():
        if not isinstance(values, (list, tuple)) or not values:
            raise recipes.RecipeError(f"grid.{key}: expected a non-empty list of values, got {values!r}")
    for combination in itertools.product(*grid.values()):
        yield dict(zip(grid, combination))


def _session_part(point: dict, prefix: str) -> dict:
    """A point's Session settings (without its budget keys); a setting the sweep chooses is refused."""
    for key in SET_BY_THE_SWEEP:
        if key in point:
            raise recipes.RecipeError(f"{prefix}{key}: set by the sweep (seeds, cluster, out_dir), not by a point")
    return {k: v for k, v in point.items() if k not in BUDGET_KEYS and k != "seeds"}


# --------------------------------------------------------------------------------------- the sweep
class Sweep:
    """A grid of runs (`plan`), their results as they come (`results()`, `run()`), and what they say (`table`,
    `runs`, `summary`, `compare`, `plot`). Displayed in a notebook: its counts of runs by status and, once runs
    finished, the summary of those; running in a notebook, it shows that below its progress bar, redrawn as each
    run ends."""

    def __init__(self, grid: dict | Sequence[dict], *, steps: int, seeds: Sequence[int] = (0,),
                 evaluate_every: int | None = None, settings: dict | None = None, out_dir: str | os.PathLike = "runs/sweep",
                 cluster: str | Ray | None = None, cpus_per_run: int = 1, gpus_per_run: float | None = None,
                 keep_checkpoints: bool = False, on_result: Callable[[Sweep, dict], None] | None = None):
        self.planned = plan(grid, steps=steps, seeds=seeds, evaluate_every=evaluate_every, settings=settings)
        """Every run of the sweep, in grid order then seed order."""
        if not (cluster in (None, "inline") or isinstance(cluster, Ray)):
            raise recipes.RecipeError(f"cluster: {cluster!r} is not one of: None (RAY_ADDRESS, else a private local "
                                      f"Ray), 'inline' (one run after another in this process), rl.Ray(address=...)")
        if not isinstance(cpus_per_run, int) or cpus_per_run < 1:
            raise recipes.RecipeError(f"cpus_per_run: must be a positive integer, got {cpus_per_run!r}")
        self.out_dir = Path(out_dir).resolve()
        self.cluster, self.cpus_per_run, self.gpus_per_run = cluster, cpus_per_run, gpus_per_run
        self.keep_checkpoints, self.on_result = keep_checkpoints, on_result
        self.columns = ["algorithm", *[k for k in _varying(self.planned) if k != "algorithm"]]
        """The settings that tell the runs apart (the algorithm always): the table's setting columns."""
        self.results_by_run: dict[str, dict] = {}
        """Run id -> its result ({"run_id", "status", "error", "rows"}), for the runs that ended so far."""

    # ---------------------------------------------------------------------------------- running
    def run(self, *, progress: bool = True) -> Sweep:
        """Run every run not finished yet (see `results`); returns self."""
        for _ in self.results(progress=progress):
            pass
        return self

    def results(self, *, progress: bool = True) -> Iterator[dict]:
        """Run the sweep, yielding each run's result as it ends ({"run_id", "status": "done" | "error", "error",
        "rows"}); the runs `out_dir` holds finished come first, without running again. With `progress`, a progress
        bar over runs and, in a notebook, the sweep's table below it (`_repr_html_`), redrawn as each run ends."""
        bar = progress_bar(total=len(self.planned), desc=f"sweep {self.out_dir.name}", unit="run", disable=not progress)
        shown = None
        if progress and in_notebook():
            from IPython.display import display

            shown = display(self, display_id=True)
        todo = []
        for run in self.planned:
            result = finished(self.out_dir / run.run_id)
            if result is None:
                todo.append(run)
                continue
            yield self._add(result, bar, shown)
        for result in self._execute(todo):
            yield self._add(result, bar, shown)
        bar.close()

    def _execute(self, runs: list[Run]) -> Iterator[dict]:
        """Each run's result as it ends: inline, one after another; on Ray, as Ray tasks of their own."""
        jobs = [(run, str(self.out_dir / run.run_id), recipes.session_kwargs(run.settings)) for run in runs]
        if not jobs:
            return
        if self.cluster == "inline":
            for job in jobs:
                yield train_run(*job, threads=None, keep_checkpoints=self.keep_checkpoints)
            return
        acquire_ray(self.cluster or Ray(), cpus_needed=self.cpus_per_run)  # names the package when Ray is missing
        import ray

        pending: dict = {}
        try:
            gpus = self.gpus_per_run if self.gpus_per_run is not None else min(ray.cluster_resources().get("GPU", 0), 1)
            check_resources(self.cpus_per_run, gpus, "a sweep's run")
            remote = ray.remote(train_run).options(num_cpus=self.cpus_per_run, num_gpus=gpus, max_retries=0,
                                                   runtime_env=worker_runtime_env())
            pending = {remote.remote(*job, threads=self.cpus_per_run, keep_checkpoints=self.keep_checkpoints): job[0]
                       for job in jobs}
            while pending:
                [ref], _ = ray.wait(list(pending))
                run = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as error:  # the task's process died (killed, out of memory)
                    log = RunLog(self.out_dir / run.run_id)
                    log.event("error", error=str(error))
                    result = {"run_id": run.run_id, "status": "error", "error": str(error).strip().splitlines()[-1],
                              "rows": log.evaluations()}
                yield result
        finally:
            for ref in pending:  # interrupted: the runs still going are stopped (they resume on the next call)
                ray.cancel(ref, force=True)
            release_ray()

    def _add(self, result: dict, bar, shown) -> dict:
        self.results_by_run[result["run_id"]] = result
        bar.update(1)
        if shown is not None:
            shown.update(self)
        failed = sum(r["status"] == "error" for r in self.results_by_run.values())
        if failed:
            bar.set_postfix(failed=failed)
        if self.on_result is not None:
            self.on_result(self, result)
        return result

    # -------------------------------------------------------------------------------- the results
    @property
    def table(self) -> pd.DataFrame:
        """One row per run and evaluation point: `run_id`, the settings that tell runs apart (`columns`), `seed`,
        `step`, `tokens` (response tokens generated so far), `greedy_accuracy`, `sampled_accuracy`, `greedy_reward`,
        `sampled_reward`, `reward_mean` (the training reward over the steps since the previous evaluation),
        `wall_s` (the run's seconds so far: building, training, evaluating) and the run's `status`."""
        rows = [self._settings_of(run) | row | {"status": result["status"]}
                for run in self.planned if (result := self.results_by_run.get(run.run_id)) for row in result["rows"]]
        return pd.DataFrame(rows, columns=None if rows else ["run_id", *self.columns, "seed", "step", "status"])

    @property
    def runs(self) -> pd.DataFrame:
        """One row per run: `run_id`, its settings (`columns`), `seed`, `status` ("done", "error", or "pending"
        when it has not ended in this sweep yet), `error` ("Type: message" of what it raised), `step` reached, last
        `greedy_accuracy`, `wall_s`."""
        rows = []
        for run in self.planned:
            result = self.results_by_run.get(run.run_id, {"status": "pending", "error": None, "rows": []})
            last = result["rows"][-1] if result["rows"] else {}
            rows.append(self._settings_of(run) | {"seed": run.seed, "status": result["status"],
                                                  "error": result["error"], "step": last.get("step"),
                                                  "greedy_accuracy": last.get("greedy_accuracy"),
                                                  "wall_s": last.get("wall_s")})
        return pd.DataFrame(rows)

    def per_run(self, metric: str = "greedy_accuracy", *, budget: float | None = None) -> pd.DataFrame:
        """One row per finished run: `final` `metric`, `auc` (the learning curve's area over steps, divided by
        the step span) and `at_budget` (the metric at `budget` generated tokens, default the fewest any finished
        run generated: compute-normalised), with the run's settings (`rlbench.experiments.stats.run_summaries`)."""
        done = self.table[self.table["status"] == "done"]
        if done.empty:
            raise ValueError("no run of this sweep has finished yet")
        return stats.run_summaries(done, metric=metric, budget=budget)

    def summary(self, metric: str = "greedy_accuracy", *, by: Sequence[str] | None = None,
                budget: float | None = None, **bootstrap) -> pd.DataFrame:
        """Per arm (the values of `by`, default `columns`): mean over seeds of the final `metric`, its AUC and its
        value at the token budget, each with its 95% percentile-bootstrap interval (`rlbench.experiments.stats.summarize`)."""
        return stats.summarize(self.per_run(metric, budget=budget), by or self.columns, **bootstrap)

    def compare(self, baseline: dict | None = None, metric: str = "greedy_accuracy", *,
                by: Sequence[str] | None = None, budget: float | None = None, **bootstrap) -> pd.DataFrame:
        """Each arm against its baseline arm (default {"algorithm": "grpo"}): differences of the means of the
        final value, AUC and value at the token budget, their intervals and whether 0 lies outside them
        (`rlbench.experiments.stats.compare`)."""
        return stats.compare(self.per_run(metric, budget=budget), by or self.columns, baseline or {"algorithm": "grpo"},
                             **bootstrap)

    def plot(self, metric: str = "greedy_accuracy", *, x: str = "step", by: str | None = None,
             reference: str | None = None, per_panel: int = 6):
        """A Figure of learning curves: per arm (the values of column `by`; default every setting of `columns`, e.g.
        "dapo lr=0.0003") the mean of `metric` over seeds against `x` ("step" or "tokens") with its interval as a band;
        at most `per_panel` arms a panel, `reference` (an arm, e.g. "grpo lr=0.0001") drawn in every panel."""
        import matplotlib.pyplot as plt

        table = self.table[self.table["status"] == "done"]
        if by is None:
            by, first = "arm", self.columns[0]
            table = table.assign(arm=table.apply(lambda row: " ".join(
                [str(row[first]), *(f"{k}={row[k]}" for k in self.columns[1:])]), axis=1))
        groups = curve_panels(list(dict.fromkeys(table[by])), reference, per_panel)
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.8), squeeze=False)
        plt.close(fig)
        for ax, arms in zip(axes[0], groups):
            draw_curves(ax, table, by, arms, metric=metric, x=x, reference=reference)
        fig.tight_layout()
        return fig

    def _settings_of(self, run: Run) -> dict:
        return {"run_id": run.run_id} | {k: _cell(_value(run, k)) for k in self.columns}

    def __repr__(self) -> str:
        return f"sweep {self._counts()}"

    def _repr_html_(self) -> str:
        runs = self.runs
        done = (runs["status"] == "done").any()
        body = (self.summary() if done else runs).round(3).to_html(index=False)
        return f"<div><b>sweep</b> {self._counts()}</div>{body}"

    def _counts(self) -> str:
        """E.g. "/runs/lr: 8 runs, 6 done, 1 error, 1 pending"."""
        runs = self.runs
        return f"{self.out_dir}: {len(runs)} runs, " + ", ".join(
            f"{n} {status}" for status, n in runs["status"].value_counts().items())


def sweep(grid: dict | Sequence[dict], *, steps: int, seeds: Sequence[int] = (0,), evaluate_every: int | None = None,
          settings: dict | None = None, out_dir: str | os.PathLike = "runs/sweep", cluster: str | Ray | None = None,
          cpus_per_run: int = 1, gpus_per_run: float | None = None, keep_checkpoints: bool = False,
          on_result: Callable[[Sweep, dict], None] | None = None, progress: bool = True) -> Sweep:
    """Run a grid of Session settings x seeds and return the `Sweep` (its `table`, `runs`, `summary()`, ...).

    `grid`: {key: [values]} (every combination) or a list of points (dicts); keys are Session settings, plus
    `steps` / `evaluate_every` / `seeds` for a point's own budget. `settings`: what every run shares (model, task...).
    `steps` training steps per run, evaluated (held-out `Session.evaluate()`) at step 0, every `evaluate_every`
    steps and at the end, checkpointed at each evaluation. `cluster`: None, RAY_ADDRESS's cluster if set, else a
    private local Ray using every core; `rl.Ray(address=...)` a cluster to join; "inline" one run after another in
    this process (`breakpoint()` works). Each run is a Ray task with `cpus_per_run` CPUs (its torch threads) and `gpus_per_run` GPUs (None: one where the cluster has
    GPUs). `out_dir/RUN_ID/` keeps each run's logs: calling again skips finished runs and resumes the others.
    `keep_checkpoints`: keep a finished run's last checkpoints (default: removed when it finishes).
    `on_result(sweep, result)` is called as each run ends.
    """
    return Sweep(grid, steps=steps, seeds=seeds, evaluate_every=evaluate_every, settings=settings, out_dir=out_dir,
                 cluster=cluster, cpus_per_run=cpus_per_run, gpus_per_run=gpus_per_run,
                 keep_checkpoints=keep_checkpoints, on_result=on_result).run(progress=progress)


def _varying(runs: list[Run]) -> list[str]:
    """The settings (and budget keys) whose value is not the same in every run, in first-seen order."""
    keys = list(dict.fromkeys(k for run in runs for k in [*run.settings, *BUDGET_KEYS]))
    return [k for k in keys if len({json.dumps(_value(run, k), sort_keys=True, default=repr) for run in runs}) > 1]


def _value(run: Run, key: str):
    """A run's value of a setting (its default where the run does not set it) or of a budget key."""
    return getattr(run, key) if key in BUDGET_KEYS else run.settings.get(key, getattr(Config, key))


def _cell(value):
    """A setting as a table cell: a table (dict) becomes its JSON text, so that cells can be grouped."""
    return json.dumps(value, sort_keys=True) if isinstance(value, dict) else value


# ------------------------------------------------------------------------------------- one run
class RunLog:
    """A run's files in its folder: `log.jsonl` (events: "start" for every attempt, "restored" with the checkpoint's
    step, "done", "error" with its traceback) and `evals.jsonl` (the table's rows, one per evaluation)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.log, self.evals = self.folder / "log.jsonl", self.folder / "evals.jsonl"

    def event(self, kind: str, **fields) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as file:
            file.write(json.dumps({"event": kind, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields},
                                  default=repr) + "\n")

    def events(self) -> list[dict]:
        return read_jsonl(self.log).to_dict("records") if self.log.is_file() else []

    def evaluations(self, upto: int | None = None) -> list[dict]:
        """The evaluation rows; with `upto`, only those of steps up to it, and the file rewritten to hold just
        them (a resumed run redoes the steps after its checkpoint)."""
        rows = read_jsonl(self.evals).to_dict("records") if self.evals.is_file() else []
        if upto is not None:
            rows = [row for row in rows if row["step"] <= upto]
            partial = self.evals.with_suffix(".jsonl.partial")
            partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
            os.replace(partial, self.evals)
        return rows

    def add_evaluation(self, row: dict) -> dict:
        with self.evals.open("a") as file:
            file.write(json.dumps(row) + "\n")
        return row


def finished(folder: Path) -> dict | None:
    """A run's result when its folder says it finished (its log's last event is "done"), else None."""
    log = RunLog(folder)
    events = log.events()
    if not events or events[-1]["event"] != "done":
        return None
    return {"run_id": folder.name, "status": "done", "error": None, "rows": log.evaluations()}


def train_run(run: Run, folder: str, session_kwargs: dict, *, threads: int | None, keep_checkpoints: bool) -> dict:
    """One run in `folder` (a Ray task, or inline): from its last checkpoint if it has one, else from the start;
    evaluate, train to the next evaluation point, evaluate, checkpoint, ... to `run.steps`. Returns its result; an
    exception is recorded in its log and result, not raised."""
    import rlbench as rl

    log, start = RunLog(folder), time.perf_counter()
    rows: list[dict] = []
    kwargs = ({} if threads is None else {"threads": threads}) | session_kwargs | {
        "seed": run.seed, "cluster": "inline", "log_dir": str(log.folder.parent), "run_name": log.folder.name,
        "keep_last": 2}
    root = log.folder / "checkpoints"
    log.event("start", pid=os.getpid(), settings=run.settings, seed=run.seed, steps=run.steps,
              evaluate_every=run.evaluate_every)
    try:
        if checkpoints.step_dirs(root):
            session = rl.Session.restore(root, **kwargs)
            log.event("restored", from_step=session.step_count)
        else:
            (log.folder / "metrics.jsonl").unlink(missing_ok=True)  # an attempt that ended before its first checkpoint
            session = rl.Session(**kwargs)
        with session:
            rows = log.evaluations(upto=session.step_count)
            offset = rows[-1]["wall_s"] if rows else 0.0  # a resumed run's seconds go on from its checkpoint's

            def evaluation(previous: int) -> dict:
                return log.add_evaluation(_evaluation(session, run, previous, offset + time.perf_counter() - start))

            if not rows:
                rows.append(evaluation(0))
            for stop in [s for s in run.stops() if s > session.step_count]:
                session.run(stop - session.step_count, progress=False)
                rows.append(evaluation(rows[-1]["step"]))
                session.save()
        log.event("done", wall_s=rows[-1]["wall_s"])
        if not keep_checkpoints:
            shutil.rmtree(root, ignore_errors=True)
        return {"run_id": log.folder.name, "status": "done", "error": None, "rows": rows}
    except Exception as error:
        log.event("error", error=traceback.format_exc())
        return {"run_id": log.folder.name, "status": "error", "error": f"{type(error).__name__}: {error}",
                "rows": rows}


def _evaluation(session, run: Run, previous: int, wall_s: float) -> dict:
    """The table's row for `session` now: held-out accuracy and reward, tokens generated so far, the training
    reward over the steps since step `previous`, the run's seconds so far."""
    metrics = session.metrics
    since = metrics[metrics["step"] >= previous] if len(metrics) else metrics
    return {"run_id": session.run_name, "seed": run.seed, "step": session.step_count,
            "tokens": int(metrics["tokens_generated"].sum()) if len(metrics) else 0, **session.evaluate(),
            "reward_mean": float(since["reward_mean"].mean()) if len(since) else math.nan, "wall_s": wall_s}


# ------------------------------------------------------------------------------------- plotting
def curve_panels(arms: list, reference=None, per_panel: int = 6) -> list[list]:
    """Arms split into as few panels as hold at most `per_panel` lines each, `reference` (when among the arms) in
    every one, the others in order, panel sizes differing by one at most (21 others, 6 a panel: 5, 4, 4, 4, 4)."""
    others = [arm for arm in arms if arm != reference]
    head = [reference] if reference in arms else []
    count = max(math.ceil(len(others) / max(per_panel - len(head), 1)), 1)
    size, extra = divmod(len(others), count)
    ends = list(itertools.accumulate(size + (i < extra) for i in range(count)))
    return [head + others[end - size - (i < extra):end] for i, end in enumerate(ends)]


def draw_curves(ax, table: pd.DataFrame, by: str, arms: list, *, metric: str = "greedy_accuracy", x: str = "step",
                reference=None, colors: dict | None = None) -> None:
    """Into `ax`: for each arm (a value of column `by`) the mean of `metric` over its runs at each `x` and the 95%
    bootstrap interval as a band (`rlbench.experiments.stats.curve_bands`); `reference` in black. `x`: "step", or "tokens"
    (each run's evaluations are at its own token counts, so the curve is over the runs' mean tokens per step)."""
    from matplotlib.ticker import MaxNLocator

    rows = table[table[by].isin(arms)]
    bands = stats.curve_bands(rows, [by], metric=metric, x="step")
    xs = rows.groupby([by, "step"])[x].mean()
    for i, arm in enumerate(arms):
        band = bands[bands[by] == arm]
        color = "black" if arm == reference else (colors or {}).get(arm, f"C{i}")
        at = [xs[(arm, s)] for s in band["step"]]
        ax.plot(at, band["mean"], color=color, label=str(arm), linewidth=1.4)
        ax.fill_between(at, band["lo"], band["hi"], color=color, alpha=0.15, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("generated tokens" if x == "tokens" else x, fontsize=8)
    ax.set_ylabel(metric.replace("_", " "), fontsize=8)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=7, loc="best")


# ------------------------------------------------------------------------------------ sweep files
SWEEP_FILE = {"description": str, "steps": int, "evaluate_every": int, "seeds": list, "out_dir": str, "cluster": str,
              "cpus_per_run": int, "gpus_per_run": float, "keep_checkpoints": bool, "settings": dict, "grid": dict}
"""The keys of a sweep file (`rlbench sweep FILE.toml`): `rl.sweep`'s arguments; `cluster` is "inline" or a Ray
address (absent: a private local Ray); `out_dir` defaults to runs/sweeps/<the file's name>."""


def load(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Sweep:
    """The `Sweep` of a TOML sweep file with `KEY=VALUE` overrides (`grid.lr=[1e-4, 3e-4]`, `steps=20`), every run
    planned and checked, none started; a `RecipeError` names the key at fault and what it accepts.

        steps = 300
        evaluate_every = 25
        seeds = [0, 1, 2]
        [settings]                      # what every run shares: rl.Session keyword arguments, as in a recipe
        model = "tiny-arith"
        task = "arithmetic"
        [grid]                          # every combination of these values
        algorithm = ["grpo", "dapo"]
        lr = [1e-4, 3e-4]
    """
    raw = recipes.read_toml(path, overrides)
    recipes.check_keys("", raw, SWEEP_FILE)
    for key in ("steps", "grid"):
        if key not in raw:
            raise recipes.RecipeError(f"{key}: missing (a sweep file needs steps and a [grid] table)")
    cluster = raw.get("cluster")
    return Sweep(raw["grid"], steps=raw["steps"], seeds=raw.get("seeds", [0]), evaluate_every=raw.get("evaluate_every"),
                 settings=raw.get("settings"), out_dir=raw.get("out_dir", f"runs/sweeps/{Path(path).stem}"),
                 cluster=cluster if cluster in (None, "inline") else Ray(address=cluster),
                 cpus_per_run=raw.get("cpus_per_run", 1), gpus_per_run=raw.get("gpus_per_run"),
                 keep_checkpoints=raw.get("keep_checkpoints", False))
