"""Sampler throughput: rlbench's HF decode loop vs the vLLM sampler, same model, prompts and parameters.

Two models: tiny-arith (1.1M parameters, answers end on EOS after a few tokens) and a random ~4M-parameter
Qwen2 built here, offline (its completions run to max_new_tokens). For each batch size (rows = prompts x n)
and mode (greedy n=1; sampled at temperature 1 with n=8 per prompt, as in a GRPO rollout), prints one
JSON line: generated tokens per second of both samplers (median of repeats) and their ratio.
vLLM runs in this process with the process's torch threads (--threads), like the HF sampler.
Run: python benchmarks/vllm_sampler.py [--threads 1] [--batch 32 128 512] [--max-new-tokens 16]
"""

import argparse
import json
import tempfile
import time

import torch

import rlbench as rl
from rlbench.samplers import HFSampler, SamplingParams, VLLMSampler
from timing import random_qwen2, tokens_per_second


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_dir in [("tiny-arith", str(rl.models.resolve("tiny-arith"))),
                                ("random-qwen2-4m", random_qwen2(tmp))]:
            compare(name, model_dir, args)


def compare(name: str, model_dir: str, args) -> None:
    model, tokenizer = rl.models.load(model_dir)
    hf = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    start = time.perf_counter()
    vllm = VLLMSampler.from_pretrained(model_dir)
    startup = time.perf_counter() - start
    prompts = [tokenizer.encode(e["prompt"], add_special_tokens=False) for e in rl.tasks.get("arithmetic").test]
    parameters = sum(p.numel() for p in model.parameters())
    for batch in args.batch:
        for mode, n, temperature in [("greedy", 1, 0.0), ("sampled", 8, 1.0)]:
            rows = [prompts[i % len(prompts)] for i in range(batch // n)]
            params = SamplingParams(n=n, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=0)
            hf_rate, vllm_rate = tokens_per_second([lambda: hf.generate(rows, params)["response_mask"].sum(),
                                                    lambda: vllm.generate(rows, params)["response_mask"].sum()],
                                                   args.repeats)
            print(json.dumps({"bench": "vllm_sampler", "model": name, "parameters": parameters,
                              "threads": args.threads, "batch": batch, "mode": mode, "n": n,
                              "hf_tokens_per_s": round(hf_rate), "vllm_tokens_per_s": round(vllm_rate),
                              "vllm_over_hf": round(vllm_rate / hf_rate, 2),
                              "vllm_startup_s": round(startup, 1)}), flush=True)
    vllm.close()


if __name__ == "__main__":
    main()
