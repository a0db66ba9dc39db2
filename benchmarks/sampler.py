"""Sampler throughput: rlbench's HF decode loop vs transformers `generate`, same model, batch and prompts.

Prints one JSON line per (batch size, mode): generated tokens per second for both, and their ratio.
Modes: greedy and sampled with one sample per prompt (`batch` different prompts), and "grpo": 8 samples
per prompt at temperature 1 (`batch` / 8 prompts; `generate` with num_return_sequences=8), the rollout
shape of a GRPO step. Greedy rows produce identical tokens in both, so the work is the same; sampled rows
count real tokens. --precision bf16 runs both on a bfloat16 copy of the model.
Then each engine of `--engines` that runs here (default: vllm and sglang) against the HF decode loop at the GRPO shape,
in turns: one JSON line per batch size with both tokens per second, or one line saying why the engine cannot run.
Run: .venv/bin/python benchmarks/sampler.py [--model tiny-arith] [--threads 1] [--batch 32 128] [--precision fp32]
     [--engines vllm sglang]
"""

import argparse
import json
import time

import torch

import rlbench as rl
from rlbench.batch import left_pad
from rlbench.samplers import HFSampler, SamplingParams
from timing import tokens_per_second


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-arith")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--engines", nargs="*", choices=list(ENGINES), default=list(ENGINES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = rl.models.load(args.model, dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32)
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    prompts = [tokenizer.encode(e["prompt"], add_special_tokens=False) for e in rl.tasks.get("arithmetic").test]
    for batch in args.batch:
        for mode, n, temperature in [("greedy", 1, 0.0), ("sampled", 1, 1.0), ("grpo", 8, 1.0)]:
            rows = [prompts[i % len(prompts)] for i in range(batch // n)]
            params = SamplingParams(n=n, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=0)
            ours, theirs = tokens_per_second([lambda: sampler.generate(rows, params)["response_mask"].sum(),
                                              lambda: _generate(model, tokenizer, rows, params)], args.repeats)
            print(json.dumps({"bench": "sampler", "model": args.model, "threads": args.threads, "batch": batch,
                              "mode": mode, "precision": args.precision,
                              "rlbench_tokens_per_s": round(ours), "generate_tokens_per_s": round(theirs),
                              "speedup": round(ours / theirs, 2)}), flush=True)
    for engine in args.engines:
        compare_engine(engine, sampler, tokenizer, prompts, args)


ENGINES = {"vllm": (rl.samplers.vllm, "VLLMSampler"), "sglang": (rl.samplers.sglang, "SGLangSampler")}


def compare_engine(engine: str, hf: HFSampler, tokenizer, prompts, args) -> None:
    """The engine against the HF decode loop at the GRPO shape (8 samples per prompt, temperature 1)."""
    module, name = ENGINES[engine]
    usable, why = module.available()
    if not usable:
        print(json.dumps({"bench": "sampler_engine", "engine": engine, "skipped": why}), flush=True)
        return
    start = time.perf_counter()
    sampler = getattr(module, name).from_pretrained(rl.models.resolve(args.model),
                                                    dtype="bfloat16" if args.precision == "bf16" else "float32")
    startup = time.perf_counter() - start
    for batch in args.batch:
        rows = [prompts[i % len(prompts)] for i in range(batch // 8)]
        params = SamplingParams(n=8, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
        ours, theirs = tokens_per_second([lambda: hf.generate(rows, params)["response_mask"].sum(),
                                          lambda: sampler.generate(rows, params)["response_mask"].sum()], args.repeats)
        print(json.dumps({"bench": "sampler_engine", "engine": engine, "why": why, "model": args.model,
                          "threads": args.threads, "batch": batch, "mode": "grpo", "precision": args.precision,
                          "hf_tokens_per_s": round(ours), f"{engine}_tokens_per_s": round(theirs),
                          "over_hf": round(theirs / ours, 2), "startup_s": round(startup, 1)}), flush=True)
    sampler.close()


def _generate(model, tokenizer, rows, params):
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=params.max_new_tokens,
                         do_sample=not params.greedy, temperature=params.temperature or None, top_k=None, top_p=None,
                         num_return_sequences=params.n,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    new = out[:, ids.shape[1]:]
    # count real tokens: up to and including the first EOS of each row
    is_eos = new == tokenizer.eos_token_id
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).sum()


if __name__ == "__main__":  # (SGLang's engine spawns its scheduler process, which re-imports this script)
    main()
