"""GPU check of the vLLM sampler: correctness, weight-sync time, sleep / wake. Prints one JSON line per check.

Needs a CUDA GPU and vLLM's GPU build (`pip install -e ".[vllm]"`, with the CUDA torch vLLM wants).
Written on a machine without a GPU: not run yet. Run (about 5 minutes on one H100-class GPU):

    python benchmarks/gpu/vllm_sampler_check.py [--eager] [--skip-large]

1. tiny-arith (fp32): vLLM greedy == HFSampler greedy (both on the GPU); vLLM's log-probs vs the policy's
   recomputation (max |diff|); the one-token weight-sync test (and back).
2. A random Qwen2 of Qwen2.5-0.5B's shape (494M parameters), built here offline, engine in bf16 with
   `sleep_mode=True`: start-up time; `load_weights` time from GPU bf16 tensors and from CPU fp32 tensors
   (what a CPU-side policy sends); tokens/s of vLLM vs HFSampler.
3. Sleep / wake on the same engine: GPU memory in use awake, asleep (level 1 and level 2), and after
   `load_weights` woke it; greedy completions after waking equal those before sleeping.
Exits non-zero if a correctness check fails.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import rlbench as rl
from rlbench.batch import left_pad

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared timing helper
from timing import tokens_per_second  # noqa: E402
from rlbench.policy import batch_logp
from rlbench.samplers import HFSampler, SamplingParams, VLLMSampler

failures = []


def report(check: str, ok: bool | None = None, **values) -> None:
    if ok is False:
        failures.append(check)
    print(json.dumps({"check": check, **({} if ok is None else {"ok": ok}), **values}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (faster start-up)")
    parser.add_argument("--skip-large", action="store_true", help="only the tiny-model checks")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    settings = dict(enforce_eager=True if args.eager else None)
    report("device", name=torch.cuda.get_device_name(), torch=torch.__version__)
    tiny_checks(settings)
    if not args.skip_large:
        with tempfile.TemporaryDirectory() as tmp:
            large_checks(qwen2_half_b(tmp), settings)
    sys.exit(1 if failures else 0)


def tiny_checks(settings: dict) -> None:
    model_dir = str(rl.models.resolve("tiny-arith"))
    model, tokenizer = rl.models.load(model_dir)
    start = time.perf_counter()
    sampler = VLLMSampler.from_pretrained(model_dir, **settings)
    report("tiny_startup", seconds=round(time.perf_counter() - start, 1))
    rows = prompts(tokenizer, 64)
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    hf = HFSampler(model.cuda(), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    expected, out = hf.generate(rows, greedy), sampler.generate(rows, greedy)
    model.cpu()
    report("tiny_greedy_equals_hf", torch.equal(out["response_ids"], expected["response_ids"]))
    for params in [SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=1),
                   SamplingParams(n=4, max_new_tokens=12, temperature=0.7, top_k=5, top_p=0.9, seed=2)]:
        out = sampler.generate(rows, params)
        ids_B_P, mask_B_P = left_pad([r for r in rows for _ in range(params.n)], tokenizer.pad_token_id)
        recomputed = batch_logp(model, out.with_columns(prompt_ids=ids_B_P, prompt_mask=mask_B_P),
                                temperature=params.temperature, micro_batch_tokens=4096)
        diff = float((out["sampler_logp"] - recomputed).abs().max())
        report("tiny_logp_vs_policy", diff < 1e-3, temperature=params.temperature, top_k=params.top_k,
               top_p=params.top_p, max_abs_diff=diff)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seven = tokenizer.convert_tokens_to_ids("7")
    sampler.load_weights(one_token_weights(state, seven))
    forced = sampler.generate(rows, SamplingParams(n=4, max_new_tokens=5, seed=0))
    report("tiny_sync_one_token", bool((forced["response_ids"] == seven).all()))
    sampler.load_weights(state)
    back = sampler.generate(rows, greedy)
    report("tiny_sync_back", torch.equal(back["response_ids"], expected["response_ids"]))
    sampler.close()


def large_checks(model_dir: str, settings: dict) -> None:
    model, tokenizer = rl.models.load(model_dir)
    parameters = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    sampler = VLLMSampler.from_pretrained(model_dir, dtype="bfloat16", sleep_mode=True, **settings)
    report("large_startup", parameters=parameters, seconds=round(time.perf_counter() - start, 1))
    cpu_fp32 = model.state_dict()
    gpu_bf16 = {k: v.to("cuda", torch.bfloat16) for k, v in cpu_fp32.items()}
    for source, state in [("gpu_bf16", gpu_bf16), ("cpu_fp32", cpu_fp32)]:
        seconds = median_seconds(lambda: sampler.load_weights(state))
        report("large_sync_seconds", source=source, median=round(seconds, 3))

    rows = prompts(tokenizer, 64)
    greedy = SamplingParams(max_new_tokens=32, temperature=0)
    before = sampler.generate(rows, greedy)
    awake = gpu_used_gib()
    for level in (1, 2):
        sampler.sleep(level=level)
        asleep = gpu_used_gib()
        sampler.load_weights(gpu_bf16)  # wakes the weights, loads, then the KV cache
        after = sampler.generate(rows, greedy)
        report("large_sleep_wake", torch.equal(after["response_ids"], before["response_ids"]), level=level,
               gpu_used_gib_awake=awake, gpu_used_gib_asleep=asleep, gpu_used_gib_woken=gpu_used_gib())

    del gpu_bf16
    hf = HFSampler(model.to("cuda", torch.bfloat16), eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    for batch in (64, 256):
        params = SamplingParams(n=8, max_new_tokens=64, temperature=1.0, seed=0)
        batch_rows = prompts(tokenizer, batch // 8)
        rates = {name: tokens_per_second(lambda s=s: s.generate(batch_rows, params)["response_mask"].sum(), 3)
                 for name, s in [("hf", hf), ("vllm", sampler)]}
        report("large_tokens_per_s", batch=batch, n=8, max_new_tokens=64, hf=round(rates["hf"]),
               vllm=round(rates["vllm"]))
    sampler.close()


def qwen2_half_b(directory: str) -> str:
    """A random Qwen2 with Qwen2.5-0.5B's shape (and tiny-arith's tokenizer), saved to `directory`."""
    tokenizer = rl.models.build_tokenizer()
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def one_token_weights(state: dict, token: int) -> dict:
    """Weights under which the model always emits `token` (see tests/test_vllm.py)."""
    forced = {k: torch.zeros_like(v) for k, v in state.items()}
    forced["model.norm.weight"] = torch.ones_like(state["model.norm.weight"])
    forced["model.embed_tokens.weight"][:, 0] = 1.0
    forced["model.embed_tokens.weight"][token, 0] = 50.0
    forced["lm_head.weight"] = forced["model.embed_tokens.weight"]
    return forced


def prompts(tokenizer, count: int) -> list[list[int]]:
    examples = rl.tasks.get("arithmetic").test
    return [tokenizer.encode(examples[i % len(examples)]["prompt"], add_special_tokens=False) for i in range(count)]


def gpu_used_gib() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 2)


def median_seconds(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()
