"""Step time inline vs on Ray (world size 1 and 2), and the weight-sync time, on the tiny GRPO setting.

Each Ray setting is measured against an inline session open at the same time, their steps alternating, so that
a change in the machine's load (a shared CPU) slows both alike. Prints one JSON line per setting (medians over
steps after warm-up of both sessions' step and stage times; the overhead is the median over steps of the Ray step
time over the inline step run just before it, minus 1) and a summary. Run: .venv/bin/python benchmarks/ray_overhead.py
[--steps 20]

Measured (2-core shared CPU, --steps 10; inline and Ray run one after the other): a 1-rank Ray step 0.290 s against
0.177 s inline (+63%) before Batches were pickled as numpy buffers and the ranks sent only tensor columns; after,
0.240 s against 0.202 s (+19%) and 0.270 s against 0.218 s (+24%, --steps 20). Run one after the other, the
figures moved with the load other jobs put on the machine (+25% and +39% for the same code ten minutes apart): hence
the alternating steps above.

Fewer driver round trips (the policy's and the reference's log-probs started before either is waited for,
`PolicyHandle.train_step` = forward_backward + optim_step in one call), --steps 20, four runs of each, the code
before / after alternating on the same machine: 1-rank overhead +23.6%, +16.6%, +18.1%, +20.5% before (mean
+19.7%), +10.9%, +10.3%, +22.1%, +16.0% after (mean +14.8%; the first two pairs by the ratio of median step times,
the last two by the median paired ratio); inline step time unchanged (benchmarks/step.py 0.222 / 0.163 s before,
0.215 / 0.163 s after). 2 ranks: +73% to +113% both before and after (gloo collectives of two ranks sharing
two cores). Where the remaining ~35 ms of a 1-rank step go, Ray stage minus inline stage in the last run: the
weight sync 9 ms (putting 4.7 MB of weights into the object store, then the sampler's call: chaining the
reference straight into the sampler's call without a wait measured no better), the sampler's call 7 ms, the
reward actor's call 6 ms (timed inside the actor, scoring itself takes longer there than inline), the two
log-prob calls 6 ms, the update 2-3 ms.
"""

import argparse
import json
import statistics

import rlbench as rl

SETTING = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", prompts_per_step=16, samples_per_prompt=8,
               max_new_tokens=8, lr=1e-4, seed=0, log_dir=None)
WARMUP = 2


def measure(steps: int, **cluster) -> dict:
    """Median step and stage times of a session on `cluster` and of an inline session stepped in turn with it;
    the overhead is the median over steps of the ratio of the two step times (each pair ran back to back)."""
    with rl.Session(**SETTING, cluster="inline", threads=1) as inline, rl.Session(**SETTING, **cluster) as s:
        for _ in range(WARMUP + steps):
            inline.step()
            s.step()
        ray_times, inline_times = (x.metrics.iloc[WARMUP:].filter(like="time_") for x in (s, inline))
    ratio = statistics.median(ray_times["time_step"] / inline_times["time_step"])
    return {"bench": "ray_overhead", **{k: str(v) for k, v in cluster.items()}, "overhead_frac": round(ratio - 1, 3),
            "s_per_step": round(ray_times["time_step"].median(), 4),
            "inline_s_per_step": round(inline_times["time_step"].median(), 4),
            "sync_s": round(ray_times["time_sync"].median(), 4), "stages_s": stages(ray_times),
            "inline_stages_s": stages(inline_times)}


def stages(times) -> dict[str, float]:
    return {k.removeprefix("time_"): round(v, 4) for k, v in times.median().items() if k != "time_step"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rows = [measure(args.steps, cluster="ray", world_size=1), measure(args.steps, cluster="ray", world_size=2)]
    for row in rows:
        print(json.dumps(row), flush=True)
    print(json.dumps({"bench": "ray_overhead_summary", "ray_ws1_overhead_frac": rows[0]["overhead_frac"],
                      "ray_ws2_overhead_frac": rows[1]["overhead_frac"],
                      "ray_sync_frac_of_step": round(rows[0]["sync_s"] / rows[0]["s_per_step"], 3)}))


if __name__ == "__main__":
    main()
