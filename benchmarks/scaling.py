"""How a GRPO step's time and memory grow with samples_per_prompt and with model size: cost curves.

Every setting runs in a fresh process (so its peak resident memory is its own): 16 prompts per step, at
most 8 new tokens, inline, one torch thread, old_logp from the update's own forward. Prints one JSON line
per setting: median s/step after the warm-up steps, the stage split, generated tokens/s of the rollout, trained
tokens/s of the update (every sample's prompt and response tokens over the update's time; the trainer runs a
group's shared prompt once, so it computes fewer), the peak resident memory and the process's resident memory
before the session (`model_mb` is the difference). Sweeps: samples_per_prompt 4, 8, 16, 32 on tiny-arith
(~1.1M parameters, trained: its answers end after ~4 tokens); model size ~1M (tiny-arith's shape), ~4M, ~20M
and ~80M, all random-init Qwen2 with tiny-arith's tokenizer, so that every size generates (nearly) all 8 tokens
(the same shape per step), at 8 samples per prompt. The last line is the summary: the power-law exponents of
s/step and of memory against the parameter count (least squares in log-log), also drawn in --plot. The lines
are saved to --out and the figure to --plot (by default benchmarks/results/scaling.jsonl and .png).

Run: .venv/bin/python benchmarks/scaling.py [--steps 8] [--precision fp32]   (~6 min on a 2-core CPU)
     .venv/bin/python benchmarks/scaling.py --quick --out /tmp/s.jsonl --plot /tmp/s.png   (two tiny sizes, 1 step)
     .venv/bin/python benchmarks/scaling.py --plot-only benchmarks/results/scaling.jsonl   (redraw, refit)
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import rlbench as rl
from timing import random_qwen2

HERE = Path(__file__).resolve().parent
SIZES = {"~1M": dict(hidden=192, layers=2, intermediate=768, heads=6, kv_heads=2),  # tiny-arith's shape
         "~4M": dict(hidden=256, layers=4, intermediate=1024, heads=4, kv_heads=2),
         "~20M": dict(hidden=512, layers=5, intermediate=2048, heads=8, kv_heads=4),
         "~80M": dict(hidden=768, layers=9, intermediate=3072, heads=12, kv_heads=4)}
"""Random Qwen2 shapes of the model-size sweep (parameters: 1.13M, 4.00M, 19.8M, 78.1M)."""
MAX_STEPS = {"~80M": 4}
"""Fewer measured steps for the sizes whose step takes seconds (their step-to-step spread is small)."""
VARIANTS = ("full",)
"""What trains in the model-size sweep: "full" = every weight. --lora adds "lora": a rank-16 adapter on every linear
layer (`variant_settings`)."""
SAMPLES_PER_PROMPT = (4, 8, 16, 32)


def variant_settings(variant: str) -> dict:
    """The Session settings of a variant of the model-size sweep."""
    return {"full": {}, "lora": {"lora": rl.LoRA(rank=16, alpha=32)}}[variant]


def measure(model: str, samples_per_prompt: int, steps: int, warmup: int, precision: str, variant: str) -> dict:
    """One setting, in this process."""
    rss_before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    algorithm = rl.algorithms.get("grpo").replace(kl_coef=0.0)
    trained_tokens = []
    with rl.Session(model=model, task="arithmetic", algorithm=algorithm, cluster="inline", threads=1, seed=0,
                    log_dir=None, prompts_per_step=16, samples_per_prompt=samples_per_prompt, max_new_tokens=8,
                    lr=1e-4, precision=precision, on_policy_old_logp=True, **variant_settings(variant)) as s:
        weights = list(s.policy.workers.hosts[0].objects["policy"].model.parameters())
        for _ in range(warmup + steps):
            s.step()
            trained_tokens.append(int(s.last_batch["prompt_mask"].sum() + s.last_batch["response_mask"].sum()))
        metrics = s.metrics.iloc[warmup:]
    timings = metrics.filter(like="time_").median()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "parameters": sum(p.numel() for p in weights),
            "trainable_parameters": sum(p.numel() for p in weights if p.requires_grad),
            "samples_per_prompt": samples_per_prompt, "precision": precision, "steps": steps,
            "response_length": round(float(metrics["response_length"].mean()), 2),
            "s_per_step": round(timings["time_step"], 4),
            "stages_s": {k.removeprefix("time_"): round(v, 4) for k, v in timings.items() if k != "time_step"},
            "generated_tokens_per_s": round((metrics["tokens_generated"] / metrics["time_rollout"]).median()),
            "trained_tokens_per_s": round((np.array(trained_tokens[warmup:]) / metrics["time_update"]).median()),
            "peak_rss_mb": round(peak_mb), "model_mb": round(peak_mb - rss_before_mb)}


def run_child(sweep: str, name: str, model: str, samples_per_prompt: int, steps: int, variant: str, args) -> dict:
    child = json.dumps(dict(model=model, samples_per_prompt=samples_per_prompt, steps=steps, warmup=args.warmup,
                            precision=args.precision, variant=variant))
    env = os.environ | {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, __file__, "--child", child], check=True, env=env, capture_output=True,
                         text=True).stdout
    row = {"bench": "scaling", "sweep": sweep, "model": name, **json.loads(out.splitlines()[-1])}
    print(json.dumps(row), flush=True)
    return row


def power_law_exponent(x: list[float], y: list[float]) -> float:
    """The slope b of log y = a + b log x, least squares."""
    return round(float(np.polyfit(np.log(x), np.log(y), 1)[0]), 3)


def summary(rows: list[dict]) -> dict:
    """The fitted exponents of the model-size sweep, per variant."""
    fits = {}
    for variant in sorted({r["variant"] for r in rows if r["sweep"] == "model_size"}):
        sized = [r for r in rows if r["sweep"] == "model_size" and r["variant"] == variant]
        n = [r["parameters"] for r in sized]
        fits[variant] = {f"{key}_exponent": power_law_exponent(n, [r[key] for r in sized])
                         for key in ("s_per_step", "peak_rss_mb", "model_mb")}
        fits[variant]["sizes"] = len(sized)
    return {"bench": "scaling", "summary": True, "fit": fits}


def plot(rows: list[dict], fits: dict, path: str) -> None:
    """s/step and memory against parameters, log-log, each with its fitted power law in the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant, fit in fits.items():
        sized = sorted((r for r in rows if r["sweep"] == "model_size" and r["variant"] == variant),
                       key=lambda r: r["parameters"])
        n = np.array([r["parameters"] for r in sized], dtype=float)
        for ax, key, label in [(left, "s_per_step", "s/step"), (right, "peak_rss_mb", "peak RSS"),
                               (right, "model_mb", "peak RSS - RSS before the session")]:
            y = np.array([r[key] for r in sized], dtype=float)
            (line,) = ax.loglog(n, y, "o", label=f"{variant}: {label}")
            coef = np.polyfit(np.log(n), np.log(y), 1)
            ax.loglog(n, np.exp(np.polyval(coef, np.log(n))), "--", color=line.get_color(),
                      label=f"fit ∝ N^{fit[f'{key}_exponent']:.2f}")
        for stage in ("rollout", "update"):
            left.loglog(n, [r["stages_s"][stage] for r in sized], ".:", label=f"{variant}: {stage} s")
    left.set(xlabel="parameters N", ylabel="seconds per step", title="GRPO step time (16 x 8 samples x 8 tokens, CPU)")
    right.set(xlabel="parameters N", ylabel="MB", title="peak resident memory")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(rows: list[dict], args) -> None:
    line = summary(rows)
    print(json.dumps(line), flush=True)
    if args.plot:
        plot(rows, line["fit"], args.plot)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="measured steps per setting (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--quick", action="store_true", help="two tiny sizes, 1 warm-up + 1 step, no samples sweep")
    parser.add_argument("--lora", action="store_true", help="LoRA rows (rank 16, all linear layers) beside full fine-tuning")
    parser.add_argument("--out", default=str(HERE / "results/scaling.jsonl"), help="the JSON lines, saved here")
    parser.add_argument("--plot", default=str(HERE / "results/scaling.png"), help="the figure ('' for none)")
    parser.add_argument("--plot-only", metavar="FILE.jsonl", help="refit and redraw from saved lines, run nothing")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(**json.loads(args.child))))
        return
    if args.plot_only:
        lines = [json.loads(x) for x in Path(args.plot_only).read_text().splitlines() if x.strip()]
        finish([r for r in lines if not r.get("summary")], args)
        return
    variants = VARIANTS + (("lora",) if args.lora else ())
    torch.set_num_threads(1)
    if args.quick:
        args.steps, args.warmup = 1, 1
    sizes = {k: SIZES[k] for k in (("~1M", "~4M") if args.quick else SIZES)}
    rows = []
    if not args.quick:
        tiny = str(rl.models.resolve("tiny-arith"))
        rows += [run_child("samples_per_prompt", "tiny-arith", tiny, n, args.steps, "full", args)
                 for n in SAMPLES_PER_PROMPT]
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in sizes.items():
            model = random_qwen2(f"{tmp}/{name}", **shape)
            steps = min(args.steps, MAX_STEPS.get(name, args.steps))
            rows += [run_child("model_size", f"random-qwen2-{name}", model, 8, steps, variant, args)
                     for variant in variants]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows + [summary(rows)]))
    finish(rows, args)


if __name__ == "__main__":
    main()
