"""rlbench.tasks: the Task protocol, the registry, the arithmetic task."""

import dataclasses
import random

import pytest

import rlbench.tasks as tasks
from rlbench.models import arithmetic_split


@pytest.fixture(scope="module")
def arithmetic():
    return tasks.get("arithmetic")


def test_split_sizes_and_disjointness(arithmetic):
    train = {(e["a"], e["b"]) for e in arithmetic.train}
    test = {(e["a"], e["b"]) for e in arithmetic.test}
    assert (len(arithmetic.train), len(arithmetic.test)) == (7900, 200)
    assert (len(train), len(test)) == (7900, 200)
    assert not train & test
    assert train | test == {(a, b) for a in range(10, 100) for b in range(10, 100)}


def test_heldout_is_fixed_and_shared_with_the_model_build(arithmetic):
    random.seed(12345)  # the held-out set does not depend on global random state
    assert tasks.Arithmetic().test == arithmetic.test
    assert [(e["a"], e["b"]) for e in arithmetic.test] == list(arithmetic_split()[1])


def test_examples(arithmetic):
    example = next(e for e in arithmetic.train if (e["a"], e["b"]) == (12, 34))
    assert example == {"prompt": "12+34=", "answer": "46", "a": 12, "b": 34}
    for e in arithmetic.test:
        assert (e["prompt"], e["answer"]) == (f"{e['a']}+{e['b']}=", str(e["a"] + e["b"]))


@pytest.mark.parametrize(
    ("completion", "score"), [("46", 1.0), ("46 ", 0.0), ("47", 0.0), ("", 0.0), (" 46", 0.0), ("460", 0.0)]
)
def test_reward_is_exact_match(arithmetic, completion, score):
    assert arithmetic.reward(completion, {"prompt": "12+34=", "answer": "46", "a": 12, "b": 34}) == score


def test_truncated_completions_score_zero(arithmetic):
    assert arithmetic.truncated_reward == 0.0


def test_arithmetic_is_a_frozen_task(arithmetic):
    assert isinstance(arithmetic, tasks.Task)
    assert arithmetic.name == "arithmetic"
    with pytest.raises(dataclasses.FrozenInstanceError):
        arithmetic.name = "other"


def test_registry():
    assert "arithmetic" in tasks.names()
    with pytest.raises(ValueError, match="arithmetic"):
        tasks.get("nope")


def test_a_task_instance_passes_through(arithmetic):
    class Echo:
        name, train, test, truncated_reward = "echo", [{"prompt": "a"}], [{"prompt": "b"}], None

        def reward(self, completion, example):
            return {"score": float(completion == example["prompt"]), "acc": 1.0}

    echo = Echo()
    assert tasks.get(echo) is echo
    assert tasks.get(arithmetic) is arithmetic
    with pytest.raises(TypeError):
        tasks.get(object())
    with pytest.raises(TypeError):
        tasks.get(echo, seed=1)
