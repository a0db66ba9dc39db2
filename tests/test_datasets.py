"""Data in verl's schema: the preparation scripts on the shipped samples, the loaders, prompts and their lengths."""

import importlib.util
import itertools
import json
from pathlib import Path

import pytest

import rlbench as rl
from rlbench import rewards, tasks

DATASETS = Path(__file__).resolve().parents[1] / "datasets"
SAMPLES = DATASETS / "samples"


def script(name):
    """A datasets/prepare_*.py script as a module."""
    spec = importlib.util.spec_from_file_location(name, DATASETS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verl_row(content, truth, data_source="openai/gsm8k", index=0):
    return {"data_source": data_source, "prompt": [{"role": "user", "content": content}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"split": "train", "index": index}}


# --- preparation scripts on the shipped samples ----------------------------------------------------------------
def test_samples_are_what_make_samples_writes(tmp_path, monkeypatch):
    maker = script("samples/make_samples")
    monkeypatch.setattr(maker, "HERE", tmp_path)
    monkeypatch.syspath_prepend(str(DATASETS))
    maker.main()
    for path in tmp_path.glob("*.jsonl"):
        assert path.read_text() == (SAMPLES / path.name).read_text(), f"{path.name} differs: regenerate the samples"


def test_gsm8k(tmp_path):
    script("prepare_gsm8k").main(["--train", str(SAMPLES / "gsm8k.jsonl"), "--out", str(tmp_path)])
    task = tasks.from_parquet(tmp_path / "train.parquet", shuffle=False)
    raw = tasks.read_records(SAMPLES / "gsm8k.jsonl")
    assert len(task.train) == len(raw) == 32 and task.test == ()
    row = task.train[0]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": raw[0]["question"] + ' Let\'s think step by step and output '
                                                                              'the final answer after "####".'}]
    assert row["extra_info"]["answer"] == raw[0]["answer"] and row["extra_info"]["index"] == 0
    assert any("," in r["answer"].split("####")[-1] for r in raw)  # some answers are written "#### 1,234"
    assert all("," not in r["reward_model"]["ground_truth"] for r in task.train)
    for r, example in zip(raw, task.train):  # the reference solution scores 1 under the default reward
        assert task.reward(r["answer"], example) == {"score": 1.0, "acc": 1.0}


def test_math_and_math500(tmp_path):
    prepare = script("prepare_math")
    prepare.main(["--train", str(SAMPLES / "math.jsonl"), "--out", str(tmp_path / "math")])
    prepare.main(["--subset", "math500", "--test", str(SAMPLES / "math500.jsonl"), "--out", str(tmp_path / "500")])
    math = tasks.from_parquet(tmp_path / "math" / "train.parquet", shuffle=False)
    math500 = tasks.from_parquet(tmp_path / "500" / "test.parquet", shuffle=False)
    assert (len(math.train), len(math500.train)) == (24, 16)
    truths = [e["reward_model"]["ground_truth"] for e in math.train]
    assert truths[:4] == ["\\frac{7}{12}", "6", "[2,5)\\cup(5,\\infty)", "6\\sqrt{2}"]
    assert math500.train[0]["data_source"] == "HuggingFaceH4/MATH-500"
    assert math500.train[0]["extra_info"]["unique_id"].startswith("test/")
    for task in (math, math500):
        for example in task.train:
            solution = example["extra_info"]["solution"]
            assert task.reward(solution, example)["acc"] == 1.0, solution
            assert task.reward("The answer is $\\boxed{12345}$.", example)["acc"] == 0.0


def test_math_reads_a_directory_of_json_files(tmp_path):
    for i, record in enumerate(tasks.read_records(SAMPLES / "math.jsonl")[:3]):
        folder = tmp_path / "MATH" / "train" / record["type"].lower()
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i}.json").write_text(json.dumps(record))
    script("prepare_math").main(["--train", str(tmp_path / "MATH" / "train"), "--out", str(tmp_path / "out")])
    assert len(tasks.read_rows(tmp_path / "out" / "train.parquet")) == 3


def test_last_boxed():
    last_boxed = script("prepare_math").last_boxed
    assert last_boxed("so $\\boxed{\\frac{1}{2}}$, not \\boxed{3}? no: $\\boxed{\\{1,2\\}}$") == "\\{1,2\\}"
    with pytest.raises(ValueError, match="no \\\\boxed"):
        last_boxed("the answer is 3")


def solve_countdown(numbers, target):
    """Brute force over left-nested expressions ((a op b) op c) op d, which is how the samples were made."""
    for order in itertools.permutations(numbers):
        for ops in itertools.product("+-*/", repeat=len(numbers) - 1):
            expression = str(order[0])
            for op, n in zip(ops, order[1:]):
                expression = f"({expression} {op} {n})"
            if rewards.check_countdown(expression, numbers, target)[0]:
                return expression
    return None


def test_countdown(tmp_path):
    script("prepare_countdown").main(["--input", str(SAMPLES / "countdown.jsonl"), "--test-size", "8",
                                      "--out", str(tmp_path)])
    task = tasks.from_parquet(tmp_path / "train.parquet", test=tmp_path / "test.parquet", shuffle=False)
    assert (len(task.train), len(task.test)) == (24, 8)
    example = task.train[0]
    truth = example["reward_model"]["ground_truth"]
    assert set(truth) == {"target", "numbers"} and str(truth["numbers"]) in example["prompt"][0]["content"]
    for example in task.train + task.test:
        truth = example["reward_model"]["ground_truth"]
        solution = solve_countdown(truth["numbers"], truth["target"])
        assert task.reward(f"<think>...</think> <answer>{solution}</answer>", example) == {"score": 1.0, "acc": 1.0}
        assert task.reward("<answer>1 + 1</answer>", example) == {"score": 0.1, "acc": 0.0}


def test_dapo_math_removes_duplicates(tmp_path):
    script("prepare_dapo_math").main(["--train", str(SAMPLES / "dapo_math.jsonl"), "--out", str(tmp_path)])
    raw = tasks.read_records(SAMPLES / "dapo_math.jsonl")
    task = tasks.from_parquet(tmp_path / "train.parquet", shuffle=False)
    assert len(raw) == 17 and len(task.train) == 11
    assert [e["extra_info"]["index"] for e in task.train] == list(range(11))
    for example in task.train:
        assert "Answer:" in example["prompt"][0]["content"]
        assert task.reward(f"...\nAnswer: {example['reward_model']['ground_truth']}", example)["score"] == 1.0
        assert task.reward("Answer: 0.123", example)["score"] == -1.0


def test_deepmath_from_two_shards_is_graded_by_math_verify(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(DATASETS))  # the script reads MATH's instruction from prepare_math
    raw = tasks.read_records(SAMPLES / "deepmath.jsonl")
    tasks.write_rows(raw[:10], tmp_path / "train-00000-of-00002.parquet")
    tasks.write_rows(raw[10:], tmp_path / "train-00001-of-00002.parquet")
    script("prepare_deepmath").main(["--train", str(tmp_path / "train-00000-of-00002.parquet"),
                                     str(tmp_path / "train-00001-of-00002.parquet"), "--out", str(tmp_path / "out")])
    task = tasks.from_parquet(tmp_path / "out" / "train.parquet", shuffle=False)
    assert len(raw) == len(task.train) == 16 and task.train[0]["data_source"] == "zwhe99/DeepMath-103K"
    assert task.train[0]["prompt"][0]["content"].endswith("output the final answer within \\boxed{}.")
    assert set(task.train[0]["extra_info"]) == {"split", "index", "difficulty", "topic"}
    for record, example in zip(raw, task.train):
        assert task.reward(record["r1_solution_1"], example)["acc"] == 1.0
        assert task.reward("The answer is $\\boxed{12345}$.", example)["acc"] == 0.0


# --- loaders ---------------------------------------------------------------------------------------------------
@pytest.fixture
def rows():
    return [verl_row(f"{a}+{a}=", str(2 * a), index=a) for a in range(20)]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_round_trip_keeps_the_schema_unchanged(tmp_path, rows, suffix):
    path = tasks.write_rows(rows, tmp_path / f"data{suffix}")
    load = tasks.from_parquet if suffix == ".parquet" else tasks.from_jsonl
    task = load(path, shuffle=False)
    assert list(task.train) == rows and task.name == "data"
    assert repr(task) == "DataTask('data', train=20, test=0)"
    assert isinstance(task, tasks.Task) and task.truncated_reward is None


def test_test_split_from_a_file_a_fraction_or_a_count(tmp_path, rows):
    train, test = tasks.write_rows(rows, tmp_path / "train.parquet"), tasks.write_rows(rows[:3], tmp_path / "t.parquet")
    assert len(tasks.from_parquet(train, test=test, duplicates="keep").test) == 3  # (its rows are train's first 3)
    by_fraction = tasks.from_parquet(train, test=0.25, seed=1)
    assert (len(by_fraction.train), len(by_fraction.test)) == (15, 5)
    indices = [{e["extra_info"]["index"] for e in split} for split in (by_fraction.train, by_fraction.test)]
    assert not indices[0] & indices[1]
    assert by_fraction.test == tasks.from_parquet(train, test=0.25, seed=1).test
    assert by_fraction.test != tasks.from_parquet(train, test=0.25, seed=2).test
    assert len(tasks.from_parquet(train, test=4).test) == 4
    with pytest.raises(ValueError, match="cannot hold out 30"):
        tasks.from_parquet(train, test=30)


def test_shuffle_is_deterministic_by_seed(tmp_path, rows):
    path = tasks.write_rows(rows, tmp_path / "d.parquet")
    first, again, other = (tasks.from_parquet(path, seed=s).train for s in (0, 0, 1))
    assert first == again and first != other and first != tuple(rows)
    assert sorted(e["extra_info"]["index"] for e in first) == list(range(20))


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.pop("prompt"), "row 2 of .*: no 'prompt' column"),
    (lambda r: r.update(prompt=[{"role": "user"}]), "row 2 of .*: a chat message needs string 'role' and 'content'"),
    (lambda r: r.update(prompt=[]), "row 2 of .*: a prompt needs at least one chat message"),
    (lambda r: r.update(data_source=None), "row 2 of .*: 'data_source' must be a string"),
    (lambda r: r.update(data_source="my/set"), "row 2 of .*: no built-in reward for data_source 'my/set'"),
    (lambda r: r.update(reward_model={"style": "rule"}), "row 2 of .*: no 'reward_model.ground_truth'"),
])
def test_bad_rows_are_named(tmp_path, rows, change, message):
    change(rows[2])
    path = tasks.write_rows(rows, tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=message):
        tasks.from_jsonl(path)


def test_own_reward_lifts_the_data_source_check(tmp_path, rows):
    for r in rows:
        r["data_source"] = "my/set"
    task = tasks.from_jsonl(tasks.write_rows(rows, tmp_path / "d.jsonl"), reward=lambda c, e: 1.0)
    assert task.reward("x", task.train[0]) == 1.0


# --- prompts: rendering and lengths ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return rl.models.build_tokenizer()


def test_plain_rendering_without_a_chat_template(tokenizer):
    one = [{"role": "user", "content": "12+34="}]
    assert tasks.render_prompt(tokenizer, one) == "12+34="
    assert tasks.encode_prompt(tokenizer, one) == tasks.encode_prompt(tokenizer, "12+34=") == tokenizer.encode("12+34=")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+34="}]
    assert tasks.render_prompt(tokenizer, chat) == "system: Be brief.\nuser: 12+34=\nassistant:"


def test_chat_template_is_used_when_there_is_one():
    templated = rl.models.build_tokenizer()
    templated.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    chat = [{"role": "user", "content": "12+34="}]
    assert tasks.render_prompt(templated, chat) == "<|user|>12+34=\n<|assistant|>"
    assert tasks.encode_prompt(templated, chat) == templated.encode("<|user|>12+34=\n<|assistant|>")
    assert tasks.render_prompt(templated, "12+34=") == "12+34="  # a string prompt is used as is


def test_prompt_length_policy(tokenizer, tmp_path):
    rows = [verl_row("1+1=", "2", index=0), verl_row("x" * 40, "2", index=1), verl_row("2+2=", "4", index=2)]
    task = tasks.from_parquet(tasks.write_rows(rows, tmp_path / "d.parquet"), test=tmp_path / "d.parquet",
                              shuffle=False, duplicates="keep")
    assert tasks.prompt_tokens(tokenizer, task.train) == [4, 40, 4]
    assert tasks.limit_prompt_tokens(task, tokenizer, None) is task
    assert tasks.limit_prompt_tokens(task, tokenizer, 40) is task
    with pytest.raises(ValueError, match=r"train example 1 of task 'd' \(data_source openai/gsm8k, index 1\) has "
                                         r"a 40-token prompt, over max_prompt_tokens=10 \(1 train prompts are\)"):
        tasks.limit_prompt_tokens(task, tokenizer, 10)
    with pytest.warns(UserWarning, match="dropped 1 train and 1 test prompts longer than 10 tokens"):
        kept = tasks.limit_prompt_tokens(task, tokenizer, 10, on_long="drop")
    assert kept.dropped == {"train": 1, "test": 1}
    assert [e["extra_info"]["index"] for e in kept.train] == [0, 2] and kept.reward is task.reward
    arithmetic = tasks.get("arithmetic")
    assert tasks.limit_prompt_tokens(arithmetic, tokenizer, 6) is arithmetic  # "10+10=" is the longest: 6


# --- acceptance 1: a verl-format parquet trains on the tiny model ---------------------------------------------
def test_verl_parquet_trains_a_few_steps(tiny_dir, tmp_path):
    pairs = [(a, b) for a in range(10, 100, 7) for b in range(10, 100, 9)]
    rows = [verl_row(f"{a}+{b}=", str(a + b), data_source="arithmetic", index=i) for i, (a, b) in enumerate(pairs)]
    path = tasks.write_rows(rows, tmp_path / "arith.parquet")
    exact = lambda completion, example: float(completion == example["reward_model"]["ground_truth"])  # noqa: E731
    task = tasks.from_parquet(path, test=0.1, reward=exact, truncated_reward=0.0)
    session = rl.Session(model=tiny_dir, task=task, algorithm="grpo", cluster="inline", threads=1,
                         prompts_per_step=8, samples_per_prompt=4, max_new_tokens=8, log_dir=None)
    metrics = session.run(steps=3, progress=False)
    assert len(metrics) == 3 and metrics["reward_errors"].sum() == 0
    assert metrics["reward_mean"].max() > 0  # tiny-arith adds: it scores on "12+34=" rendered from the messages
    assert metrics["loss"].notna().all()
    assert session.evaluate()["greedy_accuracy"] > 0
