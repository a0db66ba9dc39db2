"""rlbench vs TRL's GRPOTrainer on a tool loop: the calculator task on tiny-tools, same work, runs alternated.

One command from a fresh clone: `.venv/bin/python benchmarks/vs_trl_agentic.py [--steps 30] [--seeds 0 1 2]`.
The first run creates TRL's environment in benchmarks/.venv-trl (as benchmarks/vs_trl.py does). Both libraries
train tiny-tools (the same weights) on two-digit products with the `calc` tool: 8 prompts x 8 episodes per step, at
most 3 assistant turns, temperature 1, AdamW lr 3e-4 constant, gradient clip 1, GRPO (PPO clip 0.2, per-sequence
loss, k3 KL 0.001 to the initial model), one optimizer step per batch, fp32, one torch thread. rlbench samples at
most 64 tokens per turn; TRL's budget is per episode (`max_completion_length`), set to 64 x 3. TRL's side
(benchmarks/trl_agentic.py) gives tiny-tools a template that renders structured tool calls to the same tokens.

One evaluator for both: rlbench's greedy episodes on the calculator's 200 held-out products (`Session.evaluate`),
before training (the same model for both) and after, TRL's saved weights loaded into an rlbench session. Seeds run
TRL then rlbench, back to back, so both see the same machine load. Prints one JSON line: per library the median
s/step (steps after the first two, all seeds), sampled tokens per second of generation, greedy accuracy after per
seed; then rlbench's ratio to TRL and the difference of the mean accuracies.
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
from vs_trl import TRL_VERSION, ensure_trl_venv

HERE = Path(__file__).resolve().parent
WARMUP_STEPS = 2
SETTING = dict(prompts_per_step=8, samples_per_prompt=8, max_new_tokens=64, temperature=1.0, lr=3e-4, grad_clip=1.0)
MAX_TURNS = rl.tasks.get("calculator").max_turns  # 3
KL_COEF = 0.001


def write_workdir(work: Path) -> None:
    """The model directory, the settings and the training prompts, as files TRL's side reads."""
    task = rl.tasks.get("calculator")
    setting = SETTING | {"model_dir": str(rl.models.resolve("tiny-tools")), "max_turns": MAX_TURNS, "kl_coef": KL_COEF}
    (work / "setting.json").write_text(json.dumps(setting))
    rows = [json.dumps({"prompt": e["prompt"], "answer": e["answer"]}) for e in task.train]
    (work / "train.jsonl").write_text("\n".join(rows) + "\n")


def greedy_accuracy(model: str, seed: int) -> float:
    """rlbench's evaluator: greedy episodes on the 200 held-out products."""
    with rl.Session(model=model, task="calculator", cluster="inline", threads=1,
                    seed=seed, log_dir=None, **SETTING) as s:
        return s.evaluate()["greedy_accuracy"]


def run_trl(python: Path, work: Path, seed: int, steps: int) -> dict:
    env = os.environ | {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([str(python), str(HERE / "trl_agentic.py"), "--workdir", str(work), "--seed", str(seed),
                    "--steps", str(steps)], check=True, env=env, stdout=sys.stderr)  # stdout: our JSON only
    out = json.loads((work / f"trl-seed{seed}.json").read_text())
    return dict(step_s=out["step_s"][WARMUP_STEPS:], tokens=out["sampled_tokens"][WARMUP_STEPS:],
                generation_s=out["generation_s"][WARMUP_STEPS:], greedy_after=greedy_accuracy(out["model_dir"], seed))


def run_rlbench(seed: int, steps: int) -> dict:
    algorithm = rl.algorithms.get("grpo").replace(kl_coef=KL_COEF)
    # old_logp is the update's own forward, like TRL's with one update per batch (num_iterations=1)
    with rl.Session(model="tiny-tools", task="calculator", algorithm=algorithm, cluster="inline", threads=1,
                    seed=seed, log_dir=None, on_policy_old_logp=True, **SETTING) as s:
        metrics = s.run(steps, progress=False).iloc[WARMUP_STEPS:]
        after = s.evaluate()["greedy_accuracy"]
    episodes = SETTING["prompts_per_step"] * SETTING["samples_per_prompt"]
    return dict(step_s=metrics["time_step"].tolist(), tokens=(metrics["sampled_length"] * episodes).tolist(),
                generation_s=metrics["time_rollout"].tolist(), greedy_after=after)


def summary(runs: list[dict]) -> dict:
    rates = [t / g for r in runs for t, g in zip(r["tokens"], r["generation_s"])]
    return {"s_per_step": round(statistics.median(x for r in runs for x in r["step_s"]), 4),
            "s_per_step_per_seed": [round(statistics.median(r["step_s"]), 4) for r in runs],
            "sampled_tokens_per_s": round(statistics.median(rates)),
            "greedy_after": [round(r["greedy_after"], 4) for r in runs]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    python = ensure_trl_venv()
    start = time.perf_counter()
    before = greedy_accuracy("tiny-tools", args.seeds[0])
    results = {"trl": [], "rlbench": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_workdir(work)
        for seed in args.seeds:
            results["trl"].append(run_trl(python, work, seed, args.steps))
            results["rlbench"].append(run_rlbench(seed, args.steps))
    trl, ours = summary(results["trl"]), summary(results["rlbench"])
    ratios = {"s_per_step": round(ours["s_per_step"] / trl["s_per_step"], 3),
              "s_per_step_per_seed": [round(a / b, 3) for a, b in zip(ours["s_per_step_per_seed"],
                                                                     trl["s_per_step_per_seed"])],
              "sampled_tokens_per_s": round(ours["sampled_tokens_per_s"] / trl["sampled_tokens_per_s"], 2),
              "greedy_after_mean_diff": round(statistics.mean(ours["greedy_after"]) -
                                              statistics.mean(trl["greedy_after"]), 3)}
    print(json.dumps({"bench": "vs_trl_agentic", "steps": args.steps, "seeds": args.seeds, "trl_version": TRL_VERSION,
                      "greedy_before": round(before, 4), "wall_s": round(time.perf_counter() - start),
                      "trl": trl, "rlbench": ours, "ratios": ratios}))


if __name__ == "__main__":
    main()
