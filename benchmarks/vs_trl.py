"""rlbench vs TRL's GRPOTrainer: same model, task, batch, optimizer and seeds, run back to back.

One command from a fresh clone: `.venv/bin/python benchmarks/vs_trl.py [--steps 600] [--seeds 0 1 2]`.
The first run creates TRL's own environment in benchmarks/.venv-trl (git-ignored; torch is installed
first so that pip takes the local CPU wheel, then a pinned trl). Both libraries train tiny-arith (the
same weights) on two-digit addition: 16 prompts x 8 samples per step, at most 8 new tokens, temperature 1,
AdamW lr 1e-4 constant, gradient clip 1, PPO clip 0.2 with GRPO's per-sequence loss, no KL, one optimizer
step per batch, one torch thread, fp32 or (--precision bf16, TRL's default) bfloat16 autocast in both.
Each draws its prompts from the same 7,900 training examples in its own seeded order.

rlbench runs twice: "rlbench" is the synchronous loop on one core, like TRL; "rlbench_overlap" sets
`rollout=rl.Overlap()` (the next batch is sampled on a second core while the update runs: one step
off-policy). Prints one JSON line: per run the median s/step (steps after the first two, all seeds), the
stage split (stages overlap in rlbench_overlap), generated tokens/s during generation, greedy held-out
accuracy before / after per seed; then each rlbench run's ratios to TRL.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import rlbench as rl

HERE = Path(__file__).resolve().parent
TRL_VENV = HERE / ".venv-trl"
TRL_VERSION = "1.16.0"
WARMUP_STEPS = 2
SETTING = dict(prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8, temperature=1.0, lr=1e-4, grad_clip=1.0)


def ensure_trl_venv() -> Path:
    """benchmarks/.venv-trl with trl, built on first use; returns its python."""
    python = TRL_VENV / "bin" / "python"
    if not python.exists():
        import transformers

        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run(pip + [f"torch=={torch.__version__.split('+')[0]}"], check=True)  # the local CPU wheel
        subprocess.run(pip + [f"trl=={TRL_VERSION}", f"transformers=={transformers.__version__}"], check=True)
    return python


def write_workdir(work: Path, precision: str) -> None:
    """The model directory, the settings and the prompts, as files TRL's side reads."""
    task = rl.tasks.get("arithmetic")
    setting = SETTING | {"model_dir": str(rl.models.resolve("tiny-arith")), "precision": precision}
    (work / "setting.json").write_text(json.dumps(setting))
    for name, examples in [("train", task.train), ("test", task.test)]:
        rows = [json.dumps({"prompt": e["prompt"], "answer": e["answer"]}) for e in examples]
        (work / f"{name}.jsonl").write_text("\n".join(rows) + "\n")


def run_trl(python: Path, work: Path, seed: int, steps: int) -> dict:
    env = os.environ | {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([str(python), str(HERE / "trl_grpo.py"), "--workdir", str(work), "--seed", str(seed),
                    "--steps", str(steps)], check=True, env=env, stdout=sys.stderr)  # stdout: our JSON only
    out = json.loads((work / f"trl-seed{seed}.json").read_text())
    step_s, generation_s = out["step_s"][WARMUP_STEPS:], out["generation_s"][WARMUP_STEPS:]
    return dict(step_s=step_s, stages={"generation": generation_s,
                                       "train": [s - g for s, g in zip(step_s, generation_s)]},
                tokens=out["generated_tokens"][WARMUP_STEPS:], generation_s=generation_s,
                greedy_before=out["greedy_before"], greedy_after=out["greedy_after"])


def run_rlbench(seed: int, steps: int, precision: str, overlap: bool) -> dict:
    """rlbench on the same setting. Synchronous, old_logp is the update's own forward, like TRL's (one update
    per batch); overlapped, it is the sampler's (the batch is a step old)."""
    algorithm = rl.algorithms.get("grpo").replace(kl_coef=0.0)
    with rl.Session(model="tiny-arith", task="arithmetic", algorithm=algorithm, cluster="inline", threads=1,
                    seed=seed, log_dir=None, precision=precision, on_policy_old_logp=not overlap,
                    rollout=rl.Overlap() if overlap else rl.Sync(), **SETTING) as s:
        before = s.evaluate()["greedy_accuracy"]
        metrics = s.run(steps, progress=False).iloc[WARMUP_STEPS:]
        after = s.evaluate()["greedy_accuracy"]
    stages = {c.removeprefix("time_"): metrics[c].tolist() for c in metrics if c.startswith("time_") and c != "time_step"}
    tokens = (metrics["response_length"] * SETTING["prompts_per_step"] * SETTING["samples_per_prompt"]).tolist()
    return dict(step_s=metrics["time_step"].tolist(), stages=stages, tokens=tokens,
                generation_s=metrics["time_rollout"].tolist(), greedy_before=before, greedy_after=after)


def summary(runs: list[dict]) -> dict:
    """Medians over every seed's steps, and the accuracies per seed."""
    def median(key):
        return round(statistics.median(x for r in runs for x in r[key]), 4)

    stages = {k: round(statistics.median(x for r in runs for x in r["stages"][k]), 4) for k in runs[0]["stages"]}
    rates = [t / g for r in runs for t, g in zip(r["tokens"], r["generation_s"])]
    return {"s_per_step": median("step_s"), "s_per_step_per_seed": [round(statistics.median(r["step_s"]), 4) for r in runs],
            "stages_s": stages, "generated_tokens_per_s": round(statistics.median(rates)),
            "greedy_before": [round(r["greedy_before"], 4) for r in runs],
            "greedy_after": [round(r["greedy_after"], 4) for r in runs]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    python = ensure_trl_venv()
    results = {"trl": [], "rlbench": [], "rlbench_overlap": []}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_workdir(work, args.precision)
        for seed in args.seeds:  # back to back, so both see the same machine load
            results["trl"].append(run_trl(python, work, seed, args.steps))
            for overlap in (False, True):
                results["rlbench_overlap" if overlap else "rlbench"].append(
                    run_rlbench(seed, args.steps, args.precision, overlap))
    summaries = {name: summary(runs) for name, runs in results.items()}
    trl = summaries["trl"]
    ratios = {name: {"s_per_step": round(ours["s_per_step"] / trl["s_per_step"], 3),
                     "generated_tokens_per_s": round(ours["generated_tokens_per_s"] / trl["generated_tokens_per_s"], 2),
                     "greedy_after_mean_diff": round(statistics.mean(ours["greedy_after"]) -
                                                     statistics.mean(trl["greedy_after"]), 3)}
              for name, ours in summaries.items() if name != "trl"}
    print(json.dumps({"bench": "vs_trl", "steps": args.steps, "seeds": args.seeds, "precision": args.precision,
                      "trl_version": TRL_VERSION, "wall_s": round(time.perf_counter() - start)} | summaries |
                     {"ratios": ratios}))


if __name__ == "__main__":
    main()
