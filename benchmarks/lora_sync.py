"""Weight sync under LoRA: the adapter alone vs every weight, into each sampler.

For each model (tiny-arith, 1.1M parameters, and a random ~20M-parameter Qwen2 built here, offline) and sampler, one
JSON line per way of syncing: the bytes a sync hands the sampler and the median wall time of `load_weights` over
repeats (the adapter: a trained-looking one, lora_B random; rank 16, all linear layers, as `rl.LoRA()`).
- vllm / full: every weight into a plain engine (`WeightLoader.rlbench_load_weights`).
- vllm / adapter: the adapter into a LoRA engine: written as a peft folder (`write_ms`, part of `ms`), loaded by
  vLLM under a fresh id, the previous one removed.
- hf / full: every weight copied into the HF sampler's model (the baseline of a sync without LoRA), then the
  decoder's re-read of its fused weights that the next generation starts with.
- hf / adapter: the adapter into the HF sampler, then that re-read, which merges s · B A into the fused weights
  (the base is not copied).
Run: python benchmarks/lora_sync.py [--threads 1] [--repeats 5] [--rank 16]
"""

import argparse
import copy
import json
import statistics
import tempfile
import time

import torch

import rlbench as rl
from rlbench.samplers import HFSampler, VLLMSampler
from timing import random_qwen2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lora = rl.LoRA(rank=args.rank, alpha=2.0 * args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_dir in [("tiny-arith", str(rl.models.resolve("tiny-arith"))),
                                ("random-qwen2-20m", random_qwen2(tmp, hidden=512, layers=5, intermediate=2048))]:
            model, tokenizer = rl.models.load(model_dir)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            adapter = trained_adapter(model, lora)
            common = dict(bench="lora_sync", model=name, parameters=sum(p.numel() for p in model.parameters()),
                          rank=lora.rank, threads=args.threads)
            rows = [vllm_full_row(model_dir, state, args.repeats),
                    vllm_adapter_row(model_dir, adapter, lora, args.repeats),
                    hf_full_row(model, tokenizer, state, args.repeats),
                    hf_adapter_row(model, tokenizer, adapter, lora, args.repeats)]
            for row in rows:
                print(json.dumps(common | row), flush=True)


def trained_adapter(model, lora: rl.LoRA) -> dict[str, torch.Tensor]:
    """The adapter of a peft copy of `model` with lora_B drawn at random (B = 0 would be a fresh one)."""
    peft_model = rl.models.lora.wrap(copy.deepcopy(model), lora)
    generator = torch.Generator().manual_seed(0)
    adapter = {k: v.clone() for k, v in rl.models.lora.adapter_state(peft_model).items()}
    for name, tensor in adapter.items():
        if "lora_B" in name:
            tensor.copy_(0.01 * torch.randn(tensor.shape, generator=generator))
    return adapter


def median_ms(load, repeats: int) -> float:
    load()  # warm-up: the first load of a kind pays one-time costs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        load()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 2)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def vllm_full_row(model_dir: str, state: dict, repeats: int) -> dict:
    sampler = VLLMSampler.from_pretrained(model_dir)
    try:
        ms = median_ms(lambda: sampler.load_weights(state), repeats)
    finally:
        sampler.close()
    return dict(sampler="vllm", sync="full", bytes=nbytes(state), ms=ms)


def vllm_adapter_row(model_dir: str, adapter: dict, lora: rl.LoRA, repeats: int) -> dict:
    sampler = VLLMSampler.from_pretrained(model_dir, lora=lora)
    try:
        ms = median_ms(lambda: sampler.load_weights(adapter), repeats)
    finally:
        sampler.close()
    with tempfile.TemporaryDirectory() as folder:  # a new folder per write, as the sampler's
        versions = iter(range(repeats + 1))
        write_ms = median_ms(lambda: rl.models.lora.save_adapter(f"{folder}/v{next(versions)}", adapter, lora, model_dir),
                             repeats)
    return dict(sampler="vllm", sync="adapter", bytes=nbytes(adapter), ms=ms, write_ms=write_ms)


def hf_full_row(model, tokenizer, state: dict, repeats: int) -> dict:
    return dict(sampler="hf", sync="full", bytes=nbytes(state), ms=hf_sync_ms(model, tokenizer, state, None, repeats))


def hf_adapter_row(model, tokenizer, adapter: dict, lora: rl.LoRA, repeats: int) -> dict:
    return dict(sampler="hf", sync="adapter", bytes=nbytes(adapter),
                ms=hf_sync_ms(model, tokenizer, adapter, lora, repeats))


def hf_sync_ms(model, tokenizer, weights: dict, lora: rl.LoRA | None, repeats: int) -> float:
    """`load_weights` and the decoder's re-read of its fused weights that the next generation starts with (under LoRA
    where the adapter is merged into them): what a sync costs before sampling goes on."""
    sampler = HFSampler(copy.deepcopy(model), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        lora=lora)

    def sync():
        sampler.load_weights(weights)
        sampler.decoder._read_weights()

    return median_ms(sync, repeats)


if __name__ == "__main__":
    main()
