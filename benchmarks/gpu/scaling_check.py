"""GPU check of the paper estimate in benchmarks/README.md ("Estimate on paper: Qwen2.5-0.5B and 7B GRPO on one
H200"): measures the quantities the estimate predicts, for random-weight Qwen2 models of Qwen2.5-0.5B's and
Qwen2.5-7B's shapes built from a config (no download), at the recipes' shapes.

Per model shape, in this order (the sampler is closed before the trainer starts, as a colocated step does):
1. rollout: `rollout_rows` completions of `response_tokens` tokens (random weights: they run to the limit) after
   prompts of `prompt_tokens` tokens; decode tokens/s and GPU memory in use (vLLM at gpu_memory_utilization 0.5 where
   importable, else the HF sampler; vLLM's engine is another process: its memory is read from `mem_get_info`);
2. update: rlbench's `Policy` (fp32 weights, bf16 autocast, fused AdamW), one mini-batch of `update_rows` rows of
   prompt + response tokens, micro-batches of the recipe's `micro_batch_tokens`, with and without activation
   checkpointing: seconds of forward + backward and of the optimizer step, trained tokens/s (prompt and response
   tokens; the same accounting as the paper's 6·N·tokens), the time of a forward without gradient (old_logp, the
   reference), weights-and-AdamW memory after the step (gradients are freed) and the peak
   (`torch.cuda.max_memory_allocated`; the reference model, 2N bytes, is not loaded);
3. the step extrapolated to the recipe's full shape from those rates, beside the paper's numbers (`PAPER`).
The 7B runs at fewer layers (`--layers-7b`, two counts) and every quantity is extrapolated linearly in the layer
count to 28 (`--layers-7b 28` runs the whole model: ~122 GB of weights, gradients and AdamW states alone).

Written on a machine without a GPU: not run yet. On a machine without CUDA it prints one "skipped" line and exits 0.
`--smoke` runs the whole path on the CPU with a 2-layer toy shape (the test suite does). Run (~6 min on an H200,
estimated):

    python benchmarks/gpu/scaling_check.py [--only 0.5b|7b] [--rollout-rows N] [--update-rows N] [--layers-7b 4,8]
    python benchmarks/gpu/scaling_check.py --smoke
"""

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import rlbench as rl
from rlbench.batch import Batch
from rlbench.policy import Policy
from rlbench.policy.training import OptimSettings
from rlbench.samplers import HFSampler, SamplingParams
from rlbench.samplers import vllm as vllm_sampler


@dataclass(frozen=True)
class Shape:
    """A model shape and the recipe shape it runs at."""
    name: str
    config: dict
    prompts_per_step: int
    samples_per_prompt: int
    prompt_tokens: int
    response_tokens: int
    micro_batch_tokens: int
    mini_batches_per_step: int
    rollout_rows: int
    """Completions decoded at once in the measurement (the estimate's concurrency: what vLLM's KV cache holds)."""
    update_rows: int
    """Rows of the measured mini-batch."""
    algorithm: str = "grpo"
    """Its loss (GRPO's has a k3 KL term: the batch carries reference log-probs; DAPO's has none)."""
    layers: tuple[int, ...] = field(default=())
    """Layer counts to measure at (extrapolated to config's num_hidden_layers); empty: the whole model."""


SHAPES = {
    # algorithms/grpo/gsm8k-qwen2.5-0.5b.toml: 1024 prompts x 5, prompts <= 512, responses <= 1024, 4 mini-batches
    "0.5b": Shape("qwen2.5-0.5b", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
                  prompts_per_step=1024, samples_per_prompt=5, prompt_tokens=512, response_tokens=1024,
                  micro_batch_tokens=32768, mini_batches_per_step=4, rollout_rows=2000, update_rows=64),
    # DAPO-like: 512 prompts x 16, prompts ~1k, responses up to 4k, 16 mini-batches (DAPO's 32 prompts each), no KL;
    # micro-batches of one 5k-token row: the most that fits beside 122 GB of training state
    "7b": Shape("qwen2.5-7b", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                   num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
                prompts_per_step=512, samples_per_prompt=16, prompt_tokens=1024, response_tokens=4096,
                micro_batch_tokens=5120, mini_batches_per_step=16, rollout_rows=192, update_rows=8, algorithm="dapo",
                layers=(4, 8)),
}
SMOKE = Shape("smoke", dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
              prompts_per_step=2, samples_per_prompt=2, prompt_tokens=6, response_tokens=5, micro_batch_tokens=24,
              mini_batches_per_step=1, rollout_rows=4, update_rows=4, layers=(1, 2))
PAPER = {  # benchmarks/README.md, "Estimate on paper": MFU 40%, decode at 25% (0.5B) / 50% (7B) of the HBM roofline
    "qwen2.5-0.5b": {"weights_and_adam_gb": 5.9, "peak_update_gb_plain": 100, "peak_update_gb_checkpointed": 55,
                     "decode_tokens_per_s": 93_000, "train_tokens_per_s_plain": 125_000,
                     "train_tokens_per_s_checkpointed": 94_000, "step_s_worst_case": 182},
    "qwen2.5-7b": {"weights_and_adam_gb": 91.4, "peak_update_gb_checkpointed": 133, "decode_tokens_per_s": 9_500,
                   "train_tokens_per_s_plain": 8_700, "train_tokens_per_s_checkpointed": 6_500,
                   "step_s_worst_case": 11_600},
}


def show(check: str, **values) -> None:
    print(json.dumps({"check": check, **values}), flush=True)


def gb(n_bytes: float) -> float:
    return round(n_bytes / 1e9, 2)


def build(shape: Shape, layers: int, directory: str, device: str) -> int:
    """A random Qwen2 of the shape with `layers` layers (and tiny-arith's tokenizer, ids only matter), saved to
    `directory`; returns its parameter count."""
    tokenizer = rl.models.build_tokenizer()
    config = Qwen2Config(**shape.config | {"num_hidden_layers": layers}, max_position_embeddings=32768,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it will run: a 7B initialises in seconds on a GPU
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def random_prompts(rows: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, 200, (rows, length), generator=generator).tolist()  # ids the toy tokenizer knows


def rollout(model_dir: str, shape: Shape, device: str, sampler_name: str) -> dict:
    """Decode tokens/s at `shape.rollout_rows` concurrent completions of the shape's lengths (a warm-up call first)."""
    if sampler_name == "vllm":
        sampler = vllm_sampler.VLLMSampler.from_pretrained(model_dir, dtype="bfloat16", gpu_memory_utilization=0.5,
                                                           max_model_len=shape.prompt_tokens + shape.response_tokens)
    else:
        sampler = HFSampler.from_pretrained(model_dir, device=device, precision="bf16" if device == "cuda" else "fp32")
    n = shape.samples_per_prompt
    prompts = random_prompts(max(shape.rollout_rows // n, 1), shape.prompt_tokens)
    sampler.generate(prompts[:1], SamplingParams(n=n, max_new_tokens=8, seed=1))
    start = time.perf_counter()
    out = sampler.generate(prompts, SamplingParams(n=n, max_new_tokens=shape.response_tokens, seed=0))
    seconds = time.perf_counter() - start
    in_use = torch.cuda.mem_get_info() if device == "cuda" else None
    tokens = int(out["response_mask"].sum())
    if hasattr(sampler, "close"):
        sampler.close()
    del sampler
    return {"sampler": sampler_name, "rows": len(out), "response_tokens_mean": round(tokens / len(out), 1),
            "seconds": round(seconds, 3), "decode_tokens_per_s": round(tokens / seconds),
            "gpu_in_use_gb": gb(in_use[1] - in_use[0]) if in_use else None}


def synthetic_batch(shape: Shape, rows: int) -> Batch:
    """A mini-batch of full-length rows with random tokens and advantages, as `Session.advantage` hands the update."""
    generator = torch.Generator().manual_seed(0)
    P, R = shape.prompt_tokens, shape.response_tokens
    response_ids_B_R = torch.randint(2, 200, (rows, R), generator=generator)
    advantages_B = torch.randn(rows, generator=generator)
    return Batch({"prompt_ids": torch.tensor(random_prompts(rows, P, seed=1)),
                  "prompt_mask": torch.ones(rows, P, dtype=torch.long), "response_ids": response_ids_B_R,
                  "response_mask": torch.ones(rows, R, dtype=torch.long),
                  "sampler_logp": torch.full((rows, R), -12.0), "ref_logp": torch.full((rows, R), -12.0),
                  "group_ids": torch.arange(rows) // shape.samples_per_prompt,
                  "advantages": advantages_B[:, None].expand(rows, R).contiguous()})


def update(model_dir: str, shape: Shape, device: str, checkpointing: bool) -> dict:
    """One warm-up then one measured mini-batch through rlbench's Policy: a forward without gradient (what the
    old_logp and reference log-probs cost each), forward + backward with the recipe's loss (GRPO, k3 KL), AdamW."""
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    policy = Policy(model_dir, OptimSettings(lr=1e-6), device=device, precision="bf16" if device == "cuda" else "fp32",
                    micro_batch_tokens=shape.micro_batch_tokens, activation_checkpointing=checkpointing)
    algorithm = rl.algorithms.get(shape.algorithm)
    rows = shape.update_rows
    batch = synthetic_batch(shape, rows)
    counts = dict(num_tokens=int(batch["response_mask"].sum()), num_seqs=rows, norm_length=shape.response_tokens)
    for _ in range(2):  # the first allocates the optimizer's states and warms the kernels
        sync(device)
        before = time.perf_counter()
        policy.log_probs(batch)
        sync(device)
        start = time.perf_counter()
        policy.forward_backward(batch, algorithm, **counts)
        sync(device)
        middle = time.perf_counter()
        policy.optim_step()
        sync(device)
        end = time.perf_counter()
    tokens = rows * (shape.prompt_tokens + shape.response_tokens)
    state = torch.cuda.memory_allocated() if device == "cuda" else None  # weights, AdamW states (grads are freed)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    del policy
    return {"activation_checkpointing": checkpointing, "rows": rows, "tokens": tokens,
            "forward_s": round(start - before, 3), "forward_backward_s": round(middle - start, 3),
            "optim_step_s": round(end - middle, 3),
            "train_tokens_per_s": round(tokens / (middle - start)),
            "weights_and_adam_gb": gb(state) if state is not None else None, "peak_gb": gb(peak) if peak else None}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(shape: Shape, layers: int, args, device: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = {"layers": layers, "parameters": build(shape, layers, tmp, device),
                  "rollout": rollout(tmp, shape, device, args.sampler)}
        for checkpointing in (False, True):
            try:
                result[f"update_checkpointing_{checkpointing}"] = update(tmp, shape, device, checkpointing)
            except torch.OutOfMemoryError as error:
                result[f"update_checkpointing_{checkpointing}"] = {"out_of_memory": str(error).splitlines()[0]}
    show("measured", shape=shape.name, **result)
    return result


def extrapolate(shape: Shape, results: list[dict]) -> dict:
    """Seconds and GB at the model's full layer count, linear in the layers through the two measured counts (a
    layer's weights, states, activations and time are the same for each layer); the rates then follow from them."""
    if len(results) == 1:
        return results[0]
    a, b = results[:2]
    fraction = (shape.config["num_hidden_layers"] - a["layers"]) / (b["layers"] - a["layers"])

    def walk(x, y):
        if isinstance(x, dict):
            return {k: walk(x[k], y[k]) for k in x if k in y}
        if isinstance(x, bool) or not (isinstance(x, (int, float)) and isinstance(y, (int, float))):
            return x
        return round(x + (y - x) * fraction, 3)

    full = walk(a, b) | {"layers": shape.config["num_hidden_layers"],
                         "extrapolated_from_layers": [a["layers"], b["layers"]]}
    rollout = full["rollout"]
    rollout["decode_tokens_per_s"] = round(rollout["rows"] * rollout["response_tokens_mean"] / rollout["seconds"])
    for key in ("update_checkpointing_False", "update_checkpointing_True"):
        if "tokens" in full[key]:
            full[key]["train_tokens_per_s"] = round(full[key]["tokens"] / full[key]["forward_backward_s"])
    return full


def step_seconds(shape: Shape, at_full: dict) -> dict:
    """The recipe's whole step from the measured rates, every response at its token limit (the worst case): the
    rollout, forwards without gradient (old_logp; the reference's where the algorithm has one), forward + backward,
    an AdamW step per mini-batch."""
    rows = shape.prompts_per_step * shape.samples_per_prompt
    rollout_s = rows * shape.response_tokens / at_full["rollout"]["decode_tokens_per_s"]
    measured = at_full["update_checkpointing_True"]
    if "tokens" not in measured:
        return {"rollout_s": round(rollout_s), "update_s": None}
    scale = rows * (shape.prompt_tokens + shape.response_tokens) / measured["tokens"]  # the step's tokens / measured
    forwards = 2 if rl.algorithms.get(shape.algorithm).needs_reference else 1
    update_s = (scale * (forwards * measured["forward_s"] + measured["forward_backward_s"])
                + shape.mini_batches_per_step * measured["optim_step_s"])
    return {"rollout_s": round(rollout_s), "update_s": round(update_s), "step_s": round(rollout_s + update_s)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SHAPES), help="one model shape (default: both)")
    parser.add_argument("--rollout-rows", type=int, help="completions decoded at once (default: the shape's)")
    parser.add_argument("--update-rows", type=int, help="rows of the measured mini-batch (default: the shape's)")
    parser.add_argument("--layers-7b", default="4,8", help="layer counts of the 7B (two, extrapolated; or 28)")
    parser.add_argument("--sampler", choices=["auto", "vllm", "hf"], default="auto")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer toy shape on the CPU, one tiny step")
    args = parser.parse_args()
    if args.smoke:
        device, shapes, args.sampler = "cpu", [SMOKE], "hf"
    elif not torch.cuda.is_available():
        show("scaling", skipped="this check needs a CUDA GPU (run --smoke for the CPU toy)")
        return
    else:
        device = "cuda"
        shapes = [SHAPES[args.only]] if args.only else list(SHAPES.values())
        shapes = [s if s.name != "qwen2.5-7b" else replace(s, layers=tuple(int(x) for x in args.layers_7b.split(",")))
                  for s in shapes]
        show("device", name=torch.cuda.get_device_name(), torch=torch.__version__)
    shapes = [replace(s, rollout_rows=args.rollout_rows or s.rollout_rows,
                      update_rows=args.update_rows or s.update_rows) for s in shapes]
    if args.sampler == "auto":
        args.sampler = "vllm" if vllm_sampler.available()[0] else "hf"
    if device == "cpu":
        torch.set_num_threads(1)
    for shape in shapes:
        layer_counts = shape.layers or (shape.config["num_hidden_layers"],)
        results = [measure(shape, layers, args, device) for layers in layer_counts]
        at_full = extrapolate(shape, results)
        show("estimate_vs_measured", shape=shape.name, measured=at_full, step=step_seconds(shape, at_full),
             paper=PAPER.get(shape.name))


if __name__ == "__main__":
    main()
