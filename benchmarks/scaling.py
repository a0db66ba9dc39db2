"""How a GRPO step's time and memory grow with samples_per_prompt and with model size.

Every setting runs in a fresh process (so its peak resident memory is its own): 16 prompts per step, at
most 8 new tokens, inline, one torch thread, old_logp from the update's own forward. Prints one JSON line
per setting: median s/step after two warm-up steps, the stage split, generated tokens/s of the rollout and
the peak resident memory. Sweeps: samples_per_prompt 4, 8, 16, 32 on tiny-arith (~1.1M parameters); model
size ~1M (tiny-arith), ~4M and ~20M (random-init Qwen2 with tiny-arith's tokenizer; their completions run
to the token limit) at 8 samples per prompt.
Run: .venv/bin/python benchmarks/scaling.py [--steps 8] [--precision fp32]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import rlbench as rl
from timing import random_qwen2

SIZES = {"~4M": dict(hidden=256, layers=4, intermediate=1024, heads=4, kv_heads=2),
         "~20M": dict(hidden=512, layers=5, intermediate=2048, heads=8, kv_heads=4)}
"""Random Qwen2 shapes beside tiny-arith (~1.1M)."""


def measure(model: str, samples_per_prompt: int, steps: int, precision: str) -> dict:
    """One setting, in this process."""
    algorithm = rl.algorithms.get("grpo").replace(kl_coef=0.0)
    with rl.Session(model=model, task="arithmetic", algorithm=algorithm, cluster="inline", threads=1, seed=0,
                    log_dir=None, prompts_per_step=16, samples_per_prompt=samples_per_prompt, max_new_tokens=8,
                    lr=1e-4, precision=precision, on_policy_old_logp=True) as s:
        parameters = sum(p.numel() for p in s.policy.workers.hosts[0].objects["policy"].model.parameters())
        metrics = s.run(steps + 2, progress=False).iloc[2:]
    timings = metrics.filter(like="time_").median()
    tokens = metrics["response_length"] * 16 * samples_per_prompt
    return {"parameters": parameters, "samples_per_prompt": samples_per_prompt, "precision": precision,
            "s_per_step": round(timings["time_step"], 4),
            "stages_s": {k.removeprefix("time_"): round(v, 4) for k, v in timings.items() if k != "time_step"},
            "generated_tokens_per_s": round((tokens / metrics["time_rollout"]).median()),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def run_child(sweep: str, name: str, model: str, samples_per_prompt: int, args) -> None:
    child = json.dumps(dict(model=model, samples_per_prompt=samples_per_prompt, steps=args.steps,
                            precision=args.precision))
    env = os.environ | {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, __file__, "--child", child], check=True, env=env, capture_output=True,
                         text=True).stdout
    print(json.dumps({"bench": "scaling", "sweep": sweep, "model": name, **json.loads(out.splitlines()[-1])}),
          flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(**json.loads(args.child))))
        return
    tiny = str(rl.models.resolve("tiny-arith"))
    for n in (4, 8, 16, 32):
        run_child("samples_per_prompt", "tiny-arith", tiny, n, args)
    with tempfile.TemporaryDirectory() as tmp:
        models = [("tiny-arith", tiny)] + [(f"random-qwen2-{name}", random_qwen2(f"{tmp}/{name}", **shape))
                                           for name, shape in SIZES.items()]
        for name, model in models:
            run_child("model_size", name, model, 8, args)


if __name__ == "__main__":
    main()
