"""GPU check for sessions on Ray: the policy on NCCL (FSDP2) for 2 steps, with the CPU run's assertions.

Run on a machine with CUDA: `.venv/bin/python benchmarks/gpu/ray_nccl_check.py`. With one GPU the policy
runs world size 1 on NCCL (two ranks cannot share a GPU under NCCL); with two or more GPUs, world size 2.
Checks: losses and rewards of the first 2 steps match the CPU inline run within 1e-3 (GPU kernels differ),
the sampler-vs-trainer mismatch stays under 1e-3 (fp32), and no worker process outlives close().
Prints one JSON line; exits non-zero on a failed check.
"""

import json
import os
import sys
import time

import torch

import rlbench as rl

SETTING = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", prompts_per_step=16, samples_per_prompt=8,
               max_new_tokens=8, lr=1e-4, seed=0, log_dir=None)


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"check": "ray_nccl", "skipped": "no CUDA device"}))
        return 0
    world_size = 2 if torch.cuda.device_count() >= 2 else 1
    with rl.Session(**SETTING, cluster="inline", device="cpu") as cpu:
        expected = cpu.run(2, progress=False)
    start = time.perf_counter()
    gpu = rl.Session(**SETTING, cluster="ray", device="cuda", world_size=world_size)
    metrics = gpu.run(2, progress=False)
    pids = [pid for group in gpu._groups for pid in group.pids()]
    gpu.close()
    time.sleep(5)
    checks = {
        "loss_close": bool((metrics["loss"] - expected["loss"]).abs().max() < 1e-3),
        "reward_close": bool((metrics["reward_mean"] - expected["reward_mean"]).abs().max() < 1e-3),
        "sync_mismatch_small": bool(metrics["sampler_mismatch_max"].max() < 1e-3),
        "no_leftover_workers": not [p for p in pids if os.path.exists(f"/proc/{p}")],
    }
    print(json.dumps({"check": "ray_nccl", "world_size": world_size, "wall_s": round(time.perf_counter() - start, 1),
                      "s_per_step": round(float(metrics["time_step"].median()), 4),
                      "sync_s": round(float(metrics["time_sync"].median()), 4), **checks}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
