"""GPU check of a GSM8K recipe: a few training steps of algorithms/grpo/gsm8k-qwen2.5-0.5b.toml with its own
settings (fewer prompts per step and shorter responses, to be quick), through the same path as `rlbench run`.

Needs a CUDA GPU, vLLM's GPU build (`pip install -e ".[vllm]"`) and Qwen2.5-0.5B-Instruct on local disk.
Written on a machine without a GPU: not run yet. Run (a few minutes on one H100-class GPU):

    python benchmarks/gpu/gsm8k_recipe_check.py --model /path/to/Qwen2.5-0.5B-Instruct [--steps 3]
    python benchmarks/gpu/gsm8k_recipe_check.py --recipe algorithms/ppo/gsm8k-qwen2.5-0.5b.toml --model ...

Data: the recipe's parquet files (data/gsm8k/, from datasets/prepare_gsm8k.py) when present; otherwise the
shipped sample (datasets/samples/gsm8k.jsonl, converted by the same script) is both train and test set.
Prints one JSON line per check: the recipe, the sampler chosen, held-out greedy accuracy on --eval-prompts
before and after, and per step the reward, accuracy, sampler/trainer log-prob mismatch, stage times and
GPU memory. Exits non-zero if a step has a non-finite metric or a reward error, or vLLM was not used.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import rlbench as rl
from rlbench.experiments import recipes

REPO = Path(__file__).resolve().parents[2]


def show(check: str, **values) -> None:
    print(json.dumps({"check": check, **values}), flush=True)


def main():
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--recipe", default=str(REPO / "algorithms/grpo/gsm8k-qwen2.5-0.5b.toml"))
    options.add_argument("--model", default=None, help="local model directory (default: the recipe's)")
    options.add_argument("--steps", type=int, default=3)
    options.add_argument("--prompts-per-step", type=int, default=32)
    options.add_argument("--max-new-tokens", type=int, default=512)
    options.add_argument("--eval-prompts", type=int, default=64)
    args = options.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this check needs a CUDA GPU")
    show("device", name=torch.cuda.get_device_name(), torch=torch.__version__)
    failed = []

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"steps={args.steps}", f"session.prompts_per_step={args.prompts_per_step}",
                     f"session.max_new_tokens={args.max_new_tokens}", "session.log_dir=none",
                     *([f"session.model={args.model}"] if args.model else []), *data_overrides(args.recipe, tmp)]
        recipe = recipes.load(args.recipe, overrides)
        show("recipe", path=recipe.path, steps=recipe.steps, algorithm=recipe.session["algorithm"],
               overrides=overrides)
        with rl.Session(**recipe.session_kwargs()) as session:
            if session.sampler.choice != "vllm":
                failed.append("sampler")
            show("sampler", choice=session.sampler.choice, why=session.sampler.why)
            before = session.evaluate(max_prompts=args.eval_prompts)
            for _ in range(recipe.steps):
                row = session.step()
                finite = all(math.isfinite(v) for v in row.values() if isinstance(v, float))
                if not finite or row["reward_errors"]:
                    failed.append(f"step {row['step']}")
                show("step", finite=finite, step=row["step"], reward_errors=row["reward_errors"],
                       reward=round(row["reward_mean"], 4), accuracy=round(row["accuracy"], 4),
                       response_length=round(row["response_length"], 1),
                       sampler_mismatch_mean=row["sampler_mismatch_mean"],
                       seconds={k.removeprefix("time_"): round(v, 2) for k, v in row.items() if k.startswith("time_")},
                       gpu_max_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
            after = session.evaluate(max_prompts=args.eval_prompts)
            show("heldout_greedy_accuracy", prompts=args.eval_prompts, before=before["greedy_accuracy"],
                   after=after["greedy_accuracy"])
    show("done", failed=failed)
    sys.exit(1 if failed else 0)


def data_overrides(recipe_path: str, tmp: str) -> list[str]:
    """Nothing when the recipe's data files exist; else the shipped GSM8K sample as train and test set."""
    task = recipes.load(recipe_path).session["task"]
    if all(Path(task[split]).expanduser().is_file() for split in ("train", "test")):
        return []
    sample = REPO / "datasets/samples/gsm8k.jsonl"
    subprocess.run([sys.executable, str(REPO / "datasets/prepare_gsm8k.py"), "--train", str(sample), "--test",
                    str(sample), "--out", tmp], check=True)
    show("data", source=str(sample), note="the recipe's data files are missing: using the shipped sample")
    return [f"session.task.train={tmp}/train.parquet", f"session.task.test={tmp}/test.parquet"]


if __name__ == "__main__":
    main()
