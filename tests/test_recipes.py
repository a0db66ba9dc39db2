"""Recipes (algorithms/**/*.toml): every one loads and validates on CPU without weights or data; overrides are
checked and a bad one names its key and what the key accepts."""

import io
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

import rlbench as rl
from rlbench.experiments import recipes

ALGORITHMS = Path(__file__).resolve().parents[1] / "algorithms"
RECIPES = sorted(p for p in ALGORITHMS.glob("*/*.toml"))
ARITHMETIC = ALGORITHMS / "grpo" / "arithmetic-tiny.toml"
GPU_RECIPES = [ALGORITHMS / "grpo" / "gsm8k-qwen2.5-0.5b.toml", ALGORITHMS / "ppo" / "gsm8k-qwen2.5-0.5b.toml",
               ALGORITHMS / "dapo" / "math-qwen2.5-0.5b.toml", ALGORITHMS / "grpo" / "tool-math-qwen2.5-math-1.5b.toml"]
DATASETS = ALGORITHMS.parent / "datasets"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_recipe_loads_and_validates(path):
    recipe = recipes.load(path)
    config = recipe.config()  # a checked rl.Config: the same keys as rl.Session(...)
    assert recipe.steps > 0 and recipe.description and recipe.hardware
    assert rl.algorithms.get(config.algorithm if isinstance(config.algorithm, str) else config.algorithm["preset"])
    if recipe.target is not None:
        assert recipe.target.metric in recipes.EVAL_METRICS and recipe.target.source
        assert 0 < recipe.target.value <= 1 and recipe.target.tolerance >= 0


def test_gpu_recipes_follow_the_published_settings():
    grpo, ppo, dapo, _ = (recipes.load(p) for p in GPU_RECIPES)
    for recipe in (grpo, ppo, dapo):
        cfg = recipe.config()
        assert cfg.device == "cuda" and cfg.model.endswith("Qwen2.5-0.5B-Instruct") and cfg.lr == 1e-6
        assert set(cfg.task) == {"train", "test"}  # data files, read only when the session starts
    assert ppo.target.value == 0.567 and "PPO 56.7" in ppo.target.source and "49.6" in ppo.target.source
    assert ppo.config().algorithm == "ppo" and ppo.config().critic_lr == 1e-5 and ppo.config().samples_per_prompt == 1
    assert grpo.config().samples_per_prompt == 5 and grpo.config().prompts_per_step == 1024
    assert "verl" in grpo.target.source
    assert dapo.target is None and dapo.config().algorithm == "dapo" and dapo.config().samples_per_prompt == 16


def test_the_lora_gsm8k_recipe_is_the_published_lora_row():
    recipe = recipes.load(ALGORITHMS / "grpo" / "gsm8k-qwen2.5-0.5b-lora.toml")
    cfg, full = recipe.config(), recipes.load(GPU_RECIPES[0]).config()
    assert cfg.lora == rl.LoRA(rank=32, alpha=32, target_modules="all-linear")  # "lorarank32" in the log's name
    assert (cfg.prompts_per_step, cfg.max_prompt_tokens, cfg.max_new_tokens) == (64, 512, 1024)  # "bsz64", 512, 1024
    assert recipe.target.value == 0.543 and "GRPO-LoRA 54.3" in recipe.target.source
    assert recipe.steps == -(-15 * 7473 // 64)  # 15 epochs of GSM8K's 7473 training problems, 64 a step
    for same in ("model", "task", "algorithm", "samples_per_prompt", "temperature", "device"):
        assert getattr(cfg, same) == getattr(full, same), same
    with pytest.raises(recipes.RecipeError, match="session.lora: lora: unknown key"):
        recipes.load(ALGORITHMS / "grpo" / "gsm8k-qwen2.5-0.5b-lora.toml", ["session.lora.rnak=8"])


def test_tool_math_recipe_follows_verl_tool_and_validates_without_its_files(tmp_path):
    recipe = recipes.load(GPU_RECIPES[3])  # the task's files and the weights are not here: nothing reads them
    cfg = recipe.config()
    assert cfg.device == "cuda" and cfg.model.endswith("Qwen2.5-Math-1.5B") and recipe.steps == 320
    assert (cfg.prompts_per_step, cfg.samples_per_prompt, cfg.mini_batches_per_step) == (128, 16, 1)
    assert cfg.lr == 1e-6 and cfg.lr_warmup_steps == 10 and cfg.temperature == 1.0 and cfg.max_new_tokens == 2048
    assert cfg.algorithm == {"preset": "grpo", "kl_coef": 0.0, "reduction": "token-mean"}
    assert cfg.task["name"] == "tool_math" and cfg.task["max_turns"] == 10 and cfg.task["max_context_tokens"] == 4096
    assert recipe.target.value == 0.774 and "arXiv:2509.01055" in recipe.target.source
    assert "ToRL-1.5B 77.80" in recipe.target.source and "arXiv:2503.23383" in recipe.target.source
    with pytest.raises(recipes.RecipeError, match="session.task.max_turn: unknown key; accepted: name, train, test"):
        recipes.load(GPU_RECIPES[3], ["session.task.max_turn=3"])
    # with the files there (the shipped samples, prepared), the table builds the agentic task
    for name, args in [("prepare_deepmath", ["--train", str(DATASETS / "samples" / "deepmath.jsonl")]),
                       ("prepare_math", ["--subset", "math500", "--test", str(DATASETS / "samples" / "math500.jsonl")])]:
        subprocess.run([sys.executable, str(DATASETS / f"{name}.py"), *args, "--out", str(tmp_path)], check=True,
                       capture_output=True)
    # (the shipped samples share 8 of their 16 problems: here the training copies are dropped)
    recipe = recipes.load(GPU_RECIPES[3], [f"session.task.train={tmp_path / 'train.parquet'}",
                                           f"session.task.test={tmp_path / 'test.parquet'}",
                                           "session.task.duplicates=drop"])
    task = recipe.session_kwargs()["task"]
    assert isinstance(task, rl.tasks.AgentTask) and task.name == "tool_math" and task.max_turns == 10
    assert (len(task.train), len(task.test)) == (8, 16) and [t.name for t in task.tools] == ["python"]
    assert task.train[0]["data_source"] == "zwhe99/DeepMath-103K" and task.max_context_tokens == 4096


def test_a_file_table_named_like_a_built_in_without_files_stays_a_file_task(tmp_path):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+1?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(4)]
    rl.tasks.write_rows(rows, tmp_path / "train.parquet")
    task = recipes.build_task({"train": str(tmp_path / "train.parquet"), "name": "countdown"})  # a label here
    assert isinstance(task, rl.tasks.DataTask) and task.name == "countdown" and len(task.train) == 4


def test_arithmetic_recipe_target_is_measured_and_honest():
    recipe = recipes.load(ARITHMETIC)
    assert recipe.target.source.startswith("rlbench measured")
    assert recipe.target.passed(0.46) and not recipe.target.passed(0.45)  # 0.605 - 0.15; the model starts at 0.315
    assert recipe.session_kwargs()["task"].name == "arithmetic"


def test_calculator_recipe_target_is_measured_and_honest():
    recipe = recipes.load(ALGORITHMS / "grpo" / "calculator-tiny.toml")
    assert recipe.target.source.startswith("rlbench measured")
    assert recipe.target.passed(0.665) and not recipe.target.passed(0.66)  # 0.815 - 0.15; the model starts at 0.20
    task = recipe.session_kwargs()["task"]
    assert task.name == "calculator" and isinstance(task, rl.tasks.AgentTask) and len(task.test) == 200


@pytest.mark.parametrize("override, message", [
    ("session.lrr=1", "session.lrr: unknown key; accepted: model, task, algorithm"),
    ("session.lr=fast", "session.lr: expected float, got 'fast' (str)"),
    ("session.lr=-1", "session.lr: lr must be a finite float > 0, got -1.0"),
    ("session.lr_schedule=cos", "session.lr_schedule: lr_schedule='cos' is not one of: 'constant', 'linear', 'cosine'"),
    ("session.prompts_per_step=2.5", "session.prompts_per_step: expected int, got 2.5 (float)"),
    ("session.betas=[0.9]", "session.betas: expected tuple[float, float], got [0.9] (list)"),
    ("session.world_size=2", "session.world_size: world_size=2 needs cluster='ray'"),
    ("session.algorithm=grpox", "session.algorithm.preset: 'grpox' is not one of: cispo, clip_cov, dapo"),
    ("session.algorithm.klcoef=0", "session.algorithm.klcoef: unknown key; accepted: preset, name, advantage"),
    ("session.algorithm.loss=nope", "session.algorithm: unknown loss 'nope'; valid:"),
    ("session.algorithm.correction=mist", "session.algorithm: unknown correction 'mist'; valid: geo_reject, icepop"),
    ("session.task=addition", "session.task.name: 'addition' is not one of: arithmetic, multiplication"),
    ("session.task.count=4", "session.task.count: unknown key; accepted: name, truncated_reward"),
    ("target.metric=accuracy", "target.metric: 'accuracy' is not one of: greedy_accuracy, sampled_accuracy"),
    ("steps=0", "steps: must be a positive integer, got 0"),
    ("stepz=3", "stepz: unknown key; accepted: description, hardware, steps, target, session"),
    ("session.lr", "override 'session.lr' is not KEY=VALUE"),
])
def test_bad_override_names_the_key_and_what_it_accepts(override, message):
    with pytest.raises(recipes.RecipeError) as error:
        recipes.load(ARITHMETIC, [override])
    assert str(error.value).startswith(message)


def test_overrides_set_values_of_the_right_type():
    recipe = recipes.load(ARITHMETIC, ["session.lr=3e-4", "session.temperature=1", "steps=5", "session.run_name=x",
                                       "session.max_prompt_tokens=none", "session.algorithm.kl_coef=0",
                                       "session.task=countdown", "session.task.count=2", "session.betas=[0.9, 0.95]"])
    assert recipe.steps == 5 and recipe.session["lr"] == 3e-4 and recipe.session["run_name"] == "x"
    assert recipe.session["temperature"] == 1.0 and isinstance(recipe.session["temperature"], float)
    assert recipe.session["max_prompt_tokens"] is None and recipe.session["betas"] == (0.9, 0.95)
    built = recipe.session_kwargs()
    assert built["algorithm"].kl_coef == 0 and built["algorithm"].loss is rl.algorithms.get("grpo").loss
    assert built["task"].count == 2 and len(built["task"].test[0]["numbers"]) == 2


def test_parse_value():
    assert [recipes.parse_value(t) for t in ["3e-4", "7", "true", "[1, 2]", '"a b"', "tiny-mix", "None"]] == [
        3e-4, 7, True, [1, 2], "a b", "tiny-mix", None]


def test_file_task_table_builds_a_data_task(tmp_path):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+1?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(6)]
    rl.tasks.write_rows(rows, tmp_path / "train.parquet")
    task = recipes.build_task({"train": str(tmp_path / "train.parquet"), "test": 2})
    assert len(task.train) == 4 and len(task.test) == 2
    with pytest.raises(recipes.RecipeError, match="session.task.tset: unknown key; accepted: train, test"):
        recipes.load(ARITHMETIC, [f"session.task={{train = '{tmp_path}/train.parquet', tset = 2}}"])


def test_leaderboard_spec_covers_every_preset_on_three_tasks():
    spec = recipes.load_leaderboard(ALGORITHMS / "leaderboard.toml")
    assert spec.presets == tuple(rl.algorithms.names()) and len(spec.tasks) == 3
    assert [s["task"] for s in spec.tasks.values()] == ["arithmetic", "countdown", "calculator"]
    assert spec.budgets["arithmetic"] == {"steps": 300, "evaluate_every": 50, "seeds": [0, 1, 2]}  # the file's
    assert spec.budgets["calculator"] == {"steps": 10, "evaluate_every": 5, "seeds": [0, 1, 2]}  # its own steps
    with pytest.raises(recipes.RecipeError, match="tasks.arithmetic.seed: set by the leaderboard"):
        recipes.load_leaderboard(ALGORITHMS / "leaderboard.toml", ["tasks.arithmetic.seed=3"])
    with pytest.raises(recipes.RecipeError, match="presets: 'grpox' is not one of"):
        recipes.load_leaderboard(ALGORITHMS / "leaderboard.toml", ['presets=["grpox"]'])
    # a task's own budget, else the file's
    spec = recipes.load_leaderboard(ALGORITHMS / "leaderboard.toml", ["steps=7", "evaluate_every=7", "seeds=[4]",
                                                                       "tasks.countdown.steps=20"])
    assert spec.budgets["countdown"]["steps"] == 20
    assert spec.budgets["arithmetic"] == {"steps": 7, "evaluate_every": 7, "seeds": [4]}
    assert "steps" not in spec.tasks["countdown"] and "seeds" not in spec.tasks["calculator"]  # not Session settings
    with pytest.raises(recipes.RecipeError, match="tasks.countdown.evaluate_every: must be a positive integer, got 0"):
        recipes.load_leaderboard(ALGORITHMS / "leaderboard.toml", ["tasks.countdown.evaluate_every=0"])
    with pytest.raises(recipes.RecipeError, match=r"tasks.calculator.seeds: expected one or more integers >= 0, "
                                                  r"got \[-1\]"):
        recipes.load_leaderboard(ALGORITHMS / "leaderboard.toml", ["tasks.calculator.seeds=[-1]"])
    with pytest.raises(recipes.RecipeError, match="tasks.arithmetic.seeds: expected one or more integers"):
        recipes.load_leaderboard(ALGORITHMS / "leaderboard.toml", ["seeds=[]"])


def test_a_named_rollout_correction_in_an_algorithm_table():
    recipe = recipes.load(ARITHMETIC, ["session.algorithm.correction=mis"])
    assert recipe.session_kwargs()["algorithm"].correction == rl.algorithms.get_correction("mis")


def test_algorithm_table_without_preset_builds_a_new_algorithm():
    recipe = recipes.load(ARITHMETIC, ['session.algorithm={name = "mine", advantage = "rloo", loss = "gpg"}'])
    algorithm = recipe.session_kwargs()["algorithm"]
    assert algorithm.name == "mine" and algorithm.advantage is rl.algorithms.advantage_fn("rloo")
    with pytest.raises(recipes.RecipeError, match="session.algorithm: .*missing .*'name'"):
        recipes.load(ARITHMETIC, ['session.algorithm={advantage = "rloo", loss = "gpg"}'])


def test_the_geo3k_recipe_follows_verls_vision_example_and_its_data_carries_diagrams(tmp_path):
    recipe = recipes.load(ALGORITHMS / "grpo" / "geo3k-qwen2.5-vl-7b.toml")  # no weights, no data files read
    cfg = recipe.config()
    assert cfg.model.endswith("Qwen2.5-VL-7B-Instruct") and cfg.device == "cuda" and cfg.world_size == 8
    assert (cfg.prompts_per_step, cfg.samples_per_prompt, cfg.mini_batches_per_step) == (512, 5, 4)  # mini-batch 128
    assert (cfg.max_prompt_tokens, cfg.max_new_tokens, cfg.long_prompts, cfg.lr) == (1024, 2048, "drop", 1e-6)
    assert cfg.algorithm == {"preset": "grpo", "kl_coef": 0.01} and not cfg.freeze_vision
    assert recipe.steps == 15 * (2101 // 512)  # 15 epochs of the 2101 training problems, whole steps
    assert recipe.target.value == 0.52 and "0.39->0.52" in recipe.target.source
    # Geometry3K's own rows (the hub's parquet: diagrams as {bytes, path} records), prepared, make the recipe's task
    diagrams = []
    for size in (40, 56):
        png = io.BytesIO()
        Image.new("RGB", (size, size), "white").save(png, format="PNG")
        diagrams.append({"bytes": png.getvalue(), "path": None})
    rows = [{"images": [diagrams[0]], "problem": "<image>Find x.", "answer": "3"},
            {"images": [diagrams[1]], "problem": "<image>Find the area of the circle.", "answer": "4\\pi"}]
    rl.tasks.write_rows(rows, tmp_path / "raw.parquet")
    subprocess.run([sys.executable, str(DATASETS / "prepare_geo3k.py"), "--train", str(tmp_path / "raw.parquet"),
                    "--test", str(tmp_path / "raw.parquet"), "--out", str(tmp_path / "geo3k")], check=True,
                   capture_output=True)
    recipe = recipes.load(ALGORITHMS / "grpo" / "geo3k-qwen2.5-vl-7b.toml", [
        f"session.task.train={tmp_path / 'geo3k' / 'train.parquet'}",
        f"session.task.test={tmp_path / 'geo3k' / 'test.parquet'}", "session.task.duplicates=keep"])  # (one file)
    task = recipe.session_kwargs()["task"]
    assert rl.tasks.has_images(task) and len(task.train) == 2 and task.train[1]["data_source"] == "hiyouga/geometry3k"
    assert rl.models.vision.load_image(task.train[1]["images"][0]).size == (56, 56)
    assert task.train[1]["prompt"][0]["content"].startswith("<image>Find the area of the circle. You FIRST think")
    right = "<think>r = 2</think> The area is \\boxed{4\\pi}."
    assert rl.rewards.by_data_source(right, task.train[1]) == {"score": 1.0, "acc": 1.0, "format": 1.0}
    assert rl.rewards.by_data_source("\\boxed{4\\pi}", task.train[1])["score"] == 0.9  # right, not in the format
    # and a vision-language session takes such rows (chat messages, diagrams as records): each diagram becomes the
    # model's 16 image tokens (the problem alone: with the instruction a prompt would not fit tiny-vl's 256 positions)
    short = [dict(e, prompt=[{"role": "user", "content": e["extra_info"]["problem"]}]) for e in task.train]
    tiny = rl.tasks.DataTask(name="geo3k", train=short, test=short)
    with rl.Session(model="tiny-vl", task=tiny, prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4, threads=1,
                    log_dir=None) as s:
        batch = s.score(s.rollout())
        image_id = s.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (batch["prompt_ids"] == image_id).sum(-1).tolist() == [16] * 4 and set(batch["score"].tolist()) <= {0.0}
