"""Learning-rate sensitivity of grpo, dapo, gspo and rloo on tiny-arith (issue 21), as one `rl.sweep`.

Each (algorithm, learning rate, seed) trains the leaderboard's arithmetic setting (16 prompts x 8 samples, two
mini-batches a step) for `--steps` steps, a Ray task with one CPU each on a private local Ray using every core,
evaluated (held-out greedy accuracy) every `--evaluate-every` steps. The result is final accuracy against learning
rate, per algorithm the mean over seeds and its 95% percentile-bootstrap interval (`rlbench.experiments.stats`).

Outputs under --out: table.jsonl (every run's evaluations), summary.jsonl (per algorithm and learning rate: final
accuracy, AUC, accuracy at the token budget, each with its interval) and lr_sensitivity.png. The runs' folders go under
--runs: running the script again skips the runs that finished and resumes the others. Prints one JSON line per
(algorithm, learning rate).
Run: .venv/bin/python benchmarks/lr_sensitivity.py [--steps 150] [--seeds 0 1 2] [--lrs 1e-5 3e-5 1e-4 3e-4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import rlbench as rl

HERE = Path(__file__).resolve().parent
SETTINGS = dict(model="tiny-arith", task="arithmetic", prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8,
                mini_batches_per_step=2, threads=1)
"""The leaderboard's arithmetic settings (`algorithms/leaderboard.toml`), one torch thread per run."""
ALGORITHMS = ("grpo", "dapo", "gspo", "rloo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--evaluate-every", type=int, default=25)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 3e-5, 1e-4, 3e-4])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "lr_sensitivity")
    parser.add_argument("--runs", default="runs/lr_sensitivity", help="the runs' folders (kept for resuming)")
    args = parser.parse_args()
    sweep = rl.sweep({"algorithm": args.algorithms, "lr": args.lrs}, settings=SETTINGS, steps=args.steps,
                     seeds=args.seeds, evaluate_every=args.evaluate_every, out_dir=args.runs,
                     progress=sys.stderr.isatty())
    args.out.mkdir(parents=True, exist_ok=True)
    sweep.table.to_json(args.out / "table.jsonl", orient="records", lines=True)
    summary = sweep.summary(by=["algorithm", "lr"])
    summary.to_json(args.out / "summary.jsonl", orient="records", lines=True)
    for row in summary.to_dict("records"):
        print(json.dumps({"bench": "lr_sensitivity", "steps": args.steps, "seeds": args.seeds} | row))
    plot(summary, args.out / "lr_sensitivity.png", args.steps, len(args.seeds))


def plot(summary, path: Path, steps: int, seeds: int) -> None:
    """Final greedy accuracy against learning rate (log scale), a line per algorithm with its intervals as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, (algorithm, rows) in enumerate(summary.groupby("algorithm", sort=False)):
        rows = rows.sort_values("lr")
        ax.errorbar(rows["lr"] * (1 + 0.04 * (i - 1.5)), rows["final"],  # nudged apart so that bars do not overlap
                    yerr=[rows["final"] - rows["final_lo"], rows["final_hi"] - rows["final"]], marker="o",
                    capsize=3, label=algorithm)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(f"held-out greedy accuracy after {steps} steps")
    ax.set_title(f"tiny-arith: learning-rate sensitivity (mean over {seeds} seeds, 95% bootstrap interval)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
