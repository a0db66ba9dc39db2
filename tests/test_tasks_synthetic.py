"""The synthetic tasks beyond addition (multiplication, sort, reverse, countdown), and tiny-mix learning countdown."""

import dataclasses

import pytest

import rlbench as rl
from rlbench import tasks
from rlbench.models import synthetic_data


@pytest.mark.parametrize("name", ["multiplication", "sort", "reverse", "countdown"])
def test_builtin_synthetic_tasks(name):
    task = tasks.get(name)
    assert isinstance(task, tasks.Task) and task.name == name and task.truncated_reward == 0.0
    assert len(task.test) == 200 and len(task.train) > 500
    assert not {e["prompt"] for e in task.train} & {e["prompt"] for e in task.test}
    for example in task.test[:20]:
        assert task.reward(example["answer"], example) == 1.0
        assert task.reward(example["answer"] + "0", example) == 0.0
        assert task.reward("", example) == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.name = "other"


def test_examples_and_answers():
    product = next(e for e in tasks.get("multiplication").train if (e["a"], e["b"]) == (47, 6))
    assert product == {"prompt": "47*6=", "answer": "282", "a": 47, "b": 6}
    assert synthetic_data.list_prompt("sort", (3, 9, 1, 4)) == "sort 3 9 1 4="
    assert synthetic_data.list_answer("sort", (3, 9, 1, 4)) == "1 3 4 9"
    assert synthetic_data.list_answer("rev", (3, 9, 1, 4)) == "4 1 9 3"
    assert synthetic_data.countdown_prompt((3, 5, 7), 22) == "3 5 7 to 22="


def test_countdown_accepts_any_valid_expression():
    task = tasks.get("countdown")
    example = {"prompt": "3 5 7 to 22=", "answer": "3*5+7", "numbers": [3, 5, 7], "target": 22}
    assert [task.reward(c, example) for c in ["3*5+7", "7+5*3", "(5*3)+7", "3*5+7+0", "3*7+5", "35-7*2"]] == [
        1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    for example in task.test:  # every held-out problem is solvable with the numbers shown
        assert synthetic_data.check_countdown(example["answer"], example["numbers"], example["target"]) == (True, "")
        assert example["prompt"] == synthetic_data.countdown_prompt(tuple(example["numbers"]), example["target"])


def test_difficulty_knobs():
    harder = tasks.get("multiplication", a_digits=3, b_digits=1)
    assert len(harder.train) + len(harder.test) == 900 * 8 and len(harder.test[0]["answer"]) >= 3
    long_sort = tasks.get("sort", length=6)
    assert all(len(e["items"]) == 6 for e in long_sort.test)
    assert len(tasks.get("reverse", length=3, max_value=4).train) == 5**3 - 41  # a third of 125 held out
    four = tasks.get("countdown", count=4, max_number=6, max_target=50)
    assert all(len(e["numbers"]) == 4 and 1 <= e["target"] <= 50 for e in four.test)
    with pytest.raises(ValueError, match="verb"):
        tasks.ListTask("shuffle")


def test_heldout_sets_do_not_depend_on_the_order_of_calls():
    first = tasks.get("countdown").test
    synthetic_data.countdown_split.cache_clear()
    assert tasks.get("countdown").test == first


def test_registry_lists_the_new_tasks():
    assert {"arithmetic", "multiplication", "sort", "reverse", "countdown"} <= set(tasks.names())


# --- acceptance 5: the tiny model learns a harder task with GRPO -----------------------------------------------
@pytest.mark.slow
def test_grpo_raises_tiny_mix_accuracy_on_countdown():
    """tiny-mix starts at greedy held-out countdown accuracy 0.21 (its warm start stops in [0.2, 0.4]);
    80 GRPO steps take it to 0.26 and the training accuracy from 0.12 to 0.23 (seed 0, measured)."""
    session = rl.Session(model="tiny-mix", task="countdown", algorithm="grpo", cluster="inline", threads=1, lr=1e-4,
                         prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8, log_dir=None, seed=0)
    before = session.evaluate()["greedy_accuracy"]
    metrics = session.run(steps=80, progress=False)
    after = session.evaluate()["greedy_accuracy"]
    assert 0.2 <= before <= 0.4
    assert metrics["accuracy"].tail(20).mean() > metrics["accuracy"].head(20).mean() + 0.05
    assert after > before + 0.03
