"""The GPU check for a bare box: one script, about 8 minutes on one H200, with only torch, transformers, accelerate and
peft there (no Ray, no vLLM, no hub). It writes one JSON file of results and runs, in order of value, each check
guarded (a failure is recorded with its traceback and the next check goes on), the file rewritten after each:

1. `grpo`: the inline Session on CUDA with a Qwen2.5-0.5B-shaped model (random weights from its config, its 151,936-id
   vocabulary; the tiny tokenizer, so sampled ids past its 259 decode to nothing and every response runs to the
   limit), bf16 autocast over fp32 weights and AdamW (`precision="bf16"`), the HF sampler, GSM8K's shipped sample at
   the GSM8K recipe's shape (5 samples, 512 prompt / 1024 response tokens, 4 mini-batches, 32k-token micro-batches;
   `--prompts` per step, not the recipe's 1024): seconds per stage of each step, peak GPU memory, sampler tokens/s,
   trainer tokens/s (the batch's tokens over the update stage, which also runs the old-policy and reference forwards);
2. `mismatch`: the same steps' sampler vs trainer log-prob mismatch in bf16 (what rollout correction exists for);
3. `update`: one update of the 0.5B shape on a 32k-token micro-batch, forward + backward tokens/s and MFU
   (6·N·tokens plus attention's 6·layers·hidden·context per token, against the H200's 989 TFLOP/s dense bf16);
4. `fsdp`: FSDP2 over a one-GPU NCCL mesh (world size 1 on the code path of N GPUs) against the unsharded inline
   policy, the same update: loss, gradient norm, the gradients and the AdamW update (relative L2 differences),
   equal within bf16 noise;
5. `memory`: peak memory of one update at 2048 and 4096 tokens per row, activation checkpointing and chunked
   log-probs (`logit_chunk_tokens`) each on and off;
6. `lora`: LoRA rank 32 against full fine-tuning: memory of the training state (weights, adapter, AdamW) and step time;
7. `quickstart`: the tiny-arith quickstart's run on CUDA and on the CPU, held-out greedy accuracy before and after.

`--dry-run` runs every check at toy size on the CPU (the test suite does), so the script is known to work before a
GPU is there. Run:

    python benchmarks/gpu/check.py --out benchmarks/results/gpu/check.json
    python benchmarks/gpu/check.py --dry-run --out /tmp/check.json
"""

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

import rlbench as rl
from rlbench.batch import Batch, left_pad
from rlbench.policy import Policy
from rlbench.policy.training import Optimizer, OptimSettings, shard

REPO = Path(__file__).resolve().parents[2]
H200_BF16_FLOPS = 989e12
"""Dense bf16 tensor-core peak of an H200 SXM (NVIDIA's datasheet), the denominator of MFU."""


@dataclass(frozen=True)
class Shape:
    config: dict
    prompts: int
    samples: int
    prompt_tokens: int
    response_tokens: int
    micro_batch_tokens: int
    mini_batches: int
    steps: int
    grpo_seconds: float
    """No GRPO step starts after this many seconds of the grpo check (the slot is short)."""
    memory_lengths: tuple[int, ...]
    memory_micro_tokens: int
    lora_rank: int
    quickstart_steps: int


QWEN_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6,
                 max_position_embeddings=32768)
GPU = Shape(QWEN_0_5B, prompts=32, samples=5, prompt_tokens=512, response_tokens=1024, micro_batch_tokens=32768,
            mini_batches=4, steps=3, grpo_seconds=150, memory_lengths=(2048, 4096), memory_micro_tokens=16384, lora_rank=32,
            quickstart_steps=60)
DRY = Shape(QWEN_0_5B | dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2),
            prompts=2, samples=2, prompt_tokens=512, response_tokens=8, micro_batch_tokens=1024, mini_batches=2,
            steps=2, grpo_seconds=60, memory_lengths=(96, 128), memory_micro_tokens=256, lora_rank=4, quickstart_steps=2)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--out", default=str(REPO / "benchmarks/results/gpu/check.json"))
    options.add_argument("--dry-run", action="store_true", help="every check at toy size on the CPU")
    options.add_argument("--prompts", type=int, help="prompts per GRPO step (default: 32; dry run 2)")
    options.add_argument("--only", nargs="*", help="run only these checks")
    args = options.parse_args()
    shape = DRY if args.dry_run else GPU
    if args.prompts:
        shape = replace(shape, prompts=args.prompts)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run on a machine without a GPU")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"environment": environment(device), "dry_run": args.dry_run, "shape": shape.__dict__, "checks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(shape, f"{tmp}/model", device)
        results["model"] = {"parameters": parameters(model_dir), "dir": "random Qwen2 weights, the tiny tokenizer"}
        context = dict(shape=shape, device=device, model_dir=model_dir, tmp=tmp, results=results)
        for name, check in CHECKS.items():
            if args.only and name not in args.only:
                continue
            print(f"== {name}", flush=True)
            free_memory(device)
            start = time.perf_counter()
            try:
                results["checks"][name] = {"ok": True, **check(**context)}
            except Exception as error:  # recorded, and the next check goes on
                results["checks"][name] = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000],
                                           "traceback": traceback.format_exc()[-4000:]}
            results["checks"][name]["seconds"] = round(time.perf_counter() - start, 1)
            print(json.dumps({name: results["checks"][name]})[:3000], flush=True)  # the tail shows the traceback
            out.write_text(json.dumps(results, indent=1) + "\n")
    failed = [name for name, result in results["checks"].items() if not result["ok"]]
    print(f"wrote {out}; failed: {failed or 'none'}")
    sys.exit(1 if failed else 0)


def environment(device: str) -> dict:
    found = {}
    for name in ("ray", "vllm", "peft", "accelerate"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "packages": found, "device": device}
    if device == "cuda":
        info |= {"gpu": torch.cuda.get_device_name(), "gpu_memory_gib": round(
            torch.cuda.get_device_properties(0).total_memory / 2**30, 1), "cuda": torch.version.cuda}
    return info


def build_model(shape: Shape, directory: str, device: str) -> str:
    """A random Qwen2 of the shape, saved with the tiny tokenizer (ids past its vocabulary decode to nothing)."""
    tokenizer = rl.models.build_tokenizer()
    config = Qwen2Config(**shape.config, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def parameters(model_dir: str) -> int:
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def free_memory(device: str) -> None:
    import gc
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def gib(n_bytes: float) -> float:
    return round(n_bytes / 2**30, 2)


def peak(device: str) -> float | None:
    return gib(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def gsm8k_task(tmp: str):
    """GSM8K's shipped sample (32 problems) as train and test set, converted as the GSM8K recipe's data is."""
    sample = REPO / "datasets/samples/gsm8k.jsonl"
    subprocess.run([sys.executable, str(REPO / "datasets/prepare_gsm8k.py"), "--train", str(sample), "--test",
                    str(sample), "--out", f"{tmp}/gsm8k"], check=True, capture_output=True)
    return rl.tasks.from_parquet(f"{tmp}/gsm8k/train.parquet", test=f"{tmp}/gsm8k/test.parquet",
                                 duplicates="keep")  # (one sample as both sets, on purpose)


MISMATCH = ("sampler_mismatch_mean", "sampler_mismatch_max", "sampler_kl", "sampler_kl_k3", "sampler_ratio_min",
            "sampler_ratio_max")
"""The sampler-vs-trainer metrics of each GRPO step, which the mismatch check reports."""


def check_grpo(shape: Shape, device: str, model_dir: str, tmp: str, **_) -> dict:
    settings = dict(model=model_dir, task=gsm8k_task(tmp), algorithm="grpo", sampler="hf", cluster="inline",
                    device=device, precision="bf16", prompts_per_step=shape.prompts, samples_per_prompt=shape.samples,
                    max_new_tokens=shape.response_tokens, max_prompt_tokens=shape.prompt_tokens, long_prompts="drop",
                    lr=1e-6, mini_batches_per_step=shape.mini_batches, micro_batch_tokens=shape.micro_batch_tokens,
                    log_dir=None, seed=0)
    steps, start = [], time.perf_counter()
    with rl.Session(**settings) as session:
        while len(steps) < shape.steps and (not steps or time.perf_counter() - start < shape.grpo_seconds):
            row = session.step()
            batch = session.last_batch
            response = int(batch["response_mask"].sum())
            trained = response + int(batch["prompt_mask"].sum())
            steps.append({"seconds": {k.removeprefix("time_"): round(v, 2) for k, v in row.items()
                                      if k.startswith("time_")},
                          "rows": len(batch), "response_tokens": response, "trained_tokens": trained,
                          "sampler_tokens_per_s": round(response / row["time_rollout"]),
                          "trainer_tokens_per_s": round(trained / row["time_update"]),
                          "response_length": row["response_length"], "loss": row["loss"],
                          "grad_norm": row["grad_norm"], "entropy": row["entropy"],
                          "sampler": {k: row[k] for k in MISMATCH}})
    return {"settings": {k: v for k, v in settings.items() if k not in ("model", "task")}, "steps": steps,
            "peak_gib": peak(device), "note": "step 1 includes warm-up; the update stage also runs the old-policy "
                                             "and reference forwards"}


def check_mismatch(results: dict, **_) -> dict:
    steps = results["checks"].get("grpo", {}).get("steps")
    if not steps:
        raise RuntimeError("the grpo check ran no step")
    return {"per_step": [step["sampler"] for step in steps],
            "note": "HF sampler with bf16 weights vs the trainer's bf16 autocast over fp32 weights"}


def random_batch(rows: int, prompt_tokens: int, response_tokens: int, vocab: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, min(vocab, 250), (rows, prompt_tokens), generator=g).tolist()
    prompt_ids, prompt_mask = left_pad(prompts, 0)
    response_ids = torch.randint(3, vocab, (rows, response_tokens), generator=g)
    response_mask = torch.ones_like(response_ids)
    advantages = torch.randn(rows, 1, generator=g).expand(rows, response_tokens).contiguous()
    return Batch(dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                      response_mask=response_mask, advantages=advantages))


GRPO_NO_KL = rl.algorithms.get("grpo").replace(kl_coef=0.0)


def update(policy: Policy, batch: Batch, device: str) -> tuple[dict, float]:
    """One optimizer step on `batch` (`with_old_logp`): the loss terms and step metrics, and the seconds of forward +
    backward + step."""
    batch, counts = with_old_logp(policy, batch)
    sync(device)
    start = time.perf_counter()
    terms, step = policy.train_step(batch, GRPO_NO_KL, **counts)
    sync(device)
    return terms | step, time.perf_counter() - start


def with_old_logp(policy: Policy, batch: Batch) -> tuple[Batch, dict]:
    """The batch with old log-probs (the policy's own, shifted so that ratios differ from 1), and its loss counts."""
    with torch.no_grad():
        batch = batch.with_columns(old_logp=policy.log_probs(batch) + 0.01)
    return batch, dict(num_tokens=int(batch["response_mask"].sum()), num_seqs=len(batch),
                       norm_length=batch["response_ids"].shape[1])


def new_policy(model_dir: str, shape: Shape, device: str, **kwargs) -> Policy:
    return Policy(model_dir, OptimSettings(lr=1e-5), device=device, precision="bf16",
                  micro_batch_tokens=kwargs.pop("micro_batch_tokens", shape.micro_batch_tokens), **kwargs)


def flops_per_token(config: dict, n_params: int, context: int) -> float:
    """Training FLOPs per token: 6·N for the weights plus 6·layers·hidden·context for causal attention's scores and
    weighted sums (2·2·hidden·context/2 per layer forward, times 3 with the backward)."""
    return 6 * n_params + 6 * config["num_hidden_layers"] * config["hidden_size"] * context


def check_update(shape: Shape, device: str, model_dir: str, results: dict, **_) -> dict:
    length = shape.prompt_tokens + shape.response_tokens
    rows = max(shape.micro_batch_tokens // length, 1)
    batch = random_batch(rows, shape.prompt_tokens, shape.response_tokens, shape.config["vocab_size"])
    policy = new_policy(model_dir, shape, device)
    update(policy, batch, device)  # warm-up
    times = [update(policy, batch, device)[1] for _ in range(3)]
    seconds = sorted(times)[1]
    tokens = rows * length
    flops = flops_per_token(shape.config, results["model"]["parameters"], length / 2) * tokens
    return {"rows": rows, "tokens": tokens, "seconds_median_of_3": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds), "mfu": round(flops / seconds / H200_BF16_FLOPS, 3),
            "peak_gib": peak(device), "logit_chunk_tokens": policy.chunk_tokens,
            "note": "the seconds include the optimizer step; MFU against 989 TFLOP/s dense bf16"}


def check_fsdp(shape: Shape, device: str, model_dir: str, **_) -> dict:
    """Gradients and the AdamW update compared as relative L2 norms over all weights: AdamW's first step moves each
    weight by about ±lr whatever its gradient's size, so a gradient that is rounding noise around 0 (a key bias's,
    exactly 0 in exact arithmetic: softmax ignores a shift shared by all keys) takes either sign in either run, and
    a per-weight comparison would report those as 100% differences."""
    import torch.distributed as dist
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    batch = random_batch(4, 64, shape.response_tokens * 4, shape.config["vocab_size"], seed=1)
    inline = new_policy(model_dir, shape, device)
    sharded = new_policy(model_dir, shape, device)
    sharded.model = shard(sharded.model, 1, device, even_alone=True)
    sharded.optimizer = Optimizer(sharded.model, OptimSettings(lr=1e-5))
    runs = {}
    for name, policy in (("inline", inline), ("fsdp", sharded)):
        micro, counts = with_old_logp(policy, batch)
        before = whole_weights(policy)
        policy.optimizer.zero_grad()
        terms = policy.forward_backward(micro, GRPO_NO_KL, **counts)
        grads = {n: whole(p.grad) for n, p in policy.model.named_parameters()}
        step = policy.optim_step()
        runs[name] = dict(terms=terms | step, grads=grads,
                          updates={n: w - before[n] for n, w in whole_weights(policy).items()})
    a, b = runs["inline"], runs["fsdp"]
    return {"inline": {k: a["terms"][k] for k in ("loss", "grad_norm")},
            "fsdp": {k: b["terms"][k] for k in ("loss", "grad_norm")},
            "gradient_relative_difference": relative_l2(b["grads"], a["grads"]),
            "update_relative_difference": relative_l2(b["updates"], a["updates"]),
            "dtensor": type(next(sharded.model.parameters())).__name__, "backend": dist.get_backend()}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float()


def whole_weights(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: whole(p).clone() for n, p in policy.model.named_parameters()}


def relative_l2(got: dict, expected: dict) -> float:
    """||got - expected|| / ||expected|| over all the tensors together."""
    difference = sum(float((got[n] - e).pow(2).sum()) for n, e in expected.items())
    return (difference / sum(float(e.pow(2).sum()) for e in expected.values())) ** 0.5


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_memory(shape: Shape, device: str, model_dir: str, **_) -> dict:
    runs = []
    for checkpointing in (False, True):
        policy = new_policy(model_dir, shape, device, activation_checkpointing=checkpointing,
                            micro_batch_tokens=shape.memory_micro_tokens, logit_chunk_tokens=0)
        for length in shape.memory_lengths:
            batch = random_batch(max(shape.memory_micro_tokens // length, 1), 64, length - 64,
                                 shape.config["vocab_size"], seed=2)
            for chunk in (0, 4096 if device == "cuda" else 16):
                policy.chunk_tokens = chunk
                free_memory(device)
                try:
                    _, seconds = update(policy, batch, device)
                    runs.append({"tokens_per_row": length, "rows": len(batch), "activation_checkpointing": checkpointing,
                                 "logit_chunk_tokens": chunk, "peak_gib": peak(device), "seconds": round(seconds, 3)})
                except torch.OutOfMemoryError:
                    runs.append({"tokens_per_row": length, "rows": len(batch), "activation_checkpointing": checkpointing,
                                 "logit_chunk_tokens": chunk, "peak_gib": "out of memory"})
        del policy
    return {"runs": runs, "micro_batch_tokens": shape.memory_micro_tokens,
            "note": "peak allocated over one old-logp forward and one update (forward, backward, AdamW step)"}


def check_lora(shape: Shape, device: str, model_dir: str, **_) -> dict:
    batch = random_batch(max(shape.micro_batch_tokens // 2048, 1), 512, 1536 if device == "cuda" else 16,
                         shape.config["vocab_size"], seed=3)
    out = {}
    for name, lora in (("full", None), (f"lora_rank_{shape.lora_rank}",
                                        rl.LoRA(rank=shape.lora_rank, alpha=2 * shape.lora_rank))):
        free_memory(device)
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        policy = new_policy(model_dir, shape, device, lora=lora)
        update(policy, batch, device)  # warm-up; creates the AdamW state
        times = [update(policy, batch, device)[1] for _ in range(3)]
        policy.optimizer.zero_grad()
        state = torch.cuda.memory_allocated() - before if device == "cuda" else None
        trained = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
        out[name] = {"trained_parameters": trained, "state_gib": None if state is None else gib(state),
                     "step_seconds_median_of_3": round(sorted(times)[1], 3), "peak_gib": peak(device)}
        del policy
    return out | {"rows": len(batch), "note": "state: weights, adapter, AdamW moments, after the gradients are freed"}


def check_quickstart(shape: Shape, device: str, **_) -> dict:
    from rlbench.quickstart import SETTINGS
    out = {}
    for where in dict.fromkeys((device, "cpu")):
        with rl.Session(**SETTINGS, device=where, seed=0, log_dir=None) as session:
            before = session.evaluate()["greedy_accuracy"]
            start = time.perf_counter()
            session.run(shape.quickstart_steps, progress=False)
            seconds = time.perf_counter() - start
            out[where] = {"greedy_accuracy_before": before, "greedy_accuracy_after": session.evaluate()["greedy_accuracy"],
                          "seconds_per_step": round(seconds / shape.quickstart_steps, 3)}
    return out | {"steps": shape.quickstart_steps}


CHECKS = {"grpo": check_grpo, "mismatch": check_mismatch, "update": check_update, "fsdp": check_fsdp,
          "memory": check_memory, "lora": check_lora, "quickstart": check_quickstart}


if __name__ == "__main__":
    main()
