"""Throughput of the code sandbox: runs per second of a trivial program (`print(1)`), one at a time and
`--concurrent` at a time (threads, as `score_all(workers=...)` and the python tool run them).

Prints one JSON line per mode that works here (`rl.rewards.sandbox_info()["available"]`, or `--mode`): runs/s
sequential and concurrent, and the median seconds of one run. Code rewards run thousands of programs per step,
so this is the sandbox's cost. Measured (2-core shared CPU, root, 100 runs; one at a time / 4 threads; two
rounds in turns, the sandbox of d43898b and this one, on 2026-12-04):
                                         d43898b: alone, 4 threads      this one: alone, 4 threads
  namespaces (root)                      17.7-18.0 /s  34.0-38.6 /s     17.1-18.4 /s  46.3-50.3 /s
  bwrap forced as root (in a cgroup)     10.2-11.0 /s  27.2-27.3 /s     17.6-18.3 /s  41.1-41.7 /s
  rlimits as root                        31.8-32.2 /s  53.4-58.2 /s     refused here (see below)
This one runs the launcher outside the run's cgroup, stdin/stdout/stderr in memfds and bubblewrap's child as the
run's PID 1 (no jail process that becomes bubblewrap). As root, "rlimits" now runs the program as a uid of its
own, and is refused where that uid cannot read the interpreter (here: it is under /root).
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
