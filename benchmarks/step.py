"""Seconds per GRPO step on the tiny arithmetic task, split by stage (median over steps after warm-up).

The algorithm's own KL to the reference is kept (grpo's kl_coef 0.001: a reference forward per step) unless
--no-kl. --on-policy-old-logp takes old_logp from the update's forward; --rollout-mode overlap samples the next batch
during the update (a second thread); --precision bf16 trains under bfloat16 autocast. Also prints generated tokens/s of the rollout and the process's peak resident memory.
Run: .venv/bin/python benchmarks/step.py [--steps 20] [--threads 1] [--on-policy-old-logp | --rollout-mode overlap|async]
[--precision bf16]
"""

import argparse
import json
import resource

import rlbench as rl


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--algorithm", default="grpo")
    parser.add_argument("--no-kl", action="store_true")
    parser.add_argument("--on-policy-old-logp", action="store_true")
    parser.add_argument("--rollout-mode", choices=["sync", "overlap", "async"], default="sync")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    algorithm = rl.algorithms.get(args.algorithm)
    if args.no_kl:
        algorithm = algorithm.replace(kl_coef=0.0)
    s = rl.Session(model="tiny-arith", task="arithmetic", algorithm=algorithm, cluster="inline",
                   prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8, threads=args.threads, seed=0,
                   log_dir=None, on_policy_old_logp=args.on_policy_old_logp,
                   rollout={"sync": rl.Sync(), "overlap": rl.Overlap(), "async": rl.Async()}[args.rollout_mode],
                   precision=args.precision)
    s.run(args.steps + 2, progress=False)
    timings = s.metrics.iloc[2:].filter(like="time_").median()
    tokens = s.metrics.iloc[2:]["response_length"].median() * 16 * 8
    print(json.dumps({"bench": "grpo_step", "algorithm": args.algorithm, "kl": not args.no_kl,
                      "on_policy_old_logp": args.on_policy_old_logp,
                      "rollout_mode": args.rollout_mode, "precision": args.precision,
                      "threads": args.threads, "steps": args.steps, "s_per_step": round(timings["time_step"], 4),
                      "stages_s": {k.removeprefix("time_"): round(v, 4) for k, v in timings.items() if k != "time_step"},
                      "generated_tokens_per_s": round(tokens / timings["time_rollout"]),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


if __name__ == "__main__":
    main()
