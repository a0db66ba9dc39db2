"""The policy's memory and time model (docs/scale.md), and its check against measured peaks.

`--table` prints, for Qwen2.5-0.5B/7B/32B, Llama-3.1-70B and DeepSeek-V3 (671B, a mixture of experts), what one
training rank holds under each layout rlbench has (FSDP2 full sharding over N ranks, tensor parallel inside it, LoRA,
bf16 autocast, activation checkpointing), the KV cache per sampled token, and the FLOPs of a step per token: the
markdown table of docs/scale.md. `--check` measures the peak resident memory of a training step (forward, backward,
AdamW; the second one, so that AdamW's moments exist) of random Qwen2 models at three sizes on one rank, and at the
two larger on two ranks (FSDP2; tensor parallel), each rank a fresh process, against `memory` (JSON lines; the last
one the error summary), saved to benchmarks/results/memory.jsonl.

Run: .venv/bin/python benchmarks/memory.py --table
     .venv/bin/python benchmarks/memory.py --check [--out benchmarks/results/memory.jsonl]   (~8 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 2**30


@dataclass(frozen=True)
class Shape:
    """A decoder's shape, as its Hugging Face config gives it. A mixture of experts has `experts` routed experts of
    width `moe_intermediate` (`active` per token) and a shared expert of width `shared_intermediate` in every layer
    but the first `dense_layers` (dense MLPs of width `intermediate`). `kv_rank` > 0: multi-head latent attention
    (DeepSeek), queries through a rank-`q_rank` bottleneck, keys and values through `kv_rank` (+ `rope_dim` shared
    rotary dims), heads of `head_dim` (+ `rope_dim` for queries and keys)."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0
    tied: bool = False
    experts: int = 0
    active: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0
    q_rank: int = 0
    kv_rank: int = 0
    rope_dim: int = 0
    qkv_bias: bool = False

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


PUBLISHED = {  # from each model's config.json
    "Qwen2.5-0.5B": Shape(hidden=896, layers=24, intermediate=4864, heads=14, kv_heads=2, vocab=151936, tied=True,
                          qkv_bias=True),
    "Qwen2.5-7B": Shape(hidden=3584, layers=28, intermediate=18944, heads=28, kv_heads=4, vocab=152064, qkv_bias=True),
    "Qwen2.5-32B": Shape(hidden=5120, layers=64, intermediate=27648, heads=40, kv_heads=8, vocab=152064,
                         qkv_bias=True),
    "Llama-3.1-70B": Shape(hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8, vocab=128256),
    "DeepSeek-V3 (671B MoE)": Shape(hidden=7168, layers=61, intermediate=18432, heads=128, kv_heads=128, vocab=129280,
                                    head_dim=128, experts=256, active=8, moe_intermediate=2048,
                                    shared_intermediate=2048, dense_layers=3, q_rank=1536, kv_rank=512, rope_dim=64),
}


def attention_parameters(s: Shape) -> int:
    """One layer's attention weights and its two RMSNorms."""
    norms = 2 * s.hidden
    if s.kv_rank:  # latent attention: q down/up, kv down (+ rotary key), kv up, output, and the two latents' norms
        q = s.hidden * s.q_rank + s.q_rank * s.heads * (s.dim + s.rope_dim)
        kv = s.hidden * (s.kv_rank + s.rope_dim) + s.kv_rank * s.heads * 2 * s.dim
        return q + kv + s.heads * s.dim * s.hidden + norms + s.q_rank + s.kv_rank
    bias = s.dim * (s.heads + 2 * s.kv_heads) if s.qkv_bias else 0
    return s.hidden * s.dim * (2 * s.heads + 2 * s.kv_heads) + bias + norms


def mlp_parameters(s: Shape, *, active: bool) -> int:
    """All MLP weights, or those one token uses (`active`)."""
    dense = 3 * s.hidden * s.intermediate
    if not s.experts:
        return s.layers * dense
    experts = s.active if active else s.experts
    moe = 3 * s.hidden * (experts * s.moe_intermediate + s.shared_intermediate) + s.hidden * s.experts  # + router
    return s.dense_layers * dense + (s.layers - s.dense_layers) * moe


def split_parameters(s: Shape) -> int:
    """The parameters tensor parallel splits (rlbench's plan: every layer's q, k, v, o, gate, up and down projections,
    a dense model's); the embeddings and norms stay whole on each rank of a tensor-parallel group."""
    if s.experts or s.kv_rank:
        raise ValueError("tensor parallel splits dense Qwen2 / Llama-family blocks only")
    return s.layers * (attention_parameters(s) - 2 * s.hidden) + mlp_parameters(s, active=False)


def splits(s: Shape, tensor_parallel: int) -> bool:
    """Whether rlbench's tensor parallel splits `s` this many ways (heads, KV heads and MLP width divisible)."""
    dense = not (s.experts or s.kv_rank)
    return dense and all(n % tensor_parallel == 0 for n in (s.heads, s.kv_heads, s.intermediate))


def parameters(s: Shape, *, active: bool = False) -> int:
    embeddings = s.vocab * s.hidden * (1 if s.tied else 2)
    return embeddings + s.layers * attention_parameters(s) + mlp_parameters(s, active=active) + s.hidden  # final norm


def activation_floats_per_token(s: Shape, tensor_parallel: int = 1) -> float:
    """What the backward keeps per token (floats), no checkpointing, flash / sdpa attention: per layer, the MLP's
    4 x its width (gate, up, silu(gate), their product), 8 x hidden (each RMSNorm's input and output; the attention's
    output twice: as returned and as the output projection's input, q and o) and 2 x the KV width (k, v), plus a
    softmax statistic per head; the final norm and the output head's input, 3 x hidden. Measured with saved-tensor
    hooks on Qwen2 (benchmarks/memory.py's `--check` tests the sum). An MoE layer keeps its active experts' widths.
    Under tensor parallel each rank keeps its heads' and MLP columns' share; the norms' inputs and outputs are whole."""
    width = s.intermediate if not s.experts else s.active * s.moe_intermediate + s.shared_intermediate
    per_layer = 4 * s.hidden + (4 * width + 4 * s.hidden + 2 * s.kv_heads * s.dim + s.heads) / tensor_parallel
    return s.layers * per_layer + 3 * s.hidden


LOGIT_COPIES = 3
"""fp32 copies of a token's logits the trainer's loss holds at once (the logits at the response positions, their
log-softmax and its gradient), for the tokens of one head chunk (`logit_chunk_tokens`)."""


def memory(s: Shape, *, ranks: int = 1, tokens: int = 4096, bf16: bool = False, checkpointing: bool = False,
           lora_fraction: float | None = None, logit_chunk: int | None = None,
           tensor_parallel: int = 1) -> dict[str, float]:
    """Bytes one training rank holds at the peak of a step after the first: the fp32 weights, gradients and AdamW
    moments (4 + 4 + 8 bytes per trained parameter), sharded over `ranks` (FSDP2), plus one gathered layer's weights,
    and the activations and logits, all at once. (The gradients are freed before each forward and fill in as the
    backward frees the activations, so with an allocator that hands freed memory straight on the peak is lower, by up
    to the smaller of the two; the measured CPU peaks (`--check`) hold both.) The activations are a micro-batch's of `tokens`
    tokens (bf16 autocast: 2 bytes per float; with checkpointing each layer keeps its input and one layer its whole
    set), the logits those of `logit_chunk` tokens (all the micro-batch's by default). Under LoRA only
    `lora_fraction` of the parameters train: the frozen rest has weights alone. `tensor_parallel` > 1: `ranks` /
    tensor_parallel FSDP2 groups, each layer's projections split over a group's ranks (`split_parameters`; the
    embeddings and norms sharded over the groups alone), and each rank keeps its share of the activations; the
    logits stay whole. A model, not a measurement: allocator slack and framework buffers come on top (`--check`)."""
    P = parameters(s)
    groups = ranks // tensor_parallel
    split = split_parameters(s) if tensor_parallel > 1 else P
    per_rank = split / ranks + (P - split) / groups  # parameters each rank holds a shard of
    trained = per_rank * (lora_fraction or 1.0)
    gathered = 4 * (P - s.vocab * s.hidden * (1 if s.tied else 2)) / s.layers / tensor_parallel if groups > 1 else 0
    weights = 4 * per_rank + gathered
    adam, grads = 8 * trained, 4 * trained
    per_token = activation_floats_per_token(s, tensor_parallel)
    if checkpointing:
        per_token = s.layers * s.hidden + per_token / s.layers
    activations = (2 if bf16 else 4) * per_token * tokens
    logits = 4 * LOGIT_COPIES * s.vocab * (logit_chunk or tokens)
    return {"weights": weights, "adam": adam, "grads": grads, "activations": activations, "logits": logits,
            "total": weights + adam + grads + activations + logits}


def kv_cache_bytes_per_token(s: Shape, bytes_per_float: int = 2) -> int:
    """The sampler's KV cache per token (bf16): keys and values of every layer (latent attention: its compressed
    latent and rotary key, what vLLM caches for DeepSeek)."""
    per_layer = s.kv_rank + s.rope_dim if s.kv_rank else 2 * s.kv_heads * s.dim
    return bytes_per_float * s.layers * per_layer


LAYOUTS = [  # (name, ranks, bf16, checkpointing, lora_fraction, tensor_parallel)
    ("1 rank, fp32", 1, False, False, None, 1),
    ("8 ranks, bf16", 8, True, False, None, 1),
    ("8 ranks, bf16, TP 2", 8, True, False, None, 2),
    ("8 ranks, bf16, ckpt", 8, True, True, None, 1),
    ("64 ranks, bf16, ckpt", 64, True, True, None, 1),
    ("64 ranks, bf16, ckpt, TP 8", 64, True, True, None, 8),
    ("8 ranks, bf16, ckpt, LoRA 1%", 8, True, True, 0.01, 1),
]
TABLE_TOKENS = 16384
"""The micro-batch of the table: 16k tokens per rank (four 4k-token responses), the head chunked by 4096."""


def table() -> str:
    """docs/scale.md's table: GiB per rank for each layout ("-" where rlbench's tensor parallel does not split the
    model), with the parameter counts, KV cache and FLOPs per token."""
    head = "| model | params (active) | " + " | ".join(name for name, *_ in LAYOUTS) + \
           " | KV cache / token | train FLOPs / token |"
    lines = [head, "|---|---|" + "---:|" * (len(LAYOUTS) + 2)]
    for name, s in PUBLISHED.items():
        P, A = parameters(s), parameters(s, active=True)
        cells = []
        for _, ranks, bf16, ckpt, lora, tp in LAYOUTS:
            if tp > 1 and not splits(s, tp):
                cells.append("-")
                continue
            m = memory(s, ranks=ranks, tokens=TABLE_TOKENS, bf16=bf16, checkpointing=ckpt, lora_fraction=lora,
                       logit_chunk=4096, tensor_parallel=tp)
            cells.append(f"{m['total'] / GIB:,.1f}")
        count = f"{P / 1e9:.2f}B" + (f" ({A / 1e9:.1f}B)" if s.experts else "")
        lines.append(f"| {name} | {count} | " + " | ".join(cells) +
                     f" | {kv_cache_bytes_per_token(s) / 1024:.0f} KiB | {6 * A / 1e9:.1f} G |")
    return "\n".join(lines)


CHECK_SIZES = {"~20M": dict(hidden=512, layers=5, intermediate=2048, heads=8, kv_heads=4),
               "~80M": dict(hidden=768, layers=9, intermediate=3072, heads=12, kv_heads=4),
               "~180M": dict(hidden=1024, layers=12, intermediate=4096, heads=16, kv_heads=4)}
"""Random Qwen2 shapes of `--check` (tiny-arith's tokenizer), as benchmarks/scaling.py's model-size sweep."""
CHECK_ROWS, CHECK_PROMPT, CHECK_RESPONSE = 8, 16, 112
"""The measured step's batch: 8 rows of a 16-token prompt and a 112-token response (1024 tokens, per sample), on
every rank."""
CHECK_LAYOUTS = {"1 rank": (1, 1), "2 ranks, FSDP": (2, 1), "2 ranks, TP 2": (2, 2)}
"""`--check`'s layouts: (ranks, tensor_parallel); the two-rank ones at the two larger sizes."""
RETURNED = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""The measuring processes' environment for the peak the model describes: every block over 64 KiB its own mapping,
given back to the system when freed. (By default glibc raises that threshold to the largest block freed so far, after
which freed blocks stay in its heap, fragmented: the resident peak then carries slack from the step's history, most
with the many gathers and frees of FSDP2 and DTensor; `--check` measures that peak too.)"""

CHILD = """
import json, sys, threading, time, torch
import rlbench as rl
from rlbench.batch import Batch
from rlbench.policy import Policy
from rlbench.policy.training import OptimSettings
torch.set_num_threads(1)
model_dir, rows, prompt, response, rank, world, tp = sys.argv[1], *map(int, sys.argv[2:8])
g = torch.Generator().manual_seed(0)
batch = Batch(dict(prompt_ids=torch.randint(3, 200, (rows, prompt), generator=g),
                   prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
                   response_ids=torch.randint(3, 200, (rows, response), generator=g),
                   response_mask=torch.ones(rows, response, dtype=torch.long),
                   advantages=torch.randn(rows, response, generator=g),
                   sampler_logp=torch.zeros(rows, response)))
def rss() -> float:  # now, in bytes
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
before = rss()
policy = Policy(model_dir, OptimSettings(lr=1e-6), micro_batch_tokens=rows * (prompt + response), attention="per_sample",
                rank=rank, world_size=world, tensor_parallel=tp, init_method=sys.argv[8] if world > 1 else None)
algorithm = rl.algorithms.get("grpo").replace(kl_coef=0.0)
counts = dict(num_tokens=rows * response, num_seqs=rows, norm_length=response)
policy.train_step(batch, algorithm, **counts)  # the first step allocates AdamW's moments
peak, done = [0], threading.Event()
def watch():  # the second step's resident memory, every millisecond
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.001)
watcher = threading.Thread(target=watch)
watcher.start()
policy.train_step(batch, algorithm, **counts)
done.set()
watcher.join()
print(json.dumps({"peak_bytes": peak[0] - before, "parameters": sum(p.numel() for p in policy.model.parameters())}))
if world > 1:
    torch.distributed.destroy_process_group()
"""


def check(out: Path | None) -> list[dict]:
    """Each `CHECK_SIZES` model's measured peak against `memory`, fp32, no checkpointing: one rank at every size, and
    the `CHECK_LAYOUTS` of two ranks at the two larger (each rank's peak; the larger of the two is compared); measured
    with freed memory given back (`RETURNED`, the error), and with glibc's default (`glibc_default_error`)."""
    sys.path.insert(0, str(HERE))
    import rlbench as rl
    from timing import random_qwen2

    vocab = len(rl.models.build_tokenizer())
    rows, tokens = [], CHECK_ROWS * (CHECK_PROMPT + CHECK_RESPONSE)
    env = os.environ | {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    for i, (label, kw) in enumerate(CHECK_SIZES.items()):
        shape = Shape(hidden=kw["hidden"], layers=kw["layers"], intermediate=kw["intermediate"], heads=kw["heads"],
                      kv_heads=kw["kv_heads"], vocab=vocab, tied=True, qkv_bias=True)
        with tempfile.TemporaryDirectory() as tmp:
            random_qwen2(tmp, max_positions=256, **kw)
            for layout, (ranks, tp) in list(CHECK_LAYOUTS.items())[: 1 if i == 0 else None]:
                measured = _measure(tmp, ranks, tp, env | RETURNED)
                default = _measure(tmp, ranks, tp, env)
                assert parameters(shape) == measured[0]["parameters"], (parameters(shape), measured[0]["parameters"])
                predicted = memory(shape, tokens=tokens, ranks=ranks, tensor_parallel=tp)
                row = {"size": label, "layout": layout, "parameters": parameters(shape), "tokens": tokens,
                       "predicted_mb": round(predicted["total"] / 2**20, 1),
                       "parts_mb": {k: round(v / 2**20, 1) for k, v in predicted.items() if k != "total"},
                       "measured_mb": round(max(m["peak_bytes"] for m in measured) / 2**20, 1),
                       "measured_per_rank_mb": [round(m["peak_bytes"] / 2**20, 1) for m in measured],
                       "glibc_default_mb": round(max(m["peak_bytes"] for m in default) / 2**20, 1)}
                row["error"] = round(row["predicted_mb"] / row["measured_mb"] - 1, 3)
                row["glibc_default_error"] = round(row["predicted_mb"] / row["glibc_default_mb"] - 1, 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {"summary": True, "max_abs_error": max(abs(r["error"]) for r in rows),
               "glibc_default_max_abs_error": max(abs(r["glibc_default_error"]) for r in rows)}
    print(json.dumps(summary))
    if out:
        out.write_text("".join(json.dumps(r) + "\n" for r in [*rows, summary]))
    return rows


def _measure(model_dir: str, ranks: int, tensor_parallel: int, env: dict) -> list[dict]:
    """`CHILD`'s report from each of `ranks` processes (a gloo group over loopback when more than one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    children = [subprocess.Popen([sys.executable, "-c", CHILD, model_dir, str(CHECK_ROWS), str(CHECK_PROMPT),
                                  str(CHECK_RESPONSE), str(rank), str(ranks), str(tensor_parallel), address],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for rank in range(ranks)]
    reports = []
    for child in children:
        stdout, stderr = child.communicate()
        if child.returncode:
            raise RuntimeError(f"a measuring rank failed:\n{stderr[-2000:]}")
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    return reports


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--table", action="store_true", help="print docs/scale.md's table")
    parser.add_argument("--check", action="store_true", help="measure three toy sizes against the model")
    parser.add_argument("--out", type=Path, default=None, help="with --check: save its JSON lines here")
    args = parser.parse_args()
    if args.table:
        print(table())
    if args.check:
        check(args.out)


if __name__ == "__main__":
    main()
