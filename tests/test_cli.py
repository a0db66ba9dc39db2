"""The `rlbench` command, run as a real subprocess: errors, dry runs, a short run, reproduce, eval, leaderboard, bench."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlbench as rl
from rlbench import cli
from rlbench.session.metrics import pass_and_majority

from floats import approx

REPO = Path(__file__).resolve().parents[1]
ARITHMETIC = str(REPO / "algorithms" / "grpo" / "arithmetic-tiny.toml")
GSM8K_PPO = str(REPO / "algorithms" / "ppo" / "gsm8k-qwen2.5-0.5b.toml")


def rlbench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rlbench.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def test_console_script_is_installed():
    assert (Path(sys.executable).parent / "rlbench").is_file()


@pytest.mark.parametrize("override, message", [
    ("session.lrr=3e-4", "session.lrr: unknown key; accepted: model, task, algorithm, sampler"),
    ("session.lr=fast", "session.lr: expected float, got 'fast' (str)"),
    ("session.samples_per_prompt=0", "session.samples_per_prompt: samples_per_prompt must be a positive integer, got 0"),
])
def test_bad_override_exits_2_naming_the_key(override, message):
    result = rlbench("run", ARITHMETIC, override)
    assert result.returncode == 2 and result.stdout == ""
    assert f"rlbench run: {message}" in result.stderr


def test_dry_run_of_a_gpu_recipe_checks_without_weights_or_data():
    result = rlbench("run", GSM8K_PPO, "--dry-run", "session.model=/nowhere/Qwen2.5-0.5B-Instruct")
    assert result.returncode == 0, result.stderr
    settings = last_json(result.stdout)
    assert settings["steps"] == 435 and settings["session"]["model"] == "/nowhere/Qwen2.5-0.5B-Instruct"
    assert settings["session"]["algorithm"] == "ppo" and settings["session"]["critic_lr"] == 1e-5


def test_dry_run_of_the_agentic_gpu_recipe_reads_no_task_file():
    result = rlbench("run", str(REPO / "algorithms" / "grpo" / "tool-math-qwen2.5-math-1.5b.toml"), "--dry-run",
                     "session.task.train=/nowhere/train.parquet")
    assert result.returncode == 0, result.stderr
    settings = last_json(result.stdout)
    assert settings["steps"] == 320 and settings["session"]["task"]["train"] == "/nowhere/train.parquet"
    assert settings["session"]["task"]["name"] == "tool_math"


def test_dry_run_of_the_vision_gpu_recipe_checks_without_weights_or_diagrams():
    result = rlbench("run", str(REPO / "algorithms" / "grpo" / "geo3k-qwen2.5-vl-7b.toml"), "--dry-run",
                     "session.model=/nowhere/Qwen2.5-VL-7B-Instruct")
    assert result.returncode == 0, result.stderr
    settings = last_json(result.stdout)
    assert settings["steps"] == 60 and settings["session"]["world_size"] == 8
    assert settings["session"]["task"] == {"train": "data/geo3k/train.parquet", "test": "data/geo3k/test.parquet"}


def test_short_run_trains_and_evaluates():
    result = rlbench("run", ARITHMETIC, "steps=3", "session.log_dir=none")
    assert result.returncode == 0, result.stderr
    out = last_json(result.stdout)
    assert out["steps"] == 3 and out["before"]["greedy_accuracy"] == approx(0.315)  # tiny-arith's start
    assert 0 <= out["after"]["greedy_accuracy"] <= 1 and out["train_seconds"] > 0


def test_reproduce_fails_with_the_numbers_when_the_target_is_missed():
    result = rlbench("reproduce", ARITHMETIC, "steps=2", "session.log_dir=none", "target.value=0.99",
                     "target.tolerance=0.01")
    assert result.returncode == 1, result.stderr
    verdict = result.stdout.splitlines()[-1]
    assert verdict.startswith("FAIL: greedy_accuracy ") and "after 2 steps (before: 0.315)" in verdict
    assert "target 0.990 - tolerance 0.010 = 0.980 (rlbench measured" in verdict


def test_reproduce_needs_a_target(tmp_path):
    recipe = tmp_path / "no-target.toml"
    recipe.write_text('steps = 1\n[session]\nmodel = "tiny-arith"\n')
    result = rlbench("reproduce", str(recipe))
    assert result.returncode == 2 and "target: " in result.stderr and "has no [target]" in result.stderr


@pytest.mark.slow
def test_reproduce_the_arithmetic_recipe_passes():
    """Acceptance 1: the full recipe (150 steps, about 1.5 min on 2 cores) passes its measured target."""
    result = rlbench("reproduce", ARITHMETIC, "session.log_dir=none", timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.splitlines()[-1].startswith("PASS: greedy_accuracy ")
    assert last_json(result.stdout)["after"]["greedy_accuracy"] >= 0.455


def test_eval_reports_greedy_pass_and_majority_at_k():
    result = rlbench("eval", "tiny-arith", "--task", "arithmetic", "--samples", "4", "--max-prompts", "20",
                     "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr
    out = last_json(result.stdout)
    with rl.Session(model="tiny-arith", task="arithmetic", cluster="inline", log_dir=None, max_new_tokens=8) as session:
        assert out == {"model": "tiny-arith", "task": "arithmetic", "k": 4, "prompts": 20,
                       **session.evaluate(max_prompts=20, samples=4)}  # the same evaluation: Session.evaluate
    assert out["pass@4"] >= out["maj@4"] and out["pass@4"] >= out["sampled_accuracy"] > 0


MODEL_FOR = {"arithmetic": "tiny-arith", "multiplication": "tiny-arith", "sort": "tiny-mix", "reverse": "tiny-mix",
             "countdown": "tiny-mix", "calculator": "tiny-tools",
             "shapes": "tiny-vl"}


def test_eval_runs_on_every_built_in_task_agentic_ones_too(capsys):
    needs_a_file = [name for name in rl.tasks.names() if any(
        p.default is inspect.Parameter.empty for p in inspect.signature(rl.tasks.factory(name)).parameters.values())]
    assert needs_a_file == ["tool_math"]  # its rows come from a file: `rlbench eval MODEL --task FILE` for those
    assert sorted(MODEL_FOR) == sorted(set(rl.tasks.names()) - {"tool_math"})
    for task, model in MODEL_FOR.items():
        assert cli.main(["eval", model, "--task", task, "--samples", "2", "--max-prompts", "3"]) == 0
        out = last_json(capsys.readouterr().out)
        assert out["prompts"] == 3 and set(out) >= {"greedy_accuracy", "sampled_accuracy", "pass@2", "maj@2"}, task
        assert 0 <= out["maj@2"] <= out["pass@2"] <= 1 and out["sampled_accuracy"] <= out["pass@2"], (task, out)


@pytest.mark.parametrize("option", ["--samples", "--max-prompts", "--max-new-tokens"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_eval_refuses_a_count_below_one_naming_the_option(option, value, capsys):
    assert cli.main(["eval", "tiny-arith", "--task", "arithmetic", option, value]) == 2
    assert capsys.readouterr().err.strip() == f"rlbench eval: {option}: must be a positive integer, got {value}"


def test_a_model_folder_that_does_not_exist_is_named_in_one_line(tmp_path, capsys):
    missing = tmp_path / "no-model"
    assert cli.main(["eval", str(missing), "--task", "arithmetic"]) == 2
    assert capsys.readouterr().err.strip() == (f"rlbench eval: model: model '{missing}' is not a built-in model "
                                               f"({', '.join(rl.models.names())}) nor a local Hugging Face model "
                                               f"directory: {missing} does not exist")
    assert cli.main(["run", ARITHMETIC, f"session.model={missing}", "steps=1"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"rlbench run: session.model: model '{missing}' is not a "
                                                    f"built-in model ({', '.join(rl.models.names())}) nor a local "
                                                    f"Hugging Face model directory: {missing} does not exist")


def test_pass_and_majority_on_hand_worked_samples():
    correct = [[True, False, False],   # one right out of three: passes; the majority answer "7" is wrong
               [True, True, False],    # two equal right answers: passes, majority right
               [False, False, False]]  # none right
    answers = [["5", "7", "7"], ["9", "9", "8"], ["1", "2", "3"]]
    assert pass_and_majority(correct, answers) == (2 / 3, 1 / 3)


HELP_OF_EVERY_COMMAND = """
import argparse, contextlib, io, json
from rlbench import cli
parser = cli._parser()
names = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
usages = {}
for args in [["--help"]] + [[name, "--help"] for name in names]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main(args)
    usages[" ".join(args)] = out.getvalue()
print(json.dumps(usages))
"""


def test_every_command_answers_help_in_a_subprocess():
    """The README's first command is `python -m rlbench.quickstart`: it and every `rlbench` subcommand start in a
    fresh process and print their usage (the quickstart once failed at import, registering a model twice when run as
    __main__)."""
    quickstart = subprocess.Popen([sys.executable, "-m", "rlbench.quickstart", "--help"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    console = rlbench("--help")
    assert console.returncode == 0 and console.stdout.startswith("usage: rlbench "), console.stderr[-2000:]
    usages = json.loads(subprocess.run([sys.executable, "-c", HELP_OF_EVERY_COMMAND], capture_output=True, text=True,
                                       timeout=120, check=True).stdout)
    assert sorted(usages) == ["--help", "bench --help", "eval --help", "leaderboard --help", "reproduce --help",
                              "run --help", "sweep --help"]
    for args, usage in usages.items():
        assert usage.startswith(f"usage: rlbench {args.removesuffix('--help')}"), (args, usage[:200])
    stdout, stderr = quickstart.communicate(timeout=120)
    assert quickstart.returncode == 0 and stdout.startswith("usage: python -m rlbench.quickstart "), stderr[-2000:]


def test_the_quickstart_runs_as_a_module_with_overrides():
    result = subprocess.run([sys.executable, "-m", "rlbench.quickstart", "--steps", "2", "--out", "curve",
                             "--set", "prompts_per_step=4", "--set", "log_dir=none"], capture_output=True, text=True,
                            timeout=300, env=os.environ | {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = last_json(result.stdout)
    assert out["steps"] == 2 and out["accuracy_before"] == approx(0.315) and Path(out["reward_curve"]).is_file()
    assert result.stdout.startswith("settings: model='tiny-arith',") and "prompts_per_step=4," in result.stdout
    bad = subprocess.run([sys.executable, "-m", "rlbench.quickstart", "--set", "lrr=1"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "lrr: unknown key; accepted: model, task" in bad.stderr


def test_the_quickstarts_own_run_is_the_cached_trained_model(tmp_path, monkeypatch):
    """Run with its own settings, the quickstart keeps its model as `trained(steps, seed)` (as it made the shipped
    distillation teacher, `trained(300, 0)`): the same weights as `trained` builds from scratch; with an override it
    keeps nothing."""
    from safetensors.torch import load_file

    from rlbench import quickstart

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLBENCH_CACHE", str(tmp_path / "demo"))
    quickstart.main(["--steps", "2", "--set", "lr=3e-4"])
    assert not quickstart._trained_dir(2, 0).exists()
    quickstart.main(["--steps", "2"])
    kept = quickstart._trained_dir(2, 0)
    monkeypatch.setenv("RLBENCH_CACHE", str(tmp_path / "fresh"))
    built = quickstart.trained(2, 0)
    assert built != kept and kept.is_dir()
    first, second = load_file(kept / "model.safetensors"), load_file(built / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_leaderboard_writes_markdown_and_plot(tmp_path):
    out = tmp_path / "board" / "LEADERBOARD.md"
    result = rlbench("leaderboard", "steps=2", "evaluate_every=1", "seeds=[0]", 'presets=["grpo", "opd", "gigpo"]',
                     "workers=1", "tasks.countdown.steps=2", "tasks.countdown.evaluate_every=1", "tasks.calculator.steps=1",
                     "tasks.calculator.evaluate_every=1", "tasks.calculator.seeds=[0]",
                     "--spec", str(REPO / "algorithms" / "leaderboard.toml"), "--out", str(out),
                     "--runs", str(tmp_path / "runs"))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.startswith("# CPU leaderboard") and "Reproduce: `rlbench leaderboard steps=2" in text
    assert "Total wall time:" in text and "## arithmetic" in text and "## countdown" in text and "## calculator" in text
    assert text.count("| grpo | ") == 3 and "seeds [0], 2 steps, evaluated every 1" in text
    # opd distils from arithmetic's teacher; countdown and calculator name none, so it is left out there, with the
    # reason; gigpo credits turns: it runs on the agentic calculator only
    assert text.count("| opd | ") == 1 and text.count("| gigpo | ") == 1
    assert text.count("opd (they distil from a teacher, and this task names none)") == 2
    assert text.count("gigpo (they credit each turn of an episode, and this task is single-turn)") == 2
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert {(r["board"], r["preset"], r["step"]) for r in rows if r["step"] > 0} == {
        ("arithmetic", "grpo", 1), ("arithmetic", "grpo", 2), ("arithmetic", "opd", 1), ("arithmetic", "opd", 2),
        ("countdown", "grpo", 1), ("countdown", "grpo", 2), ("calculator", "grpo", 1), ("calculator", "gigpo", 1)}
    assert len(rows) == 13  # the 5 runs' step-0 evaluations too
    assert out.with_suffix(".png").stat().st_size > 1000 and len(list((tmp_path / "runs").iterdir())) == 5


def test_bench_runs_scripts_and_names_a_missing_one(tmp_path):
    (tmp_path / "hello.py").write_text('import json\nif __name__ == "__main__":\n    print(json.dumps({"bench": "hello"}))\n')
    result = rlbench("bench", "--all", "--dir", str(tmp_path))
    assert result.returncode == 0 and '{"bench": "hello"}' in result.stdout
    result = rlbench("bench", "nope", "--dir", str(tmp_path))
    assert result.returncode == 2 and "names: no benchmark" in result.stderr and "accepted: hello" in result.stderr


def test_dry_run_of_the_lora_gsm8k_recipe_shows_its_adapter():
    result = rlbench("run", str(REPO / "algorithms" / "grpo" / "gsm8k-qwen2.5-0.5b-lora.toml"), "--dry-run",
                     "session.lora.rank=16")
    assert result.returncode == 0, result.stderr
    settings = last_json(result.stdout)
    assert settings["steps"] == 1752 and settings["session"]["prompts_per_step"] == 64
    assert settings["session"]["lora"] == {"rank": 16, "alpha": 32, "target_modules": "all-linear", "dropout": 0.0}


def test_ci_checks_the_quickstarts_closing_line(tmp_path):
    """.ci/run runs `make demo`, then .ci/check_demo.py on its output: exit 0 only for a closing JSON result whose
    held-out accuracy went up."""
    result = {"steps": 300, "seed": 0, "train_seconds": 40.1, "accuracy_before": 0.315, "accuracy_after": 0.8,
              "sampled_accuracy_before": 0.12, "sampled_accuracy_after": 0.7, "reward_curve": "runs/q/reward_curve.png"}
    cases = {"learned": (json.dumps(result), 0, "quickstart: greedy accuracy 0.315 -> 0.8 after 300 steps"),
             "flat": (json.dumps(result | {"accuracy_after": 0.315}), 1, "the quickstart did not learn"),
             "crashed": ("Traceback (most recent call last):\nValueError: boom", 1, "is not its JSON result"),
             "other keys": (json.dumps({"steps": 3}), 1, "the quickstart's result has keys ['steps']"),
             "empty": ("", 1, "the quickstart printed nothing")}
    for name, (text, code, message) in cases.items():
        log = tmp_path / f"{name}.log"
        log.write_text(f"step    0  reward 0.1\n{text}\n" if text else "")
        out = subprocess.run([sys.executable, str(REPO / ".ci" / "check_demo.py"), str(log)], capture_output=True,
                             text=True)
        assert out.returncode == code and message in out.stdout + out.stderr, (name, out.stdout, out.stderr)
