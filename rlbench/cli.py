"""`rlbench`: run and reproduce recipes, evaluate a model, build the CPU leaderboard, run the benchmarks.

    rlbench run algorithms/grpo/arithmetic-tiny.toml session.lr=3e-4 steps=50   # train; --dry-run: check only
    rlbench reproduce algorithms/grpo/arithmetic-tiny.toml                      # train, evaluate, PASS / FAIL
    rlbench eval MODEL_DIR --task arithmetic --samples 8                        # greedy, pass@k, maj@k
    rlbench sweep sweep.toml grid.lr=[1e-4,3e-4] steps=50                       # a grid x seeds as Ray tasks
    rlbench leaderboard                                                         # algorithms/LEADERBOARD.md + .png
    rlbench bench [step sampler ...] [--all]                                    # benchmarks/*.py, JSON lines

Overrides are dotted `KEY=VALUE` into the recipe (see `rlbench.experiments.recipes`); a bad one stops before any work
with a message naming the key and what it accepts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from rlbench import algorithms, models, tasks
from rlbench.config import Config
from rlbench.experiments import recipes, stats, sweeps
from rlbench.models.lora import LoRA

LEADERBOARD_SPEC = "algorithms/leaderboard.toml"
QUICK_BENCHMARKS = ("sampler", "step")
"""What `rlbench bench` runs without names: the benchmarks that take a minute or two on 2 cores."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)  # overrides may also follow an option: run R --dry-run k=v
    if extra and (not hasattr(args, "overrides") or any(e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = getattr(args, "overrides", []) + extra
    try:
        return args.command(args) or 0
    except recipes.RecipeError as e:
        print(f"rlbench {args.name}: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlbench", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, fn, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.set_defaults(command=fn, name=name)
        return sub

    for name, fn, help in [("run", run, "train a recipe (steps from the recipe) and evaluate"),
                           ("reproduce", reproduce, "train a recipe, evaluate, compare with its target")]:
        sub = command(name, fn, help)
        sub.add_argument("recipe", help="a recipe file, e.g. algorithms/grpo/arithmetic-tiny.toml")
        sub.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. session.lr=3e-4 steps=50")
        sub.add_argument("--dry-run", action="store_true", help="check the recipe and print its settings; "
                         "load no weights and no data")
    sub = command("eval", evaluate, "held-out greedy accuracy, pass@k and maj@k of a model on a task")
    sub.add_argument("model", help="a local Hugging Face model directory or a built-in model name")
    sub.add_argument("--task", required=True, help="a built-in task name, or a verl-schema .parquet / .jsonl "
                     "file (all its rows are evaluated)")
    sub.add_argument("--samples", type=int, default=8, help="k of pass@k and maj@k (sampled completions per prompt)")
    sub.add_argument("--temperature", type=float, default=None, help="default: the session's (1.0)")
    sub.add_argument("--max-new-tokens", type=int, default=None, help="default: the session's (16)")
    sub.add_argument("--max-prompts", type=int, default=None, help="evaluate only the first N prompts")
    sub.add_argument("--seed", type=int, default=0)
    sub = command("sweep", sweep, "a grid of session settings x seeds (a TOML sweep file), each run a Ray task; "
                  "prints each arm's accuracy with 95%% intervals")
    sub.add_argument("file", help="a sweep file (see rlbench.experiments.sweeps.load)")
    sub.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. grid.lr=[1e-4,3e-4] steps=50 seeds=[0]")
    sub.add_argument("--dry-run", action="store_true", help="check the file and print its runs; run nothing")
    sub = command("leaderboard", leaderboard, "every preset on the leaderboard's tasks and seeds (a sweep); writes "
                  "LEADERBOARD.md and its learning curves")
    sub.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. steps=5 seeds=[0] presets=[\"grpo\"]")
    sub.add_argument("--spec", default=LEADERBOARD_SPEC, help="the leaderboard's settings (default: %(default)s)")
    sub.add_argument("--out", default="algorithms/LEADERBOARD.md", help="markdown file; the plot goes next to it")
    sub.add_argument("--runs", default="runs/leaderboard", help="the runs' folders: a finished run there is not run "
                     "again, an interrupted one resumes (default: %(default)s)")
    sub = command("bench", bench, "run benchmark scripts of benchmarks/ (each prints JSON)")
    sub.add_argument("names", nargs="*", help=f"script names without .py (default: the quick ones, "
                     f"{' '.join(QUICK_BENCHMARKS)})")
    sub.add_argument("--all", action="store_true", help="every script of the folder (some run for many minutes)")
    sub.add_argument("--dir", default="benchmarks")
    return parser


# --------------------------------------------------------------------------------------- run / reproduce
def run(args) -> int:
    recipe = recipes.load(args.recipe, args.overrides)
    print(f"{recipe.path}: {recipe.description} [{recipe.hardware}]")
    if args.dry_run:
        print(json.dumps({"steps": recipe.steps, "session": recipe.config().to_dict()},
                         default=lambda value: value.to_dict() if isinstance(value, LoRA) else str(value)))
        return 0
    print(json.dumps(train_and_evaluate(recipe)))
    return 0


def reproduce(args) -> int:
    recipe = recipes.load(args.recipe, args.overrides)
    target = recipe.target
    if target is None:
        raise recipes.RecipeError(f"target: {recipe.path} has no [target] to reproduce (use `rlbench run`)")
    if args.dry_run:
        return run(args)
    result = train_and_evaluate(recipe)
    value = result["after"][target.metric]
    verdict = "PASS" if target.passed(value) else "FAIL"
    print(json.dumps(result))
    print(f"{verdict}: {target.metric} {value:.3f} after {recipe.steps} steps (before: "
          f"{result['before'][target.metric]:.3f}); target {target.value:.3f} - tolerance {target.tolerance:.3f} "
          f"= {target.value - target.tolerance:.3f} ({target.source})")
    return 0 if verdict == "PASS" else 1


def train_and_evaluate(recipe: recipes.Recipe) -> dict:
    """Evaluate, train `recipe.steps` steps, evaluate again; returns both evaluations, wall time, run name."""
    import rlbench as rl

    _check_model(recipe.session.get("model", Config.model), "session.model")
    with rl.Session(**recipe.session_kwargs()) as session:
        print(session, flush=True)
        before = session.evaluate()
        start = time.perf_counter()
        session.run(recipe.steps, progress=sys.stderr.isatty())
        seconds = time.perf_counter() - start
        after = session.evaluate()
        tail = session.metrics["reward_mean"].tail(10).mean()
        return {"recipe": recipe.path, "steps": recipe.steps, "train_seconds": round(seconds, 1),
                "reward_last10": round(float(tail), 4), "before": before, "after": after, "run": session.run_name}


# -------------------------------------------------------------------------------------------------- eval
def evaluate(args) -> int:
    import rlbench as rl

    _check_positive(args, "samples", "max_prompts", "max_new_tokens")
    _check_model(args.model, "model")
    task = recipes.build_task(_eval_task(args.task))
    given = {key: value for key, value in [("max_new_tokens", args.max_new_tokens), ("temperature", args.temperature)]
             if value is not None}  # else the session's default
    with rl.Session(model=args.model, task=task, cluster="inline", log_dir=None, seed=args.seed, **given) as session:
        prompts = len(list(session.task.test)[:args.max_prompts])
        result = session.evaluate(max_prompts=args.max_prompts, samples=args.samples)
    print(json.dumps({"model": args.model, "task": args.task, "k": args.samples, "prompts": prompts, **result}))
    return 0


def _check_model(model: str, key: str) -> None:
    """A `RecipeError` naming `key` when `model` is neither a built-in name nor a local model directory."""
    try:
        models.check(model)
    except ValueError as error:
        raise recipes.RecipeError(f"{key}: {error}") from None


def _check_positive(args, *names: str) -> None:
    """A `RecipeError` naming the first option given a value below 1."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise recipes.RecipeError(f"--{name.replace('_', '-')}: must be a positive integer, got {value}")


def _eval_task(task: str):
    """A task spec for `rlbench eval`: a built-in name, or a data file whose rows are all held out."""
    return {"train": task, "test": task} if Path(task).suffix in (".parquet", ".jsonl") else task


# ------------------------------------------------------------------------------------------------- sweep
def sweep(args) -> int:
    run = sweeps.load(args.file, args.overrides)
    if args.dry_run:
        for planned in run.planned:
            print(json.dumps({"run_id": planned.run_id, "seed": planned.seed, "steps": planned.steps,
                              "evaluate_every": planned.evaluate_every, "settings": planned.settings}))
        return 0
    print(f"{args.file}: {len(run.planned)} runs into {run.out_dir}", flush=True)
    for result in run.results(progress=sys.stderr.isatty()):
        last = result["rows"][-1] if result["rows"] else {}
        print(f"{result['run_id']}: {result['status']}" + (f" ({result['error']})" if result["error"] else
              f", greedy accuracy {last['greedy_accuracy']:.3f} at step {last['step']}"), flush=True)
    run.table.to_json(run.out_dir / "table.jsonl", orient="records", lines=True)
    failed = int((run.runs["status"] == "error").sum())
    if failed < len(run.planned):
        for row in run.summary().to_dict("records"):
            print(json.dumps(row))
        run.plot().savefig(run.out_dir / "curves.png", dpi=100)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------- leaderboard
def leaderboard(args) -> int:
    spec = recipes.load_leaderboard(args.spec, args.overrides)
    commit = _commit()  # the code the runs run, before anyone edits the checkout meanwhile
    start = time.perf_counter()
    table = run_leaderboard(spec, args.runs)
    minutes = (time.perf_counter() - start) / 60
    spec_option = ["--spec", args.spec] if args.spec != LEADERBOARD_SPEC else []
    command = " ".join(["rlbench leaderboard", *args.overrides, *spec_option])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_json(out.with_suffix(".jsonl"), orient="records", lines=True)
    out.write_text(leaderboard_markdown(table, spec, command=command, minutes=minutes, commit=commit))
    plot_leaderboard(table, spec, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} in {minutes:.1f} min")
    return 0


def run_leaderboard(spec: recipes.Leaderboard, runs_dir: str | os.PathLike) -> pd.DataFrame:
    """Every (task, preset, seed) as one sweep (`rl.sweep`: Ray tasks of 1 CPU each, `spec.workers` at once; one
    at a time in this process with 1 worker); its table with the task's label (`board`) and the preset. A preset
    runs on the tasks it can (`cannot_run`; `leaderboard_markdown` names the others); the task's `teacher` goes
    only to the presets that distil."""
    from rlbench.workers.cluster import Ray

    points, labels = [], []
    for label, settings in spec.tasks.items():
        for preset in spec.presets:
            if cannot_run(settings, preset):
                continue
            kept = settings if algorithms.get(preset).needs_teacher else {k: v for k, v in settings.items()
                                                                          if k != "teacher"}
            points.append(kept | {"algorithm": preset, "threads": 1} | spec.budgets[label])
            labels += [label] * len(spec.budgets[label]["seeds"])
    grid = sweeps.Sweep(points, steps=1, out_dir=runs_dir,
                        cluster="inline" if spec.workers == 1 else Ray(num_cpus=spec.workers))
    board = {run.run_id: label for label, run in zip(labels, grid.planned)}
    for result in grid.results(progress=False):
        last = result["rows"][-1] if result["rows"] else {}
        print(f"[{len(grid.results_by_run)}/{len(grid.planned)}] {board[result['run_id']]} {result['run_id']}: "
              + (f"error: {result['error']}" if result["error"] else f"greedy {result['rows'][0]['greedy_accuracy']:.3f}"
                 f" -> {last['greedy_accuracy']:.3f} ({last['wall_s']:.0f}s)"), flush=True)
    runs = grid.runs
    for failure in runs[runs["status"] == "error"].to_dict("records"):
        print(f"failed: {board[failure['run_id']]} {failure['run_id']}: {failure['error']}", file=sys.stderr)
    table = grid.table.rename(columns={"algorithm": "preset"})
    return table.assign(board=table["run_id"].map(board))


def cannot_run(settings: dict, preset: str) -> str | None:
    """Why the preset cannot train on a task with these settings (it distils and they name no teacher, or it
    credits turns and the task is single-turn), else None."""
    algorithm = algorithms.get(preset)
    if algorithm.needs_teacher and not settings.get("teacher"):
        return "they distil from a teacher, and this task names none"
    if algorithm.needs_turns and not isinstance(tasks.get(settings.get("task", Config.task)), tasks.AgentTask):
        return "they credit each turn of an episode, and this task is single-turn"
    return None


def leaderboard_markdown(table: pd.DataFrame, spec: recipes.Leaderboard, *, command: str, minutes: float,
                         commit: str) -> str:
    """The leaderboard page: how to reproduce it, each task's settings and budget, one table per task sorted by
    final accuracy, with 95% bootstrap intervals over seeds and each preset's difference from GRPO."""
    lines = [
        "# CPU leaderboard of the algorithm zoo", "",
        f"Reproduce: `{command}` at commit `{commit}` (made on {time.strftime('%Y-%m-%d')}), settings in "
        f"`{spec.path}`: {len(spec.presets)} presets (every preset unless `presets` is set; each task runs those it "
        f"can), each task's seeds and budget under its heading, on {os.cpu_count()} CPU cores ({platform.machine()}), {spec.workers} runs at once "
        f"({'Ray tasks, ' if spec.workers > 1 else ''}1 torch thread each). **Total wall time: {minutes:.1f} min** for "
        f"{table['run_id'].nunique()} runs, whose own times add up to {table.groupby('run_id')['wall_s'].max().sum() / 60:.1f}"
        f" min (a run that had finished in the runs folder is not run again: its time is from then).", "",
        "Every run is evaluated on the task's held-out prompts (greedy decoding) before training, every "
        "`evaluate_every` steps and at the end. Columns: the final greedy accuracy; the area under its learning curve "
        "(trapezoids over the evaluations, divided by the steps: the mean accuracy over training); the accuracy at "
        "the task's token budget (the fewest response tokens any run of the task generated, rollouts, extra "
        "dynamic-sampling rounds and greedy baselines included; each run's curve interpolated there: accuracy per "
        "unit of sampling compute); the difference of final accuracy and AUC from GRPO's; wall time and tokens per "
        "run. Each is the mean over seeds with its 95% percentile-bootstrap interval `[lo, hi]` (`rlbench.experiments.stats`: "
        "every resample of the seeds enumerated up to 10,000, else 10,000 seeded draws; for a difference, each arm's "
        "seeds resampled independently). "
        "**Bold** differences have 0 outside their interval. Few seeds give wide intervals (with 3 or fewer, a mean's "
        "interval is the range of the seeds' values): read a difference as real only when bold, and a tiny model's "
        "short budget as how fast each preset starts to learn, not as a ranking at scale.", "",
        "![learning curves](LEADERBOARD.png)", ""]
    for label, settings in spec.tasks.items():
        lines += _task_section(label, settings, spec, table[table["board"] == label])
    return "\n".join(lines)


def _task_section(label: str, settings: dict, spec: recipes.Leaderboard, table: pd.DataFrame) -> list[str]:
    """One task's part of the page: its settings, failures and the table of presets."""
    skipped = {}
    for preset in spec.presets:
        if reason := cannot_run(settings, preset):
            skipped.setdefault(reason, []).append(preset)
    failed = table[table["status"] == "error"].drop_duplicates("run_id")
    done = table[table["status"] == "done"]
    budget = spec.budgets[label]
    lines = [f"## {label}", "", "Settings: " + ", ".join(f"`{k}={v!r}`" for k, v in settings.items())
             + f"; seeds {budget['seeds']}, {budget['steps']} steps, evaluated every {budget['evaluate_every']}; "
             f"before training: greedy "
             f"accuracy {done[done['step'] == 0]['greedy_accuracy'].mean():.3f}."
             + (" `teacher` goes only to the distilling presets." if settings.get("teacher") else "")
             + (" Not run: " + "; ".join(f"{', '.join(names)} ({reason})" for reason, names in skipped.items()) + "."
                if skipped else "")
             + (f" Failed: {', '.join(failed['run_id'])} (their errors: `runs/.../RUN_ID/log.jsonl`)." if len(failed)
                else ""), ""]
    if done.empty:
        return lines
    per_run = stats.run_summaries(done)
    summary = stats.summarize(per_run, ["preset"], columns=("final", "auc", "at_budget", "wall_s", "tokens"))
    versus = stats.compare(per_run, ["preset"], {"preset": "grpo"}, columns=("final", "auc")).set_index("preset")
    lines += [f"| preset | final greedy accuracy | AUC | greedy at {per_run['budget'].iloc[0]:,.0f} tokens | "
              "final − GRPO | AUC − GRPO | wall s / run | tokens / run |", "|---|---|---|---|---|---|---|---|"]
    for row in summary.sort_values("final", ascending=False).to_dict("records"):
        cells = [_with_interval(row, c) for c in ("final", "auc", "at_budget")]
        cells += [_difference(versus, row["preset"], c) for c in ("final", "auc")]
        lines.append(f"| {row['preset']} | {' | '.join(cells)} | {row['wall_s']:.1f} | {row['tokens']:,.0f} |")
    return [*lines, ""]


def _with_interval(row: dict, column: str) -> str:
    return f"{row[column]:.3f} [{row[f'{column}_lo']:.3f}, {row[f'{column}_hi']:.3f}]"


def _difference(versus: pd.DataFrame, preset: str, column: str) -> str:
    """A difference from GRPO with its interval, bold when 0 lies outside it ("—" for GRPO itself)."""
    if preset not in versus.index:
        return "—"
    row = versus.loc[preset]
    diff = f"{row[f'{column}_diff']:+.3f}"
    return f"{f'**{diff}**' if row[f'{column}_real'] else diff} [{row[f'{column}_lo']:+.3f}, {row[f'{column}_hi']:+.3f}]"


def plot_leaderboard(table: pd.DataFrame, spec: recipes.Leaderboard, path: Path, per_panel: int = 6) -> None:
    """Learning curves, one row of panels per task: held-out greedy accuracy against steps, per preset the mean over
    seeds and its 95% bootstrap band; at most `per_panel` presets a panel, GRPO (black) in every one, each preset in
    the same color everywhere."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = table[table["status"] == "done"]
    others = [preset for preset in spec.presets if preset != "grpo"]  # tab20's strong colors first, then its light ones
    colors = {preset: plt.get_cmap("tab20")((2 * i) % 20 + (i // 10) % 2) for i, preset in enumerate(others)}
    panels = {label: sweeps.curve_panels([p for p in spec.presets if p in set(done[done["board"] == label]["preset"])],
                                         "grpo", per_panel) for label in spec.tasks}
    ncols = max(len(groups) for groups in panels.values())
    fig, axes = plt.subplots(len(panels), ncols, figsize=(4.2 * ncols, 3.4 * len(panels)), squeeze=False,
                             sharey="row")  # a task's panels on one scale
    for row, (label, groups) in zip(axes, panels.items()):
        for i, ax in enumerate(row):
            if i >= len(groups) or not groups[i]:
                ax.set_visible(False)
                continue
            sweeps.draw_curves(ax, done[done["board"] == label], "preset", groups[i], reference="grpo", colors=colors)
            ax.set_title(f"{label} ({i + 1}/{len(groups)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _commit() -> str:
    """The checkout's short commit hash ("+" when it has uncommitted changes), or "unknown" outside git."""
    def git(*command: str) -> str:
        return subprocess.run(["git", *command], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    return (commit + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")) if commit else "unknown"


# ------------------------------------------------------------------------------------------------- bench
def bench(args) -> int:
    folder = Path(args.dir)
    if args.all:
        scripts = sorted(p for p in folder.glob("*.py") if "__main__" in p.read_text())
    else:
        scripts = [folder / f"{name}.py" for name in args.names or QUICK_BENCHMARKS]
    missing = [str(p) for p in scripts if not p.is_file()]
    if missing:
        raise recipes.RecipeError(f"names: no benchmark {', '.join(missing)}; accepted: "
                                  f"{', '.join(p.stem for p in sorted(folder.glob('*.py')))}")
    failed = []
    for script in scripts:
        print(f"# {script}", flush=True)
        if subprocess.run([sys.executable, script.name], cwd=folder).returncode:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
