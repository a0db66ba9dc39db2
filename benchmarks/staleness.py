"""Staleness lab: what training on samples drawn by older weights does to held-out accuracy, and what it buys in time.

The same seeds are trained synchronously, one step off (`rl.Overlap()`) and asynchronously with at most
K = 1, 2, 4, 8 updates of staleness (`rl.Async(max_staleness=K)`), each with rollout correction (token TIS) and without
(`correction=None`: PPO's ratio and clip against the weights that sampled), on arithmetic (tiny-arith) and countdown
(tiny-mix). Every run records, per step, the sampler-trainer KL and the staleness, and every `--eval-every` steps the
held-out greedy and sampled accuracy, against steps and against the training clock (evaluation not counted).

Two published findings are checked at this tiny scale (`--findings`):
  (a) marin #8955: uncorrected one-step-stale training collapses where truncated IS or PPO clipping holds. Runs: the
      plain policy gradient (loss "gpg", no ratio) synchronous (the control), one step off uncorrected, and one step
      off with token TIS; against GRPO one step off with TIS and with clipping only (the sweep's runs).
  (b) tinker-cookbook PR #822: unclipped IS losses degrade as staleness grows while clipped ones hold. Runs: GRPO's
      ppo_clip with bounds of 1e9 (r = pi_theta / pi_sampler, unclipped) at K = 1, 2, 4, 8 without correction,
      against the sweep's clipped runs (GRPO without correction).

The sampler-trainer KL is `sampler_kl` (k1 of KL(sampler || trainer) on the sampled tokens) when the batch's old_logp
is the trainer's forward (sync, or a correction); without correction in overlap / async mode old_logp *is* the
sampler's, and the same k1 estimate comes from the update's own forward (one mini-batch: the weights before the
update): the session reports it as `sampler_kl`, the lab reads it as the loss's `approx_kl` (the same number).

`--throughput` (issue 18, item 5) instead trains arithmetic on Ray (one torch thread per worker) synchronously and
asynchronously (one rollout worker; K = 1 with and without correction, K = 2) for the same training-clock budget,
evaluating every `--eval-every` steps outside the clock, and prints the accuracy each reached at equal times, the
time each took to reach given accuracies, and s/step.

Outputs under --out: runs.jsonl (every run's per-step and evaluation rows), table.csv / table.md, <task>.png,
findings.png; with --throughput: throughput.jsonl, throughput.md, throughput.png. `--report` redraws them from
runs.jsonl.
Run: .venv/bin/python benchmarks/staleness.py [--steps 150] [--seeds 0 1] [--tasks arithmetic countdown]
[--findings] [--jobs 2] | --throughput [--budget-s 60] | --report
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import rlbench as rl

HERE = Path(__file__).resolve().parent
TASKS = {"arithmetic": dict(model="tiny-arith", lr=2e-4), "countdown": dict(model="tiny-mix", lr=2e-4)}
"""Each task's model and learning rate (measured: at 5e-4 and above synchronous GRPO itself collapses on
arithmetic within 15 steps, so staleness could not be told apart; at 1e-4 the sampler-trainer KL stays tiny)."""
COMMON = dict(prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8, threads=1, log_dir=None)
STALENESS = (1, 2, 4, 8)
UNCLIPPED = dict(clip_low=1e9, clip_high=1e9, clip_c=1e9)
"""ppo_clip with bounds no ratio reaches: -A·r, r = pi_theta / pi_old (dual-clip off too)."""
STEP_COLUMNS = ["reward_mean", "accuracy", "staleness_mean", "staleness_max", "correction/weight_mean",
                "correction/outside_frac", "clip_frac", "response_length", "time_step", "trainer_wait_s",
                "sampler_wait_s"]


@dataclass(frozen=True)
class Run:
    """One training run of the lab."""
    task: str
    seed: int
    mode: str
    """"sync", "overlap" or "async"."""
    staleness: int = 0
    """max_staleness (async mode only)."""
    correction: str | None = None
    """"token_tis" or None (PPO's ratio against the sampler's weights)."""
    loss: str = "grpo"
    """"grpo" (ppo_clip, clip 0.2), "gpg" (plain policy gradient) or "unclipped" (ppo_clip, bounds 1e9)."""
    group: str = "sweep"
    """"sweep", "a" or "b" (the finding it tests)."""

    @property
    def name(self) -> str:
        when = {"sync": "sync", "overlap": "one step off"}.get(self.mode, f"async K={self.staleness}")
        fix = "" if self.mode == "sync" else (" TIS" if self.correction else " no corr.")
        return ("" if self.loss == "grpo" else f"{self.loss}: ") + when + fix

    def session(self, cluster: str = "inline") -> rl.Session:
        grpo = rl.algorithms.get("grpo")
        algorithm = {"grpo": grpo, "gpg": grpo.replace(name="grpo_gpg", loss="gpg", loss_kwargs={}),
                     "unclipped": grpo.replace(name="grpo_unclipped", loss_kwargs=UNCLIPPED)}[self.loss]
        rollout = {"sync": rl.Sync(), "overlap": rl.Overlap()}.get(self.mode) or rl.Async(max_staleness=self.staleness)
        return rl.Session(task=self.task, **TASKS[self.task], **COMMON, cluster=cluster, seed=self.seed,
                          algorithm=algorithm, rollout=rollout, correction=self.correction)


def plan(tasks: list[str], seeds: list[int], findings: bool) -> list[Run]:
    """The sweep (every task and seed) and, with `findings`, the runs of (a) and (b) on arithmetic; seed by seed (a
    sweep cut short still has every run of its first seeds)."""
    runs = []
    for seed in seeds:
        for task in tasks:
            runs.append(Run(task, seed, "sync"))
            for correction in ("token_tis", None):
                runs.append(Run(task, seed, "overlap", correction=correction))
                runs += [Run(task, seed, "async", k, correction) for k in STALENESS]
            if findings and task == "arithmetic":
                runs += [Run(task, seed, "sync", loss="gpg", group="a"),
                         Run(task, seed, "overlap", loss="gpg", group="a"),
                         Run(task, seed, "overlap", correction="token_tis", loss="gpg", group="a")]
                runs += [Run(task, seed, "async", k, loss="unclipped", group="b") for k in STALENESS]
    return runs


def sampler_trainer_kl(run: Run, row: dict) -> float:
    """k1 of KL(sampler || trainer) on the batch's sampled tokens (see the module docstring)."""
    uncorrected = run.mode != "sync" and run.correction is None
    return float(row["approx_kl"] if uncorrected else row["sampler_kl"])


def train(run: Run, steps: int, eval_every: int, eval_prompts: int, cluster: str = "inline",
          budget_s: float | None = None) -> dict:
    """Train one run for `steps` steps (or until its training clock reaches `budget_s`), evaluating held-out
    accuracy at step 0, every `eval_every` steps and at the end; evaluation time is kept off the clock."""
    built = time.perf_counter()
    session = run.session(cluster)
    build_s = time.perf_counter() - built
    rows, evals, clock, eval_s = [], [], 0.0, 0.0

    def evaluate():
        nonlocal eval_s
        start = time.perf_counter()
        result = session.evaluate(max_prompts=eval_prompts)
        eval_s += time.perf_counter() - start
        evals.append({"step": session.step_count, "clock_s": round(clock, 3)} | {
            k: round(v, 4) for k, v in result.items() if k.endswith("accuracy")})

    try:
        evaluate()
        while session.step_count < steps and (budget_s is None or clock < budget_s):
            start = time.perf_counter()
            row = session.step()
            clock += time.perf_counter() - start
            rows.append({"step": row["step"] + 1, "clock_s": round(clock, 3),
                         "kl": round(sampler_trainer_kl(run, row), 6)} | {
                k: round(float(row[k]), 6) for k in STEP_COLUMNS if k in row})
            if session.step_count % eval_every == 0:
                evaluate()
        if evals[-1]["step"] != session.step_count:
            evaluate()
    finally:
        session.close()
    return {"name": run.name, "run": asdict(run), "lr": TASKS[run.task]["lr"], "cluster": cluster,
            "build_s": round(build_s, 2), "train_s": round(clock, 2), "eval_s": round(eval_s, 2),
            "steps": rows, "evals": evals}


def sweep(args) -> None:
    """Every run of the plan, `--jobs` at a time (in `--jobs` processes), appended to runs.jsonl as it ends."""
    runs = plan(args.tasks, args.seeds, args.findings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.jsonl"
    path.write_text("")
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        futures = [pool.submit(train, run, args.steps, args.eval_every, args.eval_prompts) for run in runs]
        for done in concurrent.futures.as_completed(futures):
            result = done.result()
            with path.open("a") as f:
                f.write(json.dumps(result) + "\n")
            final = result["evals"][-1]
            print(json.dumps({"bench": "staleness", "task": result["run"]["task"], "seed": result["run"]["seed"],
                              "run": result["name"], "greedy_accuracy": final["greedy_accuracy"],
                              "sampled_accuracy": final["sampled_accuracy"], "train_s": result["train_s"],
                              "elapsed_s": round(time.perf_counter() - start, 1)}), flush=True)
    print(json.dumps({"bench": "staleness", "runs": len(runs), "jobs": args.jobs,
                      "wall_s": round(time.perf_counter() - start, 1)}))
    report(out)


# ------------------------------------------------------------------------------------------- report
def load(out: Path) -> list[dict]:
    """runs.jsonl's runs (written in the order they ended) in the plan's order."""
    results = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines() if line.strip()]
    modes, losses, groups = ["sync", "overlap", "async"], ["grpo", "gpg", "unclipped"], ["sweep", "a", "b"]
    return sorted(results, key=lambda r: (r["run"]["task"], groups.index(r["run"]["group"]),
                                          losses.index(r["run"]["loss"]), r["run"]["mode"] != "sync",
                                          r["run"]["correction"] is None,
                                          modes.index(r["run"]["mode"]), r["run"]["staleness"], r["run"]["seed"]))


def summarize(result: dict) -> dict:
    """One run's row of the table: final and area-under-curve held-out accuracy, KL, staleness, time."""
    import numpy as np

    evals, steps = result["evals"], result["steps"]
    overlap = result["run"]["mode"] == "overlap"  # one step off: every batch but the first (no staleness column)
    x = np.array([e["step"] for e in evals], dtype=float)
    auc = {f"auc_{m}": float(np.trapezoid([e[f"{m}_accuracy"] for e in evals], x) / x[-1])
           for m in ("greedy", "sampled")}
    return {"task": result["run"]["task"], "group": result["run"]["group"], "run": result["name"],
            "seed": result["run"]["seed"], "final_greedy": evals[-1]["greedy_accuracy"],
            "final_sampled": evals[-1]["sampled_accuracy"], **auc,
            "best_greedy": max(e["greedy_accuracy"] for e in evals),
            "kl_mean": float(np.mean([r["kl"] for r in steps])), "kl_max": float(np.max([r["kl"] for r in steps])),
            "staleness_mean": float(np.mean([r.get("staleness_mean", float(overlap and r["step"] > 1))
                                             for r in steps])),
            "outside_frac": float(np.mean([r.get("correction/outside_frac", 0.0) for r in steps])),
            "train_s": result["train_s"], "s_per_step": result["train_s"] / len(steps)}


def table(results: list[dict]):
    """Per task and run: the mean over seeds of every summary (std of the accuracies as `_sd`)."""
    import pandas as pd

    rows = pd.DataFrame([summarize(r) for r in results])
    grouped = rows.groupby(["task", "group", "run"], sort=False)
    means = grouped.mean(numeric_only=True).drop(columns="seed")
    sds = grouped[["final_greedy", "auc_greedy"]].std().add_suffix("_sd")
    seeds = grouped["seed"].count().rename("seeds")
    return means.join(sds).join(seeds).reset_index()


def markdown(summary) -> str:
    lines = []
    for task, rows in summary.groupby("task", sort=False):
        lines += [f"### {task} (lr {TASKS[task]['lr']:g}, {int(rows.seeds.max())} seeds, mean ± sd)", "",
                  "| run | final greedy | AUC greedy | final sampled | KL mean | KL max | staleness | TIS truncated "
                  "| train s | s/step |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows.itertuples():
            lines.append(f"| {r.run} | {r.final_greedy:.3f} ± {r.final_greedy_sd:.3f} | {r.auc_greedy:.3f} ± "
                         f"{r.auc_greedy_sd:.3f} | {r.final_sampled:.3f} | {r.kl_mean:.4f} | {r.kl_max:.3f} | "
                         f"{r.staleness_mean:.2f} | {r.outside_frac:.3f} | {r.train_s:.0f} | {r.s_per_step:.3f} |")
        lines.append("")
    return "\n".join(lines)


def curves(results: list[dict]):
    """Every run's step and evaluation rows, long format (one row per step or evaluation)."""
    import pandas as pd

    frames = []
    for r in results:
        keys = {"task": r["run"]["task"], "group": r["run"]["group"], "run": r["name"], "seed": r["run"]["seed"]}
        frames.append(pd.DataFrame(r["steps"]).assign(kind="step", **keys))
        frames.append(pd.DataFrame(r["evals"]).assign(kind="eval", **keys))
    return pd.concat(frames, ignore_index=True)


def style(name: str) -> dict:
    """Colour by staleness, solid with TIS, dashed without (sync: black)."""
    colours = {"one step off": "tab:purple", "async K=1": "tab:blue", "async K=2": "tab:green",
               "async K=4": "tab:orange", "async K=8": "tab:red", "sync": "black"}  # "sync" last: "async" holds it
    when = next(k for k in colours if k in name)
    return {"color": colours[when], "linestyle": "--" if "no corr." in name else "-", "linewidth": 1.4}


def plot_runs(data, names: list[str], axes, styles=style) -> None:
    """Seed-mean greedy accuracy against steps and training clock, and KL against steps (20-step means)."""
    for name in names:
        runs = data[data.run == name]
        evals = runs[runs.kind == "eval"].groupby("step")[["greedy_accuracy", "clock_s"]].mean()
        steps = runs[runs.kind == "step"].groupby("step")["kl"].mean().rolling(20, min_periods=1).mean()
        axes[0].plot(evals.index, evals.greedy_accuracy, label=name, **styles(name))
        axes[1].plot(evals.clock_s, evals.greedy_accuracy, **styles(name))
        axes[2].plot(steps.index, steps.clip(lower=1e-5), **styles(name))
    axes[0].set(xlabel="step", ylabel="held-out greedy accuracy")
    axes[1].set(xlabel="training seconds (evaluation excluded)", ylabel="held-out greedy accuracy")
    axes[2].set(xlabel="step", ylabel="sampler-trainer KL (k1, 20-step mean)", yscale="log")


def figures(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves(results)
    for task in dict.fromkeys(r["run"]["task"] for r in results):
        names = list(dict.fromkeys(r["name"] for r in results
                                   if r["run"]["task"] == task and r["run"]["group"] == "sweep"))
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        plot_runs(data[data.task == task], names, axes)
        fig.legend(*axes[0].get_legend_handles_labels(), loc="center right", fontsize=8)
        fig.suptitle(f"{task}: GRPO sync, one step off and async K-stale, solid = token TIS, dashed = no correction "
                     f"(mean of seeds)", fontsize=10)
        fig.tight_layout(rect=(0, 0, 0.87, 1))
        fig.savefig(out / f"{task}.png", dpi=70)
        plt.close(fig)
    if any(r["run"]["group"] != "sweep" for r in results):
        figure_findings(data, out, plt)


def figure_findings(data, out: Path, plt) -> None:
    """(a) the plain policy gradient one step off vs GRPO's TIS and clip; (b) unclipped vs clipped IS against K."""
    arith = data[data.task == "arithmetic"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    a = ["sync", "gpg: sync", "gpg: one step off no corr.", "gpg: one step off TIS", "one step off TIS",
         "one step off no corr."]
    colours = dict(zip(a, ["black", "grey", "tab:red", "tab:orange", "tab:blue", "tab:green"]))
    plot_runs(arith, a, axes[0], lambda n: {"color": colours[n], "linestyle": ":" if "gpg" in n else "-"})
    b = [f"async K={k} no corr." for k in STALENESS] + [f"unclipped: async K={k} no corr." for k in STALENESS]

    def b_style(name):
        k = name.split("K=")[1].split()[0]
        return {"color": {"1": "tab:blue", "2": "tab:green", "4": "tab:orange", "8": "tab:red"}[k],
                "linestyle": ":" if "unclipped" in name else "-"}

    plot_runs(arith, b, axes[1], b_style)
    for row, title in ((axes[0], "(a) one step off: plain PG (dotted) vs GRPO's TIS / clip"),
                       (axes[1], "(b) clipped (solid) vs unclipped IS (dotted), no correction")):
        row[0].legend(fontsize=7)
        row[0].set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    fig.savefig(out / "findings.png", dpi=70)
    plt.close(fig)


def report(out: Path) -> None:
    """table.csv, table.md and the figures, from runs.jsonl."""
    results = load(out)
    summary = table(results)
    summary.round(4).to_csv(out / "table.csv", index=False)
    (out / "table.md").write_text(markdown(summary))
    figures(results, out)
    print(markdown(summary))


# --------------------------------------------------------------------------------------- throughput
def throughput(args) -> None:
    """Sync vs async (one rollout worker: K = 1 with and without correction, K = 2 with) on Ray, each for
    `--budget-s` seconds of training."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [Run("arithmetic", seed, mode, k, correction, group="throughput") for seed in args.seeds
            for mode, k, correction in (("sync", 0, None), ("async", 1, "token_tis"), ("async", 1, None),
                                        ("async", 2, "token_tis"))]
    results = []
    with (out / "throughput.jsonl").open("w") as f:
        for run in runs:
            result = train(run, 10**9, args.eval_every, args.eval_prompts, cluster="ray", budget_s=args.budget_s)
            f.write(json.dumps(result) + "\n")
            results.append(result)
    summary = compare(results, args.budget_s)
    print(json.dumps({"bench": "staleness_throughput", "budget_s": args.budget_s} | summary))
    (out / "throughput.md").write_text(throughput_markdown(summary, args))
    plot_throughput(results, out)


def compare(results: list[dict], budget_s: float) -> dict:
    """Per run name (mean over seeds): s/step, accuracy reached by 1/4, 1/2, 3/4 and all of the budget (the last
    evaluation at or before that time), and the first time each accuracy threshold was reached."""
    import numpy as np

    by_name: dict[str, list[dict]] = {}
    for r in results:
        by_name.setdefault(r["name"], []).append(r)
    times = [round(budget_s * f) for f in (0.25, 0.5, 0.75, 1.0)]
    thresholds = (0.4, 0.5, 0.6, 0.7, 0.8)
    summary = {}
    for name, rs in by_name.items():
        reached = {f"acc_at_{t}s": float(np.mean([[e for e in r["evals"] if e["clock_s"] <= t][-1]["greedy_accuracy"]
                                                for r in rs])) for t in times}
        first = {}
        for a in thresholds:
            hits = [next((e["clock_s"] for e in r["evals"] if e["greedy_accuracy"] >= a), None) for r in rs]
            first[f"s_to_{a}"] = None if None in hits else round(float(np.mean(hits)), 1)
        summary[name] = {"s_per_step": round(float(np.median([s["time_step"] for r in rs for s in r["steps"][2:]])), 4),
                         "steps": float(np.mean([len(r["steps"]) for r in rs])),
                         "final_greedy": float(np.mean([r["evals"][-1]["greedy_accuracy"] for r in rs])),
                         "eval_s": float(np.mean([r["eval_s"] for r in rs])),
                         "build_s": float(np.mean([r["build_s"] for r in rs])), **reached, **first}
    return summary


def throughput_markdown(summary: dict, args) -> str:
    names = list(summary)
    keys = list(summary[names[0]])
    lines = [f"Ray, one torch thread per worker, arithmetic, lr {TASKS['arithmetic']['lr']:g}, seeds {args.seeds}, "
             f"{args.budget_s:g} s of training each (evaluation every {args.eval_every} steps, off the clock); "
             f"acc_at_Ts: held-out greedy accuracy at the last evaluation by T training seconds; s_to_A: training "
             f"seconds to first reach greedy accuracy A (—: not reached by every seed).", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {k} | " + " | ".join(str(round(summary[n][k], 3)) if summary[n][k] is not None else "—"
                                        for n in names) + " |" for k in keys]
    return "\n".join(lines) + "\n"


def plot_throughput(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r in results:
        ax.plot([e["clock_s"] for e in r["evals"]], [e["greedy_accuracy"] for e in r["evals"]], marker=".",
                label=r["name"] if r["run"]["seed"] == results[0]["run"]["seed"] else None, **style(r["name"]))
    ax.set(xlabel="training seconds (evaluation excluded)", ylabel="held-out greedy accuracy",
           title="arithmetic on Ray, 2 cores: sync vs async (one rollout worker)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=80)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--findings", action="store_true", help="also the runs of findings (a) and (b), on arithmetic")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one process each, one torch thread)")
    parser.add_argument("--out", default=str(HERE / "results" / "staleness"))
    parser.add_argument("--throughput", action="store_true", help="sync vs async on Ray for the same time budget")
    parser.add_argument("--budget-s", type=float, default=60.0, help="--throughput: training seconds per run")
    parser.add_argument("--report", action="store_true", help="only redraw table and figures from runs.jsonl")
    args = parser.parse_args()
    if args.report:
        report(Path(args.out))
    elif args.throughput:
        throughput(args)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
