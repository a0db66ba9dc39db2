"""`python -m rlbench.quickstart`: teach the built-in tiny model two-digit addition with GRPO.

Evaluates held-out accuracy, trains, prints one line per step, evaluates again, saves the reward
curve as a PNG, and ends with one JSON line: accuracy before and after, steps, wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from transformers import AutoModelForCausalLM

import rlbench as rl
from rlbench import models
from rlbench.experiments import recipes
from rlbench.models.tiny_arith import GRPO_NAME
from rlbench.models.warm_start import build_cached, cache_root

SETTINGS = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline",
                prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8, lr=1e-4, threads=1)
"""The quickstart's configuration (any `rl.Session` keyword can be overridden with --set KEY=VALUE). One torch
thread: a model this small steps faster on one than on two, and the run is then `trained(steps, seed)`."""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m rlbench.quickstart", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="GRPO steps (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/quickstart", help="folder for the reward-curve PNG")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="an rl.Session setting, e.g. --set lr=3e-4 --set algorithm=dapo (repeatable)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: must be at least 1, got {args.steps}")
    try:
        settings = _settings(args.overrides)
    except recipes.RecipeError as e:
        parser.error(str(e))

    print("settings: " + ", ".join(f"{key}={value!r}" for key, value in settings.items()))
    session = rl.Session(**recipes.session_kwargs(settings), seed=args.seed)
    print(session)
    before = session.evaluate()
    print(f"before: greedy accuracy {before['greedy_accuracy']:.3f}, sampled {before['sampled_accuracy']:.3f}")
    start = time.perf_counter()
    for _ in range(args.steps):
        row = session.step()
        print(f"step {row['step']:4d}  reward {row['reward_mean']:.3f}  loss {row['loss']:+.4f}  "
              f"entropy {row['entropy']:.3f}  len {row['response_length']:.1f}  {row['time_step']:.2f}s", flush=True)
    train_seconds = time.perf_counter() - start
    if settings == _settings([]):  # the quickstart's own run: kept as `trained(steps, seed)` unless that one ships
        build_cached(_trained_dir(args.steps, args.seed), lambda: _trained_model(session))
    after = session.evaluate()
    print(f"after:  greedy accuracy {after['greedy_accuracy']:.3f}, sampled {after['sampled_accuracy']:.3f}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curve = out / "reward_curve.png"
    _save_curve(session.metrics, curve)
    result = {"steps": args.steps, "seed": args.seed, "train_seconds": round(train_seconds, 1),
              "accuracy_before": before["greedy_accuracy"], "accuracy_after": after["greedy_accuracy"],
              "sampled_accuracy_before": before["sampled_accuracy"], "sampled_accuracy_after": after["sampled_accuracy"],
              "reward_curve": str(curve)}
    print(json.dumps(result))
    return result


def _settings(overrides: list[str]) -> dict:
    """SETTINGS with `--set KEY=VALUE` overrides, checked as a recipe's `[session]` table is."""
    raw = {"session": dict(SETTINGS)}
    for assignment in overrides:
        recipes.apply_override(raw, f"session.{assignment}")
    return recipes.check_session(raw["session"], "")


TEACHER = GRPO_NAME
"""The built-in model name of `trained(300, seed)`: the teacher of on-policy distillation's demonstration."""


def trained(steps: int = 300, seed: int = 0, *, shipped: bool = True) -> Path:
    """The quickstart's model after `steps` GRPO steps (one torch thread), as a Hugging Face model folder: at 300
    steps and seed 0 the one that ships with rlbench (`tiny-arith-grpo300-seed0`, unless `shipped` is False), else
    cached under `$RLBENCH_CACHE/models/tiny-arith-grpo{steps}-seed{seed}` and built on first use (about 45 s at
    300 steps). The teacher of on-policy distillation's demonstration (`benchmarks/distillation.py`), the built-in
    model `TEACHER` at 300 steps (tests/test_distill.py asserts the shipped one's held-out greedy accuracy)."""
    def train():
        with rl.Session(**SETTINGS, seed=seed, log_dir=None) as session:
            session.run(steps=steps, progress=False)
            return _trained_model(session)
    return build_cached(_trained_dir(steps, seed), train, shipped=shipped)


def _trained_dir(steps: int, seed: int) -> Path:
    return cache_root() / f"tiny-arith-grpo{steps}-seed{seed}"


def _trained_model(session: rl.Session):
    """The session's policy as a Hugging Face model, with its tokenizer (what `build_cached` saves)."""
    model = models.from_pretrained(AutoModelForCausalLM, session.model_dir)
    model.load_state_dict(session.policy.state_dict())
    return model, session.tokenizer


def teacher(seed: int, *, shipped: bool = True) -> Path:
    """The built-in model `TEACHER` (`rl.models.resolve("tiny-arith-grpo")` imports this module to build it)."""
    return trained(300, seed, shipped=shipped)


def _save_curve(metrics, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(metrics["step"], metrics["reward_mean"], alpha=0.35, label="reward (per step)")
    ax.plot(metrics["step"], metrics["reward_mean"].rolling(20, min_periods=1).mean(), label="reward (20-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO on tiny-arith")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
