"""Long responses: time and memory of a GRPO step as responses grow, in each of the trainer's attention layouts.

A random ~20M-parameter Qwen2 (`SIZES["~20M"]` of scaling.py, tiny-arith's byte tokenizer, untied LM head)
that cannot emit EOS, so that every response runs to max_new_tokens: residual dimension 0 holds a constant
(every token's embedding has 1.0 there, and every layer's o_proj and down_proj write 0 to it), no LM-head row
but EOS's reads it, and EOS's row is -1000 there and 0 elsewhere. EOS's logit is then -1000 / rms(final hidden
state), about -1800 here (the other 258 logits lie within +-2: near uniform, so the samples of a prompt part at
once, as at temperature 1 on a real model): its probability underflows to exactly 0 in fp32 and the sampler
never draws it. Every measurement checks that all its responses ran to the limit. Prompts are 300 tokens (one
per character) of random lowercase words, 1 prompt x 8 samples per step, micro_batch_tokens 65536 (a group
in one micro-batch, as on a GPU), one torch thread, fp32, sdpa attention, kl_coef 0 (no reference model),
old_logp from a separate forward (`advantage()`), lr 1e-6.

Each (response length, path) runs in a fresh process (its peak resident memory is its own): `--steps` GRPO
steps, the first a warm-up when there are more. One JSON line each: the stage times of the last steps
(median) -- rollout (the HF sampler), old-logp forward (`time_advantage`), update (policy forward + backward +
optimizer step, `time_update`) -- the rollout's time per generated token and per decode step (all rows
at once), the peak resident memory (ru_maxrss) and the part of it above what the process held before its
first step, and the packed layout's mask size (rows x W x W fp32, `packed_mask_bytes`), whichever path ran.
A packed run whose mask would pass `--max-mask-mb`, or a run of either path that the growth measured at the
path's two longest lengths so far projects past `--max-seconds` or `--max-rss-mb`, is not run: its row says
"skipped" and why. A run whose resident memory
passes `--max-rss-mb` anyway is killed (its row says so). Last, a summary line: per path, the log-log
least-squares exponent of each time and of memory against the response length, and update(1024)/update(256).

Run: flock /tmp/rlbench-bench.lock .venv/bin/python benchmarks/long_responses.py [--lengths 256,512,1024,2048,4096]
     [--paths packed,per_sample] [--steps 1] [--quick]   (--quick: a ~0.1M model, lengths 32,64, 1 step: < 1 min)
"""

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import Qwen2ForCausalLM

import rlbench as rl
from rlbench.batch import Batch
from rlbench.policy.forward import packed_mask_bytes
from scaling import SIZES
from timing import random_qwen2

QUICK_SHAPE = dict(hidden=64, layers=2, intermediate=256, heads=4, kv_heads=2)
"""`--quick`'s model: a smoke test of the script, not a measurement."""
EOS_LOGIT_WEIGHT = -1000.0
"""EOS's LM-head weight on the constant residual dimension (see the module docstring)."""


@dataclass(frozen=True, eq=False)
class LongPrompts:
    """A task of `prompt_tokens`-character prompts of random lowercase words; the reward (the share of "e"
    in the completion) only has to vary, so that advantages are not all 0."""
    prompt_tokens: int = 300
    name: str = "long-prompts"
    truncated_reward: float | None = None
    train: tuple[dict, ...] = field(init=False, repr=False)
    test: tuple[dict, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rng = random.Random(0)
        words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(500)]
        prompts = [" ".join(rng.choices(words, k=self.prompt_tokens))[: self.prompt_tokens - 1] + ":" for _ in range(64)]
        object.__setattr__(self, "train", tuple({"prompt": p} for p in prompts[:48]))
        object.__setattr__(self, "test", tuple({"prompt": p} for p in prompts[48:]))

    def reward(self, completion: str, example: dict) -> float:
        return completion.count("e") / max(len(completion), 1)


def no_eos_qwen2(directory: str, shape: dict, max_positions: int) -> str:
    """A random Qwen2 (`random_qwen2`, untied) edited so that it never draws EOS (see the module docstring)."""
    random_qwen2(directory, **shape, max_positions=max_positions, tied=False)
    model = Qwen2ForCausalLM.from_pretrained(directory)
    eos = model.config.eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0  # residual dimension 0: a constant 1 ...
        for layer in model.model.layers:  # ... that no layer writes to
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[:, 0] = 0.0  # read by EOS's logit only
        model.lm_head.weight[eos] = 0.0
        model.lm_head.weight[eos, 0] = EOS_LOGIT_WEIGHT
    model.save_pretrained(directory)
    return directory


def packed_mask_mb(prompt_tokens: int, response_tokens: int, prompts: int, samples: int) -> tuple[float, int]:
    """The packed layout's mask (MiB) and width W for `prompts` groups of `samples` full-length responses
    sharing no prefix (`packed_mask_bytes` of such a batch, whose samples differ from their first token: the
    rollouts here share at most a first token)."""
    B = prompts * samples
    group_B = torch.arange(B) // samples
    batch = Batch(dict(prompt_ids=(group_B[:, None] + 3).expand(B, prompt_tokens),
                       prompt_mask=torch.ones(B, prompt_tokens, dtype=torch.long),
                       response_ids=(torch.arange(B) % samples + 3)[:, None].expand(B, response_tokens),
                       response_mask=torch.ones(B, response_tokens, dtype=torch.long)))
    mask_bytes = packed_mask_bytes(batch)
    return mask_bytes / 2**20, mask_bytes // (4 * (prompt_tokens + samples * response_tokens) * prompts)


def measure(model: str, path: str, response_tokens: int, prompt_tokens: int, prompts: int, samples: int,
            steps: int, micro_batch_tokens: int) -> dict:
    """One (path, length), in this process."""
    algorithm = rl.algorithms.get("grpo").replace(kl_coef=0.0)
    with rl.Session(model=model, task=LongPrompts(prompt_tokens), algorithm=algorithm, sampler="hf", cluster="inline",
                    threads=1, seed=0, log_dir=None, prompts_per_step=prompts, samples_per_prompt=samples,
                    max_new_tokens=response_tokens, micro_batch_tokens=micro_batch_tokens, lr=1e-6,
                    attention=path) as s:
        parameters = sum(p.numel() for p in s.policy.workers.hosts[0].objects["policy"].model.parameters())
        base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        metrics = s.run(steps, progress=False)
        lengths = s.last_batch["response_mask"].sum(-1)
        if bool(s.last_batch["finished"].any()) or bool((lengths != response_tokens).any()):
            raise RuntimeError(f"a response stopped before {response_tokens} tokens: {lengths.tolist()}")
    timings = metrics.iloc[1:].median(numeric_only=True) if steps > 1 else metrics.iloc[-1]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    generated = prompts * samples * response_tokens
    return {"parameters": parameters, "rollout_s": round(timings["time_rollout"], 3),
            "rollout_us_per_token": round(1e6 * timings["time_rollout"] / generated, 1),
            "rollout_ms_per_decode_step": round(1e3 * timings["time_rollout"] / response_tokens, 2),
            "old_logp_s": round(timings["time_advantage"], 3), "update_s": round(timings["time_update"], 3),
            "step_s": round(timings["time_step"], 3), "peak_rss_mb": round(peak_rss),
            "step_rss_mb": round(peak_rss - base_rss)}


def run_child(settings: dict, max_rss_mb: float) -> dict:
    """`measure(**settings)` in a fresh process, killed if its resident memory passes `max_rss_mb`."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(settings)], env=env, stdout=out,
                                 stderr=err, text=True)
        while child.poll() is None:
            if resident_mb(child.pid) > max_rss_mb:
                child.kill()
                child.wait()
                return {"skipped": f"killed: resident memory passed --max-rss-mb {max_rss_mb:.0f}"}
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        if child.returncode:
            raise RuntimeError(f"{settings}: exit {child.returncode}\n{err.read()[-3000:]}")
        return json.loads(out.read().splitlines()[-1])


def resident_mb(pid: int) -> float:
    """A process's resident memory now (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024
    except (FileNotFoundError, StopIteration, ProcessLookupError):
        return 0.0


def projected(rows: list[dict], key: str, response_tokens: int) -> float | None:
    """`key` at `response_tokens`, extrapolated log-log from the path's two longest measured lengths (None
    with fewer than two)."""
    done = sorted((r for r in rows if key in r), key=lambda r: r["response_tokens"])[-2:]
    if len(done) < 2 or min(r[key] for r in done) <= 0:
        return None
    (l0, y0), (l1, y1) = ((r["response_tokens"], r[key]) for r in done)
    return y1 * (response_tokens / l1) ** (math.log(y1 / y0) / math.log(l1 / l0))


def skip_reason(path: str, mask_mb: float, rows: list[dict], response_tokens: int, args) -> str | None:
    """Why not to run this (path, length), or None."""
    if path == "packed" and mask_mb > args.max_mask_mb:
        return f"packed mask {mask_mb:.0f} MiB > --max-mask-mb {args.max_mask_mb:.0f}"
    seconds = projected(rows, "step_s", response_tokens)
    if seconds is not None and seconds * args.steps > args.max_seconds:
        return f"projected {seconds * args.steps:.0f} s > --max-seconds {args.max_seconds:.0f}"
    rss = projected(rows, "peak_rss_mb", response_tokens)
    if rss is not None and rss > args.max_rss_mb:
        return f"projected peak {rss:.0f} MB > --max-rss-mb {args.max_rss_mb:.0f}"
    return None


def exponent(rows: list[dict], key: str) -> float | None:
    """The least-squares slope of log(key) against log(response length) (None with fewer than two points)."""
    points = [(r["response_tokens"], r[key]) for r in rows if r.get(key, 0) > 0]
    if len(points) < 2:
        return None
    x, y = np.log(np.array(points, dtype=float)).T
    return round(float(np.polyfit(x, y, 1)[0]), 2)


def summary(rows: list[dict], paths: list[str]) -> dict:
    out = {"bench": "long_responses", "summary": True}
    for path in paths:
        done = [r for r in rows if r["path"] == path and "skipped" not in r]
        update = {r["response_tokens"]: r["update_s"] for r in done}
        out[path] = {"lengths": [r["response_tokens"] for r in done],
                     "exponents": {key: exponent(done, key) for key in
                                   ("rollout_s", "rollout_us_per_token", "old_logp_s", "update_s", "peak_rss_mb",
                                    "step_rss_mb")},
                     "update_1024_over_256": round(update[1024] / update[256], 2) if {256, 1024} <= update.keys()
                     else None}
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="256,512,1024,2048,4096", help="response lengths (max_new_tokens)")
    parser.add_argument("--paths", default="packed,per_sample", help="attention= values to run")
    parser.add_argument("--steps", type=int, default=1, help="GRPO steps per run (the first a warm-up if > 1)")
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=1, help="prompts_per_step")
    parser.add_argument("--samples", type=int, default=8, help="samples_per_prompt")
    parser.add_argument("--micro-batch-tokens", type=int, default=65536)
    parser.add_argument("--max-mask-mb", type=float, default=2048, help="skip packed runs with a larger mask")
    parser.add_argument("--max-seconds", type=float, default=600, help="skip runs projected to take longer")
    parser.add_argument("--max-rss-mb", type=float, default=14336,
                        help="skip runs projected above it, kill runs that pass it (the machine: 24 GiB, shared)")
    parser.add_argument("--quick", action="store_true", help="a ~0.1M model, lengths 32,64, 1 step, short prompts")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(**json.loads(args.child))))
        return
    shape = SIZES["~20M"]
    if args.quick:
        shape, args.steps, args.prompt_tokens = QUICK_SHAPE, 1, 48
        args.lengths = "32,64" if args.lengths == parser.get_default("lengths") else args.lengths
    lengths, paths = sorted(map(int, args.lengths.split(","))), args.paths.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = no_eos_qwen2(f"{tmp}/model", shape, max_positions=args.prompt_tokens + max(lengths))
        for response_tokens in lengths:
            for path in paths:
                mask_mb, width = packed_mask_mb(args.prompt_tokens, response_tokens, args.prompts, args.samples)
                row = {"bench": "long_responses", "path": path, "response_tokens": response_tokens,
                       "prompt_tokens": args.prompt_tokens, "prompts_per_step": args.prompts,
                       "samples_per_prompt": args.samples, "packed_mask_mb": round(mask_mb, 1), "packed_width": width}
                reason = skip_reason(path, mask_mb, [r for r in rows if r["path"] == path], response_tokens, args)
                if reason is None:
                    row |= run_child(dict(model=model, path=path, response_tokens=response_tokens,
                                          prompt_tokens=args.prompt_tokens, prompts=args.prompts,
                                          samples=args.samples, steps=args.steps,
                                          micro_batch_tokens=args.micro_batch_tokens), args.max_rss_mb)
                else:
                    row["skipped"] = reason
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps(summary(rows, paths)), flush=True)


if __name__ == "__main__":
    main()
