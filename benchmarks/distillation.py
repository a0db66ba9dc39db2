"""On-policy distillation against RL for the same training time, on CPU (issue 20).

The teacher is the quickstart's model after 300 GRPO steps (built-in `tiny-arith-grpo`, held-out greedy accuracy
0.65); the student is `tiny-arith-small`, the same recipe with one layer instead of two (warm-started to 0.275).
Each method trains the student for the same wall-clock budget of training (`--budget-s`, evaluation not counted),
two runs at once with one torch thread each, evaluating held-out greedy and sampled accuracy every `--eval-every`
steps. Methods: GRPO at two learning rates, and the distillation presets (`opd`: the per-token reverse KL as the
advantage; `opd` plus the forward KL to the teacher's top-k; `grpo_opd`: the task reward plus the reverse KL).

Outputs under --out: runs.jsonl (one row per evaluation), distillation.md (the table), distillation.png (accuracy
against training seconds). `--report` redraws them from runs.jsonl.
Run: .venv/bin/python benchmarks/distillation.py [--budget-s 90] [--seeds 0 1] [--jobs 2] | --report
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import time
from pathlib import Path

import rlbench as rl

HERE = Path(__file__).resolve().parent
COMMON = dict(model="tiny-arith-small", task="arithmetic", prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8,
              threads=1, log_dir=None)
METHODS = {
    "grpo lr 1e-4": dict(algorithm="grpo", lr=1e-4),
    "grpo lr 3e-4": dict(algorithm="grpo", lr=3e-4),
    "opd lr 1e-4": dict(algorithm="opd", lr=1e-4, teacher=rl.quickstart.TEACHER),
    "opd lr 3e-4": dict(algorithm="opd", lr=3e-4, teacher=rl.quickstart.TEACHER),
    "opd + forward KL top-64 lr 3e-4": dict(algorithm="opd_forward_kl", lr=3e-4, teacher=rl.quickstart.TEACHER),
    "grpo_opd lr 3e-4": dict(algorithm="grpo_opd", lr=3e-4, teacher=rl.quickstart.TEACHER),
}
"""Label -> Session settings. GRPO at 3e-4 shows the rate at which it breaks this student; `opd_forward_kl` is `opd`
with `forward_kl_coef=1` (the supervised term of GKD over the teacher's 64 most likely tokens)."""


def algorithm(name: str):
    """A preset, or `opd_forward_kl` (`opd` plus the forward KL to the teacher's top-64)."""
    if name == "opd_forward_kl":
        return rl.algorithms.get("opd").replace(name=name, forward_kl_coef=1.0)
    return name


def train(label: str, seed: int, budget_s: float, eval_every: int) -> list[dict]:
    """One run: evaluate, then train in chunks of `eval_every` steps until the training clock passes the budget."""
    settings = METHODS[label] | {"algorithm": algorithm(METHODS[label]["algorithm"])}
    rows, clock, tokens = [], 0.0, 0
    with rl.Session(**COMMON, **settings, seed=seed) as session:
        def record():
            rows.append(dict(method=label, seed=seed, step=session.step_count, train_s=round(clock, 2), tokens=tokens,
                             **{k: round(v, 4) for k, v in session.evaluate().items()}))
        record()
        while clock < budget_s:
            start = time.perf_counter()
            metrics = session.run(eval_every, progress=False).iloc[-eval_every:]
            clock += time.perf_counter() - start
            tokens += int(metrics["tokens_generated"].sum())
            record()
            rows[-1] |= {"reward_mean": round(float(metrics["reward_mean"].mean()), 4)} | (
                {"teacher_kl": round(float(metrics["teacher_kl"].mean()), 4)} if "teacher_kl" in metrics else {})
    return rows


def report(runs: list[dict], out: Path, budget_s: float) -> None:
    """The table (accuracy at the budget, the best evaluation, seconds to first reach the thresholds) and the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    frame = pd.DataFrame(runs)
    before = frame[frame["step"] == 0]["greedy_accuracy"].mean()
    thresholds = (0.35, 0.45, 0.6)
    lines = [f"Made by `benchmarks/distillation.py --budget-s {budget_s:g}` on {time.strftime('%Y-%m-%d')}, two runs at "
             "once with one torch thread each on a 2-core CPU.", "",
             f"Student `tiny-arith-small` (greedy {before:.3f} before training), teacher `tiny-arith-grpo` (greedy "
             f"{TEACHER_ACCURACY:.2f}); {budget_s:.0f} s of training per run; seeds "
             f"{sorted(int(s) for s in frame['seed'].unique())}; mean over seeds.", "",
             "| method | steps | greedy at the budget | best greedy | sampled at the budget | reverse KL to the teacher "
             "(last eval) | " + " | ".join(f"s to greedy ≥ {t}" for t in thresholds) + " |",
             "|---|---:|---:|---:|---:|---:|" + "---:|" * len(thresholds)]
    for label in METHODS:
        runs_of = [g for _, g in frame[frame["method"] == label].groupby("seed")]
        if not runs_of:
            continue
        last = pd.DataFrame([g.iloc[-1] for g in runs_of])
        best = sum(g["greedy_accuracy"].max() for g in runs_of) / len(runs_of)
        reach = []
        for t in thresholds:
            times = [g[g["greedy_accuracy"] >= t]["train_s"].min() for g in runs_of]
            hit = [x for x in times if x == x]
            reach.append(f"{sum(hit) / len(hit):.0f} ({len(hit)}/{len(times)})" if hit else "never")
        kl = f"{last['teacher_kl'].mean():.3f}" if "teacher_kl" in last and last["teacher_kl"].notna().all() else "-"
        lines.append(f"| {label} | {last['step'].mean():.0f} | {last['greedy_accuracy'].mean():.3f} | {best:.3f} | "
                     f"{last['sampled_accuracy'].mean():.3f} | {kl} | " + " | ".join(reach) + " |")
    (out / "distillation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label in METHODS:
        curve = frame[frame["method"] == label].groupby("step")[["train_s", "greedy_accuracy"]].mean()
        if len(curve):
            ax.plot(curve["train_s"], curve["greedy_accuracy"], marker="o", markersize=3, label=label)
    ax.axhline(TEACHER_ACCURACY, color="black", linestyle="--", label="teacher")
    ax.set_xlabel("training seconds (one thread, two runs at once)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("tiny-arith-small: distillation vs GRPO")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "distillation.png", dpi=100)
    plt.close(fig)


TEACHER_ACCURACY = 0.65
"""The teacher's held-out greedy accuracy (tiny-arith-grpo, seed 0: `rlbench eval`)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=90.0)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "distillation"))
    parser.add_argument("--report", action="store_true", help="redraw the table and plot from runs.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for model in (rl.quickstart.TEACHER, "tiny-arith-small"):  # built once here, not in every run
            rl.models.resolve(model)
        jobs = [(label, seed) for label in args.methods for seed in args.seeds]
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            results = pool.map(train, *zip(*jobs), [args.budget_s] * len(jobs), [args.eval_every] * len(jobs))
            rows = [row for run in results for row in run]
        (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    report(rows, out, args.budget_s)
    print(json.dumps({"runs": len({(r["method"], r["seed"]) for r in rows}), "out": str(out)}))


if __name__ == "__main__":
    main()
