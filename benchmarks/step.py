"""Seconds per GRPO step on the tiny arithmetic task, split by stage (median over steps after warm-up).

Run: .venv/bin/python benchmarks/step.py [--steps 20] [--threads 1]
"""

import argparse
import json

import rlbench as rl


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--algorithm", default="grpo")
    args = parser.parse_args()
    s = rl.Session(model="tiny-arith", task="arithmetic", algorithm=args.algorithm, cluster="inline",
                   prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8, threads=args.threads, seed=0)
    s.run(args.steps + 2, progress=False)
    timings = s.metrics.iloc[2:].filter(like="time_").median()
    tokens = s.metrics.iloc[2:]["response_length"].median() * 16 * 8
    print(json.dumps({"bench": "grpo_step", "algorithm": args.algorithm, "threads": args.threads,
                      "steps": args.steps, "s_per_step": round(timings["time_step"], 4),
                      "stages_s": {k.removeprefix("time_"): round(v, 4) for k, v in timings.items() if k != "time_step"},
                      "generated_tokens_per_s": round(tokens / timings["time_rollout"])}))


if __name__ == "__main__":
    main()
