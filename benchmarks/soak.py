"""Soak: a long inline GRPO run on the tiny task with periodic checkpoints; memory over time and failures.

Prints one JSON line: resident memory every `--every` steps (MiB), its growth after warm-up and its slope
over the second half of the run, the size of the metrics history (as JSON), peak memory,
checkpoint save time, and the failures seen (skipped optimizer steps, reward errors; an exception ends it).
A leak shows as growth that keeps going after warm-up; the metrics history (one row per step) is the
only thing meant to grow, by a few KiB per step.

Run: .venv/bin/python benchmarks/soak.py [--steps 2000] [--save-every 100] [--threads 1]
"""

import argparse
import json
import resource
import tempfile
import time

import numpy as np

import rlbench as rl


def rss_mib() -> float:
    """This process's resident memory now (MiB)."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--every", type=int, default=100, help="memory sample interval, in steps")
    parser.add_argument("--warmup", type=int, default=200, help="steps before memory should stop growing")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    samples: dict[int, float] = {}

    def sample_memory(session, row):
        if session.step_count % args.every == 0:
            samples[session.step_count] = round(rss_mib(), 1)

    with tempfile.TemporaryDirectory() as folder:
        s = rl.Session(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", seed=0,
                       prompts_per_step=args.prompts, samples_per_prompt=args.samples, max_new_tokens=8, lr=1e-4,
                       threads=args.threads, log_dir=folder, save_every=args.save_every, keep_last=2)
        s.callbacks.append(sample_memory)
        start = time.perf_counter()
        s.run(args.steps, progress=False)
        wall = time.perf_counter() - start
        save_start = time.perf_counter()
        s.save()
        save_s = time.perf_counter() - save_start
        metrics = s.metrics
        s.close()

    after = [v for k, v in samples.items() if k >= args.warmup]
    late = [(k, v) for k, v in samples.items() if k >= args.steps // 2]
    slope = float(np.polyfit(*zip(*late), 1)[0]) * 1000 if len(late) > 1 else None
    print(json.dumps({
        "bench": "soak", "steps": args.steps, "save_every": args.save_every, "threads": args.threads,
        "wall_s": round(wall, 1), "s_per_step": round(wall / args.steps, 4), "save_s": round(save_s, 3),
        "rss_mib_by_step": samples, "rss_growth_after_warmup_mib": round(after[-1] - after[0], 1) if after else None,
        "rss_slope_second_half_mib_per_1000_steps": None if slope is None else round(slope, 1),
        "metrics_history_mib": round(len(json.dumps(metrics.to_dict("records"))) / 2**20, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "failures": {"skipped_updates": int(metrics["skipped"].sum()),
                     "reward_errors": int(metrics["reward_errors"].sum())},
        "reward_first_100": round(float(metrics["reward_mean"][:100].mean()), 3),
        "reward_last_100": round(float(metrics["reward_mean"][-100:].mean()), 3),
    }))


if __name__ == "__main__":
    main()
