"""A vision-language step against the same-size text step: tiny-vl on "shapes" vs tiny-arith on "arithmetic".

Both models have the same language model (2 layers, hidden 128, the byte tokenizer); tiny-vl adds a one-block
vision tower whose 16 image tokens sit in every prompt, and decodes through transformers' forward (the compact
decoder takes text models only); both train in the packed layout (each group's prompt, and pictures, once). The same GRPO step: 16 prompts x 8 samples, at most 16 new tokens, inline, one torch
thread, fp32; runs alternate between the two models. Reported per model (medians over the steps after 2 warm-up
steps, then the median over rounds): s/step and its stages, prompt and response tokens per row, sampled tokens/s
(response tokens over the rollout's time) and trained tokens/s (prompt and response tokens over the update's time);
each run's stage timings beside them.
JSON lines on stdout, and all of them in `--out` (default `benchmarks/results/vision/vision.json`).
Run: .venv/bin/python benchmarks/vision.py [--steps 10] [--rounds 2]
"""

import argparse
import json
import statistics
from pathlib import Path

import rlbench as rl

MODELS = {"text": ("tiny-arith", "arithmetic"), "vision": ("tiny-vl", "shapes")}
PROMPTS, SAMPLES, MAX_NEW_TOKENS = 16, 8, 16


def measure(kind: str, steps: int) -> dict:
    model, task = MODELS[kind]
    task = rl.tasks.Shapes() if task == "shapes" else task
    with rl.Session(model=model, task=task, algorithm="grpo", cluster="inline", prompts_per_step=PROMPTS,
                    samples_per_prompt=SAMPLES, max_new_tokens=MAX_NEW_TOKENS, threads=1, seed=0, log_dir=None) as s:
        s.run(steps + 2, progress=False)
        batch = s.rollout()  # one more, for its prompt lengths (image tokens included)
        prompt_tokens = float(batch["prompt_mask"].sum(-1).float().mean())
        m = s.metrics.iloc[2:].median(numeric_only=True)
    rows = PROMPTS * SAMPLES
    stages = {k.removeprefix("time_"): m[k] for k in m.index if k.startswith("time_") and k != "time_step"}
    return {"model": model, "s_per_step": m["time_step"], "stages_s": stages,
            "prompt_tokens": prompt_tokens, "response_tokens": m["response_length"],
            "sampled_tokens_per_s": m["response_length"] * rows / m["time_rollout"],
            "trained_tokens_per_s": (prompt_tokens + m["response_length"]) * rows / m["time_update"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "vision" / "vision.json"))
    args = parser.parse_args()
    runs = {kind: [] for kind in MODELS}
    for round_ in range(args.rounds):
        for kind in MODELS if round_ % 2 == 0 else reversed(MODELS):
            runs[kind].append(measure(kind, args.steps))
            print(json.dumps({"bench": "vision", "round": round_, "kind": kind} | runs[kind][-1]), flush=True)
    summary = {kind: {key: statistics.median(r[key] for r in rs) for key in rs[0] if key not in ("model", "stages_s")}
               for kind, rs in runs.items()}
    ratio = {key: summary["vision"][key] / summary["text"][key] for key in
             ("s_per_step", "sampled_tokens_per_s", "trained_tokens_per_s")}
    result = {"bench": "vision", "steps": args.steps, "rounds": args.rounds, "prompts": PROMPTS, "samples": SAMPLES,
              "max_new_tokens": MAX_NEW_TOKENS, "threads": 1, "summary": summary, "vision_over_text": ratio, "runs": runs}
    print(json.dumps({"bench": "vision", "vision_over_text": ratio}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
