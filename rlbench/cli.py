"""`rlbench`: run and reproduce recipes, evaluate a model, build the CPU leaderboard, run the benchmarks.

    rlbench run algorithms/grpo/arithmetic-tiny.toml session.lr=3e-4 steps=50   # train; --dry-run: check only
    rlbench reproduce algorithms/grpo/arithmetic-tiny.toml                      # train, evaluate, PASS / FAIL
    rlbench eval MODEL_DIR --task arithmetic --samples 8                        # greedy, pass@k, maj@k
    rlbench leaderboard                                                         # algorithms/LEADERBOARD.md + .png
    rlbench bench [step sampler ...] [--all]                                    # benchmarks/*.py, JSON lines

Overrides are dotted `KEY=VALUE` into the recipe (see `rlbench.recipes`); a bad one stops before any work
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
from collections import Counter
from pathlib import Path

from rlbench import algorithms, recipes
from rlbench.lora import LoRA

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
    sub.add_argument("--temperature", type=float, default=1.0)
    sub.add_argument("--max-new-tokens", type=int, default=16)
    sub.add_argument("--max-prompts", type=int, default=None, help="evaluate only the first N prompts")
    sub.add_argument("--seed", type=int, default=0)
    sub = command("leaderboard", leaderboard, "every preset on the leaderboard's tasks and seeds; writes "
                  "LEADERBOARD.md and a plot")
    sub.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. steps=5 seeds=[0] presets=[\"grpo\"]")
    sub.add_argument("--spec", default=LEADERBOARD_SPEC, help="the leaderboard's settings (default: %(default)s)")
    sub.add_argument("--out", default="algorithms/LEADERBOARD.md", help="markdown file; the plot goes next to it")
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

    task = recipes.build_task(_eval_task(args.task))
    session = rl.Session(model=args.model, task=task, cluster="inline", log_dir=None, seed=args.seed,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    result = {"model": args.model, "task": args.task, "k": args.samples,
              **evaluate_at_k(session, args.max_prompts, args.samples)}
    print(json.dumps(result))
    return 0


def _eval_task(task: str):
    """A task spec for `rlbench eval`: a built-in name, or a data file whose rows are all held out."""
    return {"train": task, "test": task} if Path(task).suffix in (".parquet", ".jsonl") else task


def evaluate_at_k(session, max_prompts: int | None, k: int) -> dict:
    """Greedy accuracy, mean sampled accuracy, pass@k and maj@k over the session task's held-out prompts."""
    from rlbench.rewards.answers import extract_gsm8k
    from rlbench.samplers import SamplingParams

    cfg = session.config
    examples = list(session.task.test)[:max_prompts]
    greedy = session.score(session.sampler.generate(examples, SamplingParams(max_new_tokens=cfg.max_new_tokens,
                                                                     temperature=0.0)))
    sampled = session.score(session.sampler.generate(examples, SamplingParams(
        n=k, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)))
    correct_B = _correct(sampled)
    groups = sampled["group_ids"].tolist()
    correct = [[bool(c) for c, g in zip(correct_B, groups) if g == i] for i in range(len(examples))]
    answers = [[extract_gsm8k(text, "flexible") or text.strip() for text, g in zip(sampled["completion"], groups)
                if g == i] for i in range(len(examples))]
    pass_k, maj_k = pass_and_majority(correct, answers)
    return {"prompts": len(examples), "greedy_accuracy": float(_correct(greedy).float().mean()),
            "sampled_accuracy": float(correct_B.float().mean()), f"pass@{k}": pass_k, f"maj@{k}": maj_k}


def pass_and_majority(correct: list[list[bool]], answers: list[list[str]]) -> tuple[float, float]:
    """(pass@k, maj@k) from each prompt's k samples: whether each is correct, and its final answer.

    pass@k: a prompt counts when any sample is correct. maj@k: the most frequent answer (the first of those
    tied) is scored; it is correct when the samples giving it are.
    """
    passed = sum(any(c) for c in correct)
    majority = 0
    for c, a in zip(correct, answers):
        winner = Counter(a).most_common(1)[0][0]
        majority += c[a.index(winner)]
    return passed / len(correct), majority / len(correct)


def _correct(batch):
    """Per-sample correctness: the reward's "acc" component when it has one, else score > 0."""
    return (batch["acc"] if "acc" in batch else batch["score"]).float() > 0


# ------------------------------------------------------------------------------------------- leaderboard
def leaderboard(args) -> int:
    spec = recipes.load_leaderboard(args.spec, args.overrides)
    start = time.perf_counter()
    rows = run_leaderboard(spec)
    minutes = (time.perf_counter() - start) / 60
    spec_option = ["--spec", args.spec] if args.spec != LEADERBOARD_SPEC else []
    command = " ".join(["rlbench leaderboard", *args.overrides, *spec_option])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out.write_text(leaderboard_markdown(rows, spec, command=command, minutes=minutes))
    plot_leaderboard(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} in {minutes:.1f} min")
    return 0


def run_leaderboard(spec: recipes.Leaderboard) -> list[dict]:
    """One row per (task, preset, seed); with more than one worker, runs spread over Ray tasks of 1 CPU each. A
    preset that distils from a teacher runs on the tasks whose settings name one (`teacher`: only those presets get
    it), and is left out of the others (`leaderboard_markdown` says so)."""
    jobs = [(label, spec.tasks[label], preset, seed, spec.steps, spec.reward_at)
            for label in spec.tasks for preset in spec.presets for seed in spec.seeds
            if not needs_missing_teacher(spec.tasks[label], preset)]

    def report(done: int, row: dict) -> None:
        print(f"[{done}/{len(jobs)}] {row['task']} {row['preset']} seed {row['seed']}: greedy {row['before']:.3f} -> "
              f"{row['greedy_accuracy']:.3f} ({row['wall_s']:.0f}s)", flush=True)

    if spec.workers == 1:
        rows = []
        for job in jobs:
            rows.append(leaderboard_run(*job))
            report(len(rows), rows[-1])
        return rows
    import ray

    from rlbench.cluster import Ray, acquire_ray, release_ray

    acquire_ray(Ray(num_cpus=spec.workers), cpus_needed=spec.workers)
    try:
        remote = ray.remote(num_cpus=1)(leaderboard_run)
        pending = [remote.remote(*job) for job in jobs]
        rows = []
        while pending:
            done, pending = ray.wait(pending)
            rows.append(ray.get(done[0]))
            report(len(rows), rows[-1])
        return rows
    finally:
        release_ray()


def needs_missing_teacher(settings: dict, preset: str) -> bool:
    """Whether the preset distils from a teacher and the task's settings name none."""
    return algorithms.get(preset).needs_teacher and not settings.get("teacher")


def leaderboard_run(label: str, settings: dict, preset: str, seed: int, steps: int, reward_at: int) -> dict:
    """One leaderboard cell: held-out greedy accuracy before and after `steps` steps, rewards, time, tokens. The
    task's `teacher` goes only to a preset that distils from one (the others would compute its log-probs unused)."""
    import rlbench as rl

    start = time.perf_counter()
    if not algorithms.get(preset).needs_teacher:
        settings = {k: v for k, v in settings.items() if k != "teacher"}
    kwargs = {"cluster": "inline", "threads": 1, "log_dir": None} | settings | {"algorithm": preset, "seed": seed}
    session = rl.Session(**recipes.session_kwargs(kwargs))
    before = session.evaluate()["greedy_accuracy"]
    session.run(steps, progress=False)
    after = session.evaluate()
    reward, tokens = session.metrics["reward_mean"], session.metrics["tokens_generated"]
    session.close()
    return {"task": label, "preset": preset, "seed": seed, "before": before, **after,
            f"reward@{reward_at}": float(reward[:reward_at].tail(10).mean()),
            f"reward@{steps}": float(reward.tail(10).mean()), "tokens": int(tokens.sum()),
            "wall_s": time.perf_counter() - start}


def leaderboard_markdown(rows: list[dict], spec: recipes.Leaderboard, *, command: str, minutes: float) -> str:
    """The leaderboard page: how it was made, each task's settings, one table per task sorted by accuracy."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    rewards = [f"reward@{spec.reward_at}", f"reward@{spec.steps}"]
    lines = [
        "# CPU leaderboard of the algorithm zoo", "",
        f"Generated by `{command}` from `{spec.path}` on {time.strftime('%Y-%m-%d')}: {len(spec.presets)} presets "
        f"(every single-turn preset unless `presets` is set), {spec.steps} training steps, seeds "
        f"{list(spec.seeds)}, on {os.cpu_count()} CPU cores ({platform.machine()}), {spec.workers} runs at once "
        f"({'Ray tasks, ' if spec.workers > 1 else ''}1 torch thread each). **Total wall time: {minutes:.1f} min** "
        f"for {len(rows)} runs.", "",
        "Columns: held-out greedy accuracy after training (mean ± std over seeds; `before` is the model "
        "before training), sampled accuracy (temperature 1), mean training reward over the 10 steps before "
        "the given step, wall time per run (build, evaluate, train, evaluate) and response tokens generated "
        "per run (rollouts, dynamic-sampling rounds, greedy baselines). A small budget on a tiny model: read it "
        "as how fast each preset starts to learn, not as a ranking of the methods at scale.", ""]
    for label, settings in spec.tasks.items():
        table = frame[frame["task"] == label]
        skipped = [preset for preset in spec.presets if needs_missing_teacher(settings, preset)]
        lines += [f"## {label}", "", "Settings: " + ", ".join(f"`{k}={v!r}`" for k, v in settings.items())
                  + f"; before training: greedy accuracy {table['before'].mean():.3f}."
                  + (" `teacher` goes only to the distilling presets." if settings.get("teacher") else "")
                  + (f" Not run: {', '.join(skipped)} (they distil from a teacher, and this task names none)."
                     if skipped else ""), "",
                  f"| preset | greedy accuracy | sampled accuracy | {' | '.join(rewards)} | wall s / run "
                  "| tokens / run |",
                  "|---|---|---|" + "---|" * len(rewards) + "---|---|"]
        stats = table.drop(columns="task").groupby("preset").agg(["mean", "std"])
        for preset in stats.sort_values(("greedy_accuracy", "mean"), ascending=False).index:
            row = stats.loc[preset]
            cells = [f"{row[(c, 'mean')]:.3f} ± {row[(c, 'std')]:.3f}" for c in
                     ["greedy_accuracy", "sampled_accuracy", *rewards]]
            lines.append(f"| {preset} | {' | '.join(cells)} | {row[('wall_s', 'mean')]:.1f} | "
                         f"{row[('tokens', 'mean')]:,.0f} |")
        lines.append("")
    return "\n".join(lines)


def plot_leaderboard(rows: list[dict], path: Path) -> None:
    """Bars of held-out greedy accuracy per preset (mean, seeds' std as error bars), one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    frame = pd.DataFrame(rows)
    labels = list(dict.fromkeys(frame["task"]))
    fig, axes = plt.subplots(1, len(labels), figsize=(6 * len(labels), 5), squeeze=False)
    for ax, label in zip(axes[0], labels):
        table = frame[frame["task"] == label]
        stats = table.groupby("preset")["greedy_accuracy"].agg(["mean", "std"]).sort_values("mean")
        ax.barh(stats.index, stats["mean"], xerr=stats["std"].fillna(0), color="tab:blue", alpha=0.8)
        ax.axvline(table["before"].mean(), color="black", linestyle="--", label="before training")
        ax.set_title(label)
        ax.set_xlabel("held-out greedy accuracy")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
