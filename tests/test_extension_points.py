"""The extension points are real: a rollout mode and an advantage input written here, outside rlbench, plug into a
session and run steps without an edit to rlbench's files. Also the built-in modes as `rollout=` settings."""

import dataclasses
import textwrap

import pytest
import torch
from floats import assert_same

import rlbench as rl

SETTINGS = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", prompts_per_step=4,
                samples_per_prompt=4, max_new_tokens=8, threads=1, log_dir=None, seed=0)


def docstring_example() -> dict:
    """The rollout mode written out in `rlbench/session/sources.py`'s docstring (a fourth mode: every step trains on the first
    batch the run collected), run as written: the example a user copies is the one tested."""
    text = rl.session.sources.__doc__
    code = textwrap.dedent(text[text.index("    @dataclasses.dataclass"):text.index("    rl.Session(..., rollout=Replay())")])
    namespace = {"rl": rl, "dataclasses": dataclasses}
    exec(code, namespace)
    return namespace


def test_a_rollout_mode_from_outside_runs_steps(tiny_dir):
    example = docstring_example()
    with rl.Session(**SETTINGS, rollout=example["Replay"]()) as s:
        initial = {k: v.clone() for k, v in s.policy.state_dict().items()}
        rows = [s.step() for _ in range(3)]
        assert s.state.rollouts_done == 1  # one batch sampled, trained on three times
        assert isinstance(s.source, example["ReplaySource"]) and s.last_batch["example"] == s.source.last["example"]
        assert [r["reward_mean"] for r in rows] == [rows[0]["reward_mean"]] * 3
        assert rows[2]["loss"] != rows[0]["loss"]  # the same batch under weights that moved
        weights = s.policy.state_dict()
        assert any(not torch.equal(weights[k], initial[k]) for k in weights)
        assert s.metrics["sampler_mismatch_max"].iloc[0] < 1e-4  # the sampler got each update's weights
        assert s.config.rollout_mode == "sync"  # a mode of its own samples with one sampler
        assert "Replay()" in s.config.to_record()["rollout"]["python_object"]  # restore asks for it again


def weighted_grpo(rewards_B_T, mask_B_T, *, group_ids, difficulty_B):
    """GRPO's advantages times a per-sample weight that a registered input provides."""
    advantages_B_T, _ = rl.algorithms.advantage_fn("grpo")(rewards_B_T, mask_B_T, group_ids=group_ids)
    weighted_B_T = advantages_B_T * difficulty_B[:, None]
    return weighted_B_T, weighted_B_T


def difficulty(session, batch):
    """Larger for larger first operands, per sample."""
    return torch.tensor([1.0 + example["a"] / 100 for example in batch["example"]])


rl.algorithms.register_advantage_input("difficulty", "difficulty_B", difficulty)


def test_an_advantage_input_from_outside_reaches_the_estimator(tiny_dir):
    algorithm = rl.algorithms.get("grpo").replace(name="difficulty_grpo", advantage=weighted_grpo)
    assert algorithm.inputs == ["group_ids", "difficulty"]
    with rl.Session(**SETTINGS | dict(algorithm=algorithm)) as s:
        batch = s.advantage(s.score(s.rollout()))
        weights_B = difficulty(s, batch)
        assert len(set(weights_B.tolist())) > 1  # a weight that varies: not one scale of every advantage
        assert_same(batch["difficulty"], weights_B)
        plain_B_T, _ = rl.algorithms.advantage_fn("grpo")(batch["token_rewards"], batch["response_mask"].float(),
                                                          group_ids=batch["group_ids"])
        assert_same(batch["advantages"], plain_B_T * weights_B[:, None])
        row = s.step()
        assert row["step"] == 0 and s.last_batch["difficulty"].shape == (len(s.last_batch),)


def test_an_input_cannot_take_a_column_or_keyword_that_is_another_inputs():
    with pytest.raises(ValueError, match=r"advantage input 'values' -> 'my_values_B'"):
        rl.algorithms.register_advantage_input("values", "my_values_B", difficulty)
    with pytest.raises(ValueError, match=r"advantage input 'mine' -> 'group_ids'"):
        rl.algorithms.register_advantage_input("mine", "group_ids", difficulty)


def test_the_built_in_modes_are_settings_that_set_the_flat_fields():
    cfg = rl.config.make_config(rollout=rl.Async(max_staleness=2, workers=3))
    assert (cfg.rollout_mode, cfg.max_staleness, cfg.rollout_workers) == ("async", 2, 3)
    assert rl.config.make_config(rollout=rl.Overlap()).overlap_rollout
    record = rl.config.make_config(rollout=rl.Async(max_staleness=2)).to_record()
    assert record["rollout"] is None and record["rollout_mode"] == "async"  # a checkpoint restores it as it was
    restored = rl.Config.from_record(record)
    assert (restored.rollout_mode, restored.max_staleness) == ("async", 2)
    with pytest.raises(ValueError, match=r"rollout=Overlap\(\) and rollout_mode='async' disagree"):
        rl.config.make_config(rollout=rl.Overlap(), rollout_mode="async")
    with pytest.raises(ValueError, match=r"rollout='async' is not a rollout mode: rl.Sync\(\)"):
        rl.config.make_config(rollout="async")
