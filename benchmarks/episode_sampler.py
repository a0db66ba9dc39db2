"""Multi-turn episodes on the HF sampler, with and without `keep_cache` (the K/V of the last turn kept).

A batch of episodes runs `--turns` sampler calls, as the agentic rollout does: each call samples one turn of
every running episode (a seed per episode), an episode whose turn ran to max_new_tokens without a stop token
ends, the others get an observation of ~`--observation` tokens (arithmetic text ending in a question, so that
tiny-arith answers and stops) and go on. Both modes sample the same tokens (checked); the time is the loop's.
Prints one JSON line per mode: the median seconds of the loop over `--repeats` (the modes run in turns), the
seconds of each turn, the prompt tokens of all calls and how many of them each mode's prefills computed.
A random-init Qwen2 (`--size`, tiny-arith's tokenizer) rarely draws EOS: `--stop-every k` makes every k-th
token id a stop token (a tool call's end) so that its turns end.
Measured (2-core shared CPU, one thread, 64 episodes, 4 turns, 200-token observations, median of 3 / 2):
tiny-arith 39.0 s without, 17.0 s with keep_cache (prefilled tokens 81.7k -> 40.3k; last turn 24.5 -> 7.7 s);
random ~4M Qwen2 with --stop-every 8: 73.8 s -> 34.7 s (84.4k -> 38.9k tokens; last turn 42.5 -> 14.2 s).
Run: .venv/bin/python benchmarks/episode_sampler.py [--episodes 64] [--turns 4] [--observation 200]
     [--size ~20M --stop-every 8] [--device cpu]
"""

import argparse
import json
import random
import statistics
import tempfile
import time

import torch

import rlbench as rl
from rlbench.samplers import HFSampler, SamplingParams
from scaling import SIZES
from timing import random_qwen2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-arith")
    parser.add_argument("--size", choices=sorted(SIZES), help="a random-init Qwen2 of this size instead of --model")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--observation", type=int, default=200, help="tokens appended after each turn")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--stop-every", type=int, default=0, help="every k-th token id stops a turn (0: EOS only)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = random_qwen2(tempfile.mkdtemp(), **SIZES[args.size]) if args.size else args.model
    model, tokenizer = rl.models.load(model_dir)
    stops = tuple(range(args.stop_every, len(tokenizer), args.stop_every)) if args.stop_every else ()
    sampler = HFSampler(model.to(args.device), eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, stop_token_ids=stops)
    tasks = rl.tasks.get("arithmetic").test
    prompts = [tokenizer.encode(tasks[i % len(tasks)]["prompt"], add_special_tokens=False)
               for i in range(args.episodes)]
    rng = random.Random(0)
    observations = [[_observation(tokenizer, rng, args.observation) for _ in range(args.episodes)]
                    for _ in range(args.turns)]
    results = {False: [], True: []}
    for _ in range(args.repeats + 1):  # the first round warms up
        for keep in results:
            results[keep].append(_episodes(sampler, prompts, observations, args, keep))
    assert results[False][-1]["responses"] == results[True][-1]["responses"], "the modes sampled differently"
    for keep, runs in results.items():
        runs = runs[1:]
        median = statistics.median(run["seconds"] for run in runs)
        turn_seconds = [round(statistics.median(s), 3) for s in zip(*(run["turn_seconds"] for run in runs))]
        print(json.dumps({"bench": "episode_sampler", "model": args.size or args.model, "device": args.device,
                          "threads": args.threads, "episodes": args.episodes, "turns": args.turns,
                          "observation": args.observation, "keep_cache": keep, "seconds": round(median, 3),
                          "turn_seconds": turn_seconds,
                          "episodes_per_turn": runs[0]["episodes_per_turn"],
                          "prompt_tokens": runs[0]["prompt_tokens"], "computed_tokens": runs[0]["computed_tokens"]}),
              flush=True)


def _episodes(sampler: HFSampler, prompts, observations, args, keep: bool) -> dict:
    """One run of the turn loop: its time, each turn's, what it sampled and how many prompt tokens it prefilled."""
    computed, forward = [], sampler.decoder._forward

    def counting(ids_B_S, *rest, last_only=False):  # a prefill computes B x S columns
        if last_only:
            computed.append(ids_B_S.numel())
        return forward(ids_B_S, *rest, last_only=last_only)

    sampler.decoder._forward = counting
    contexts, episodes = [list(p) for p in prompts], list(range(len(prompts)))
    turn_seconds, responses, running, prompt_tokens = [], [], [], 0
    start = time.perf_counter()
    for turn in range(args.turns):
        if not episodes:
            break
        running.append(len(episodes))
        prompt_tokens += sum(len(contexts[e]) for e in episodes)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, keep_cache=keep,
                                seeds=tuple(1000 * turn + e for e in episodes))
        turn_start = time.perf_counter()
        out = sampler.generate([contexts[e] for e in episodes], params)
        turn_seconds.append(time.perf_counter() - turn_start)
        lengths, finished = out["response_mask"].sum(-1).tolist(), out["finished"].tolist()
        responses.append(out["response_ids"].tolist())
        for e, ids, n in zip(episodes, out["response_ids"].tolist(), lengths):
            contexts[e] += ids[:n] + observations[turn][e]
        episodes = [e for e, done in zip(episodes, finished) if done]
    seconds = time.perf_counter() - start
    del sampler.decoder._forward
    return {"seconds": seconds, "turn_seconds": turn_seconds, "responses": responses, "episodes_per_turn": running,
            "prompt_tokens": prompt_tokens, "computed_tokens": sum(computed)}


def _observation(tokenizer, rng: random.Random, tokens: int) -> list[int]:
    """About `tokens` tokens of worked sums, then a question."""
    text = ""
    while len(text) < tokens - 8:  # tiny-arith's tokenizer: a token per character
        a, b = rng.randrange(100), rng.randrange(100)
        text += f"{a}+{b}={a + b} "
    a, b = rng.randrange(100), rng.randrange(100)
    return tokenizer.encode(f"{text}{a}+{b}=", add_special_tokens=False)


if __name__ == "__main__":
    main()
