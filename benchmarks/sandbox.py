"""Throughput of the code sandbox: runs per second of a trivial program (`print(1)`), one at a time and
`--concurrent` at a time (threads, as `score_all(workers=...)` and the python tool run them).

Prints one JSON line per mode that works here (`rl.rewards.sandbox_info()["available"]`, or `--mode`): runs/s
sequential and concurrent, and the median seconds of one run. Code rewards run thousands of programs per step,
so this is the sandbox's cost. Measured (2-core shared CPU, root, 100 runs; one at a time / 4 threads; two
rounds, the old sandbox of 8a9c762 and this one in turns):
  before: one process with rlimits, `nobody`, a network namespace, the audit hook   14.9-16.3 /s   35.6-38.5 /s
  namespaces: PID/mount/net/IPC/UTS namespaces, uid, cgroup, seccomp (root)         11.6-12.4 /s   24.4 /s
  bwrap forced as root (a jail process joins the cgroup, then becomes bubblewrap)    6.8-6.9 /s    14.9-15.0 /s
  bwrap as a user (uid 65534, /usr/bin/python3, no cgroup), print(1) x 30           15.6 /s
  rlimits (the weak fallback, not root)                                             17.5-19.1 /s   29.9-35.0 /s
Run: .venv/bin/python benchmarks/sandbox.py [--runs 100] [--concurrent 4] [--mode namespaces]
"""

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from rlbench.rewards import Limits, run_python, sandbox_info


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--mode", choices=["namespaces", "bwrap", "rlimits"], help="default: every available one")
    args = parser.parse_args()
    limits = Limits(wall_s=10.0)
    for mode in [args.mode] if args.mode else sandbox_info()["available"]:

        def one(_) -> float:
            start = time.perf_counter()
            run = run_python("print(1)", limits=limits, mode=mode)
            if run.stdout != "1\n" or not run.ok:
                raise RuntimeError(f"the trivial program failed in {mode!r} mode: {run.reason}")
            return time.perf_counter() - start

        one(0)  # warm-up
        start = time.perf_counter()
        each = [one(i) for i in range(args.runs)]
        sequential = args.runs / (time.perf_counter() - start)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrent) as pool:
            list(pool.map(one, range(args.runs)))
        concurrent = args.runs / (time.perf_counter() - start)
        print(json.dumps({"mode": mode, "runs": args.runs, "runs_per_s": round(sequential, 1),
                          f"runs_per_s_{args.concurrent}_threads": round(concurrent, 1),
                          "median_run_s": round(statistics.median(each), 4)}), flush=True)


if __name__ == "__main__":
    main()
