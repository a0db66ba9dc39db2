"""rlbench vs TRL's GRPOTrainer on a tool loop: the calculator task on tiny-tools, same work, runs alternated.

One command from a fresh clone: `.venv/bin/python benchmarks/vs_trl_agentic.py [--steps 30] [--seeds 0 1 2]`.
The first run creates TRL's environment in benchmarks/.venv-trl (as benchmarks/vs_trl.py does). Both libraries
train tiny-tools (the same weights) on two-digit products with the `calc` tool: 8 prompts x 8 episodes per step, at
most 3 assistant turns, temperature 1, AdamW lr 3e-4 constant, gradient clip 1, GRPO (PPO clip 0.2, per-sequence
loss, k3 KL 0.001 to the initial model), one optimizer step per batch, fp32, one torch thread. rlbench samples at
most 64 tokens per turn; TRL's budget is per episode (`max_completion_length`), set to 64 x 3. TRL's side
(benchmarks/trl_agentic.py) gives tiny-tools a template that renders structured tool calls to the same tokens.

One evaluator for both: rlbench's greedy episodes on the calculator's 200 held-out products (`Session.evaluate`),
before training (the same model for both) and after, TRL's saved weights loaded into an rlbench session. Seeds run
TRL then rlbench, back to back, so both see the same machine load. Prints one JSON line: per library the median
s/step (steps after the first two, all seeds), sampled tokens per second of generation, greedy accuracy after per
seed; then rlbench's ratio to TRL and the difference of the mean accuracies.

`--only rlbench --variant NAME` runs one of VARIANTS (rlbench with one of TRL's behaviours: the ablations of the
accuracy gap, issue 37) without TRL; `--out FILE` also writes every run's per-step curves (reward, tool calls,
tool success) and accuracies as JSON. The two count calls differently: TRL only those it could read (a malformed
call is text to it, and ends the episode), rlbench every attempt (a malformed call is answered with an error
message), so rlbench's tool calls are higher and its tool success lower by its malformed calls.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import rlbench as rl
from rlbench.models import calculator_data
from rlbench.session.state import mix
from vs_trl import TRL_VERSION, ensure_trl_venv

HERE = Path(__file__).resolve().parent
WARMUP_STEPS = 2
SETTING = dict(prompts_per_step=8, samples_per_prompt=8, max_new_tokens=64, temperature=1.0, lr=3e-4, grad_clip=1.0)
MAX_TURNS = rl.tasks.get("calculator").max_turns  # 3
KL_COEF = 0.001


def write_workdir(work: Path) -> None:
    """The model directory, the settings and the training prompts, as files TRL's side reads."""
    task = rl.tasks.get("calculator")
    setting = SETTING | {"model_dir": str(rl.models.resolve("tiny-tools")), "max_turns": MAX_TURNS, "kl_coef": KL_COEF}
    (work / "setting.json").write_text(json.dumps(setting))
    rows = [json.dumps({"prompt": e["prompt"], "answer": e["answer"]}) for e in task.train]
    (work / "train.jsonl").write_text("\n".join(rows) + "\n")


def greedy_accuracy(model: str, seed: int) -> float:
    """rlbench's evaluator: greedy episodes on the 200 held-out products."""
    with rl.Session(model=model, task="calculator", cluster="inline", threads=1,
                    seed=seed, log_dir=None, **SETTING) as s:
        return s.evaluate()["greedy_accuracy"]


class EndOnMalformed:
    """TRL's reading of a call: one that cannot be read is text (the episode ends), not an error message."""

    def __init__(self):
        self.inner = rl.agents.HermesParser(stop_at_call=True)
        self.stop = self.inner.stop

    def parse(self, text: str):
        return self.inner.parse(text)[0], []


class TrlErrorCalculator(rl.Env):
    """The calculator whose failing calls answer as TRL's do: `str({"error": message})`."""

    def reset(self, prompt: list[dict], answer: str, **fields) -> list[dict]:
        self.answer = answer
        return list(prompt)

    @rl.tool
    def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: integers with + - * / ** and brackets, e.g. "(3+4)*5".
        """
        try:
            return calculator_data.calc(expression)
        except ValueError as error:
            return str({"error": str(error)})

    def reward(self, episode) -> dict[str, float]:
        right = float(episode.final_text.strip() == self.answer)
        return {"score": right, "acc": right}


def calculator_task(parser=None, env=None, train=None) -> rl.tasks.AgentTask:
    """The built-in calculator task with the parts given replaced."""
    task = rl.tasks.get("calculator")
    return rl.tasks.AgentTask(train or task.train, task.test, env=env or task.env,
                              max_turns=task.max_turns, tool_timeout_s=task.tool_timeout_s,
                              parser=parser or task.parser, name=task.name)


def trl_order(seed: int) -> list[dict]:
    """The calculator's train examples reordered so that rlbench's seeded order (epoch 0) visits TRL's
    (RepeatSampler's randperm with the seed): rlbench's i-th example is then TRL's i-th."""
    train = rl.tasks.get("calculator").train
    ours = torch.randperm(len(train), generator=torch.Generator().manual_seed(mix(seed, 0))).tolist()
    theirs = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    reordered = [None] * len(train)
    for a, b in zip(ours, theirs):
        reordered[a] = train[b]
    return reordered


VARIANTS = {
    "default": lambda seed: {},
    "end_on_malformed": lambda seed: {"task": calculator_task(parser=EndOnMalformed())},
    "trl_error_text": lambda seed: {"task": calculator_task(env=TrlErrorCalculator)},
    "trl_order": lambda seed: {"task": calculator_task(train=trl_order(seed))},
    "turn_tokens_192": lambda seed: {"max_new_tokens": 64 * MAX_TURNS},
    "trl_all": lambda seed: {"task": calculator_task(EndOnMalformed(), TrlErrorCalculator, trl_order(seed)),
                             "max_new_tokens": 64 * MAX_TURNS},
}
"""rlbench with one of TRL's behaviours (trl_all: all of them at once): name -> seed -> the Session arguments
replaced."""


def run_trl(python: Path, work: Path, seed: int, steps: int) -> dict:
    env = os.environ | {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([str(python), str(HERE / "trl_agentic.py"), "--workdir", str(work), "--seed", str(seed),
                    "--steps", str(steps)], check=True, env=env, stdout=sys.stderr)  # stdout: our JSON only
    out = json.loads((work / f"trl-seed{seed}.json").read_text())
    return dict(step_s=out["step_s"][WARMUP_STEPS:], tokens=out["sampled_tokens"][WARMUP_STEPS:],
                generation_s=out["generation_s"][WARMUP_STEPS:], greedy_after=greedy_accuracy(out["model_dir"], seed),
                curves=out["curves"])


def run_rlbench(seed: int, steps: int, variant: str = "default") -> dict:
    algorithm = rl.algorithms.get("grpo").replace(kl_coef=KL_COEF)
    settings = dict(SETTING, task="calculator") | VARIANTS[variant](seed)
    # old_logp is the update's own forward, like TRL's with one update per batch (num_iterations=1)
    with rl.Session(model="tiny-tools", algorithm=algorithm, cluster="inline", threads=1,
                    seed=seed, log_dir=None, on_policy_old_logp=True, **settings) as s:
        every = s.run(steps, progress=False)
        after = s.evaluate()["greedy_accuracy"]
    metrics = every.iloc[WARMUP_STEPS:]
    episodes = SETTING["prompts_per_step"] * SETTING["samples_per_prompt"]
    curves = {"reward": every["reward_mean"].tolist(), "tool_calls": every["tool_calls_mean"].tolist(),
              "tool_success": every["tool_success_rate"].tolist()}
    return dict(step_s=metrics["time_step"].tolist(), tokens=(metrics["sampled_length"] * episodes).tolist(),
                generation_s=metrics["time_rollout"].tolist(), greedy_after=after, curves=curves)


def summary(runs: list[dict]) -> dict:
    rates = [t / g for r in runs for t, g in zip(r["tokens"], r["generation_s"])]
    return {"s_per_step": round(statistics.median(x for r in runs for x in r["step_s"]), 4),
            "s_per_step_per_seed": [round(statistics.median(r["step_s"]), 4) for r in runs],
            "sampled_tokens_per_s": round(statistics.median(rates)),
            "greedy_after": [round(r["greedy_after"], 4) for r in runs],
            "greedy_after_mean": round(statistics.mean(r["greedy_after"] for r in runs), 4)}


def report(folder: Path) -> str:
    """A markdown table of the `--out` files in `folder`: per file the library and variant, seeds, steps, greedy
    accuracy after per seed and its mean, and the last 10 steps' reward, tool calls per episode and tool success
    (averaged over seeds; rlbench counts malformed calls as calls and failures, TRL does not); then `pooled`."""
    lines = ["| file | library | seeds | steps | greedy after | mean | reward, last 10 steps | tool calls | tool success |",
             "|---|---|---|---:|---|---:|---:|---:|---:|"]
    for path in sorted(folder.glob("*.json")):
        out = json.loads(path.read_text())
        library = "trl" if out["trl"] else "rlbench"
        runs = out[library]
        late = {k: statistics.mean(statistics.mean(r["curves"][k][-10:]) for r in runs)
                for k in ("reward", "tool_calls", "tool_success")}
        accuracy = [r["greedy_after"] for r in runs]
        name = "TRL" if library == "trl" else f"rlbench ({out['variant']})"
        lines.append(f"| {path.name} | {name} | {' '.join(map(str, out['seeds']))} | {out['steps']} | "
                     f"{', '.join(f'{a:.3f}' for a in accuracy)} | {statistics.mean(accuracy):.3f} | "
                     f"{late['reward']:.3f} | {late['tool_calls']:.3f} | {late['tool_success']:.3f} |")
    return "\n".join(lines + ["", pooled(folder)])


def pooled(folder: Path) -> str:
    """Per library and variant, each seed's greedy accuracy after 30 steps over all the `--out` files in `folder`
    (mean, median); then each rlbench variant against TRL, and each other variant against rlbench's default, on the
    seeds both have: the mean difference, its standard error and how many seeds are ahead, level, behind."""
    after = {}
    for path in sorted(folder.glob("*.json")):
        out = json.loads(path.read_text())
        if out["steps"] == 30:
            name = "TRL" if out["trl"] else out["variant"]
            for seed, run in zip(out["seeds"], out["trl"] or out["rlbench"]):
                after.setdefault(name, {})[seed] = run["greedy_after"]
    lines = [f"{name}: {len(a)} seeds, mean {statistics.mean(a.values()):.4f}, median {statistics.median(a.values()):.4f}"
             for name, a in after.items()]
    for name, base in [(name, "TRL") for name in after if name != "TRL"] + [
            (name, "default") for name in after if name not in ("TRL", "default")]:
        seeds = sorted(after[name].keys() & after.get(base, {}).keys())
        if len(seeds) > 1:
            d = [after[name][k] - after[base][k] for k in seeds]
            lines.append(f"{name} - {base}: {len(seeds)} seeds, {statistics.mean(d):+.4f} (standard error "
                         f"{statistics.stdev(d) / len(d) ** 0.5:.4f}), {sum(x > 0 for x in d)} ahead, "
                         f"{sum(x == 0 for x in d)} level, {sum(x < 0 for x in d)} behind")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", choices=["rlbench", "trl"], default=None, help="run one library (default: both)")
    parser.add_argument("--variant", choices=list(VARIANTS), default="default", help="rlbench's variant")
    parser.add_argument("--out", type=Path, default=None, help="also write the runs and their curves here (JSON)")
    parser.add_argument("--report", type=Path, default=None, metavar="FOLDER",
                        help="print the table of the --out files in FOLDER, run nothing")
    args = parser.parse_args()
    if args.report:
        print(report(args.report))
        return
    torch.set_num_threads(1)
    python = ensure_trl_venv() if args.only != "rlbench" else None
    start = time.perf_counter()
    before = greedy_accuracy("tiny-tools", args.seeds[0])
    results = {"trl": [], "rlbench": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_workdir(work)
        for seed in args.seeds:
            if python:
                results["trl"].append(run_trl(python, work, seed, args.steps))
            if args.only != "trl":
                results["rlbench"].append(run_rlbench(seed, args.steps, args.variant))
    if args.out:
        args.out.write_text(json.dumps({"variant": args.variant, "seeds": args.seeds, "steps": args.steps,
                                        "greedy_before": before} | results))
    if args.only:
        print(json.dumps({"bench": "vs_trl_agentic", "steps": args.steps, "seeds": args.seeds, "only": args.only,
                          "variant": args.variant, "greedy_before": round(before, 4),
                          "wall_s": round(time.perf_counter() - start), args.only: summary(results[args.only])}))
        return
    trl, ours = summary(results["trl"]), summary(results["rlbench"])
    ratios = {"s_per_step": round(ours["s_per_step"] / trl["s_per_step"], 3),
              "s_per_step_per_seed": [round(a / b, 3) for a, b in zip(ours["s_per_step_per_seed"],
                                                                     trl["s_per_step_per_seed"])],
              "sampled_tokens_per_s": round(ours["sampled_tokens_per_s"] / trl["sampled_tokens_per_s"], 2),
              "greedy_after_mean_diff": round(statistics.mean(ours["greedy_after"]) -
                                              statistics.mean(trl["greedy_after"]), 3)}
    print(json.dumps({"bench": "vs_trl_agentic", "steps": args.steps, "seeds": args.seeds, "trl_version": TRL_VERSION,
                      "greedy_before": round(before, 4), "wall_s": round(time.perf_counter() - start),
                      "trl": trl, "rlbench": ours, "ratios": ratios}))


if __name__ == "__main__":
    main()
