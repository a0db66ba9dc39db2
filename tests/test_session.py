import dataclasses
import json
import shutil

import pandas as pd
import pytest
import torch
from floats import assert_close

import rlbench as rl
from rlbench.rewards import RewardError
from rlbench.runs.sinks import read_jsonl

SMALL = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline",
             prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8)


@pytest.fixture(scope="module")
def session(tiny_dir):
    return rl.Session(**SMALL, seed=0)


def test_the_repr_names_the_sampler_and_the_handle_says_why(session):
    assert repr(session).startswith("Session(model='tiny-arith', task='arithmetic', algorithm='grpo', "
                                    "cluster='inline', sampler='hf', step=")
    usable, why_not = rl.samplers.vllm.available()  # on a CPU "auto" takes hf either way
    assert session.sampler.why == ("on CPU the hf sampler is faster (benchmarks/vllm_sampler.py)" if usable else why_not)


def test_stages_one_by_one(session):
    batch = session.rollout()
    assert len(batch) == 16
    assert {"prompt", "completion", "response_ids", "sampler_logp", "group_ids"} <= set(batch.columns)
    assert batch["group_ids"].tolist() == [g for g in range(4) for _ in range(4)]
    assert "Batch(16 rows" in repr(batch) and isinstance(batch.to_pandas(), pd.DataFrame)

    batch = session.score(batch)
    for row in batch:  # the arithmetic reward, worked out here: exact answer, then EOS
        expected = float(row["completion"] == row["example"]["answer"] and bool(row["finished"]))
        assert float(row["reward"]) == expected and row["reward_error"] is None

    batch = session.advantage(batch)
    mask = batch["response_mask"].float()
    assert_close(batch["old_logp"], batch["sampler_logp"], atol=1e-5)  # 1e-5: a decode loop vs a forward
    adv_B = batch["advantages"].sum(-1) / mask.sum(-1)  # GRPO: one advantage per sample, on every token
    for g in range(4):  # zero mean within each group
        assert abs(float(adv_B[batch["group_ids"] == g].mean())) < 1e-5
    assert (batch["advantages"] * (1 - mask)).abs().sum() == 0
    assert "ref_logp" in batch  # grpo declares a KL to the reference

    stats = session.update(batch)
    assert {"loss", "pg_loss", "kl_loss", "entropy", "grad_norm", "lr"} <= set(stats)
    # float32 values as their shortest decimals (0.36, not 0.36000001430511475), which have at most 9 digits
    assert all(value == float(f"{value:.9g}") for value in stats.values()), stats
    assert session.step_count == 1 and session.metrics["step"].tolist() == [0]  # an update by hand is a step
    assert session.history[0]["loss"] == stats["loss"] and session.history[0]["time_rollout"] > 0
    with pytest.raises(ValueError, match=r"update: this batch already trained the policy, at step 0: training on it "
                                         r"again is another epoch .* pass again=True"):
        session.update(batch)  # the cell run twice
    with pytest.raises(ValueError, match="already trained the policy, at step 0"):
        session.update(session.advantage(batch))  # advantages again: the same samples
    session.update(batch, again=True)
    assert session.step_count == 2


def test_run_metrics_and_evaluate(session):
    first = session.step_count  # (the module's session: the steps by hand before)
    metrics = session.run(steps=2, progress=False)
    expected = {"step", "reward_mean", "accuracy", "loss", "kl_loss", "entropy", "grad_norm", "response_length",
                "sampler_mismatch_mean", "time_rollout", "time_score", "time_advantage", "time_update", "time_sync"}
    assert expected <= set(metrics.columns) and metrics["step"].tolist() == list(range(first + 2))
    assert metrics["sampler_mismatch_max"].max() < 1e-4  # the weight sync worked
    result = session.evaluate(max_prompts=20)
    assert set(result) == {"greedy_accuracy", "sampled_accuracy", "greedy_reward", "sampled_reward"}
    assert all(0.0 <= v <= 1.0 for v in result.values())
    # a share of 20 greedy answers is k/20 exactly (0.35, not float32's 0.3499999940395355)
    assert result["greedy_accuracy"] == round(result["greedy_accuracy"] * 20) / 20


def test_rollout_correction_rejected_tokens_get_no_advantage(tiny_dir):
    # a k1 band ρ ∈ [1/2, 2] per token; the sampler's log-prob of every even position is raised by 1 (ρ = e^-1):
    # those tokens leave the mask before the advantages are computed, so they get none
    correction = rl.algorithms.RolloutCorrection(mode=None, reject=rl.algorithms.Rejection("k1", "token", high=2.0))
    with rl.Session(**SMALL | dict(algorithm=rl.algorithms.get("grpo").replace(correction=correction))) as s:
        batch = s.score(s.rollout())
        even_T = (torch.arange(batch["sampler_logp"].shape[1]) % 2 == 0).float()
        reward_B = (torch.arange(len(batch)) % 2).float()  # scores 0, 1, 0, 1 in every group of 4
        batch = s.advantage(batch.with_columns(sampler_logp=batch["sampler_logp"] + even_T, reward=reward_B))
    kept_B_T = batch["response_mask"].float() * (1 - even_T)
    assert_close(batch["loss_mask"], kept_B_T)
    assert batch.meta["correction/rejected_frac"] > 0.3
    assert (batch["advantages"] * (1 - kept_B_T)).abs().sum() == 0
    # GRPO: mean 0.5, unbiased std 0.57735 -> ±0.866025 on every kept token
    advantages = batch["advantages"][kept_B_T.bool()]
    assert_close(advantages.abs(), torch.full_like(advantages, 0.866025))


def test_callbacks_stop_and_jsonl_log(tiny_dir, tmp_path):
    s = rl.Session(**SMALL, log_dir=str(tmp_path / "logs"), run_name="r1")
    seen = []

    def stop_after_two(session, row):
        seen.append(row["step"])
        if row["step"] == 1:
            session.request_stop()

    s.callbacks.append(stop_after_two)
    metrics = s.run(steps=10, progress=False)
    assert seen == [0, 1] and len(metrics) == 2  # stopped cleanly after the step in progress
    logged = read_jsonl(tmp_path / "logs" / "r1" / "metrics.jsonl")
    pd.testing.assert_frame_equal(logged, metrics)
    s.run(steps=1, progress=False)  # a new run() starts fresh
    assert len(read_jsonl(tmp_path / "logs" / "r1" / "metrics.jsonl")) == 3


def test_same_seed_same_run(tiny_dir):
    runs = []
    for _ in range(2):
        s = rl.Session(**SMALL, seed=3)
        runs.append(s.run(steps=2, progress=False).drop(columns=[c for c in s.metrics if c.startswith("time_")]))
    pd.testing.assert_frame_equal(runs[0], runs[1])


@pytest.mark.slow
def test_grpo_learns_arithmetic(tiny_dir):
    s = rl.Session(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", seed=0,
                   prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8, lr=1e-4, threads=1)
    before = s.evaluate()["greedy_accuracy"]
    metrics = s.run(steps=100, progress=False)
    after = s.evaluate()["greedy_accuracy"]
    assert metrics["reward_mean"][-25:].mean() > metrics["reward_mean"][:25].mean() + 0.03
    assert after > before + 0.1, (before, after)


@pytest.mark.parametrize("field, value, valid", [
    ("model", "tiny-arithh", "tiny-arith"),
    ("task", "arithmatic", "arithmetic"),
    ("algorithm", "grpoo", "grpo"),
])
def test_unknown_names_list_the_valid_ones(field, value, valid):
    with pytest.raises(ValueError, match=valid):
        rl.Session(**(SMALL | {field: value}))


@pytest.mark.parametrize("field, value", [
    ("prompts_per_step", 0), ("samples_per_prompt", 0), ("lr", -1e-3), ("max_new_tokens", -1),
    ("micro_batch_tokens", 0), ("top_p", 0.0), ("cluster", "slurm"),
    ("mini_batches_per_step", 3),  # does not divide 4 x 4 samples
    ("micro_batch_tokens", 8),  # cannot hold one sequence (1 prompt token + 8 new tokens at least)
    ("save_every", -1), ("keep_last", -1), ("max_skipped_updates", -1), ("placement", "spread"),
])
def test_nonsense_sizes_raise_before_any_work(monkeypatch, field, value):
    def no_work(*args, **kwargs):
        raise AssertionError("a model was resolved before the configuration was checked")
    monkeypatch.setattr(rl.models, "resolve", no_work)
    with pytest.raises(ValueError, match=field):
        rl.Session(**(SMALL | {field: value}))


def test_a_missing_model_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path / 'missing'} does not exist"):
        rl.Session(**(SMALL | dict(model=str(tmp_path / "missing"))))


@pytest.mark.parametrize("token", ["eos", "pad"])
def test_a_tokenizer_without_eos_or_pad_is_named(tiny_dir, tmp_path, token):
    shutil.copytree(tiny_dir, tmp_path / "model")
    config_file = tmp_path / "model" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config[f"{token}_token"] = None
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"the tokenizer of {tmp_path / 'model'} has no {token} token"):
        rl.Session(**(SMALL | dict(model=str(tmp_path / "model"))))


@pytest.mark.parametrize("bad, message", [
    ({"answer": "3"}, r"train example 1 of task 'rows': no 'prompt' field \(has: \['answer'\]\)"),
    ({"prompt": "  ", "answer": "3"}, r"train example 1 of task 'rows': an empty prompt"),
    ({"prompt": [], "answer": "3"}, r"train example 1 of task 'rows': a prompt needs at least one chat message"),
    ({"prompt": None, "answer": "3"}, r"train example 1 of task 'rows': a prompt is a string or a list"),
])
def test_bad_examples_are_named_by_split_and_position(bad, message):
    good = {"prompt": "1+2=", "answer": "3"}
    task = rl.tasks.DataTask("rows", train=(good, bad, good), test=(good,), reward=lambda c, e: 0.0)
    with pytest.raises(ValueError, match=message):
        rl.Session(**(SMALL | dict(task=task)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_named():
    with pytest.raises(ValueError, match="device='cuda' but torch sees no CUDA GPU"):
        rl.Session(**(SMALL | dict(device="cuda")))


def test_unknown_argument_is_named():
    with pytest.raises(TypeError, match="promts_per_step"):
        rl.Session(promts_per_step=4)


@dataclasses.dataclass
class FlakyArithmetic:
    """The arithmetic task with a reward that fails on prompts whose first operand is even."""
    name: str = "flaky"
    truncated_reward: float | None = None

    def __post_init__(self):
        base = rl.tasks.get("arithmetic")
        self.train, self.test = base.train, base.test

    def reward(self, completion, example):
        if example["a"] % 2 == 0:
            raise ZeroDivisionError("even operand")
        return float(completion == example["answer"])


def test_reward_failures_are_recorded_or_raised(tiny_dir):
    s = rl.Session(**(SMALL | {"task": FlakyArithmetic(), "on_reward_error": "zero"}))
    batch = s.score(s.rollout())
    for row in batch:
        if row["example"]["a"] % 2 == 0:
            assert row["reward_error"] == "ZeroDivisionError: even operand" and float(row["reward"]) == 0.0
        else:
            assert row["reward_error"] is None
    s = rl.Session(**(SMALL | {"task": FlakyArithmetic()}))
    with pytest.raises(RewardError, match=r"sample \d+ .*even operand"):
        for _ in range(5):  # some step draws an even operand
            s.score(s.rollout())


@pytest.mark.parametrize("algorithm", ["grpo", "remax"])
def test_tokens_generated_counts_every_rollout_of_the_step(algorithm):
    with rl.Session(**(SMALL | dict(algorithm=algorithm, threads=1))) as s:
        row = s.step()
        sampled = int(s.last_batch["response_mask"].sum())
        if algorithm == "grpo":
            assert row["tokens_generated"] == sampled
        else:  # ReMax also decodes each prompt's greedy baseline: between 1 and max_new_tokens tokens each
            prompts = SMALL["prompts_per_step"]
            assert sampled + prompts <= row["tokens_generated"] <= sampled + prompts * SMALL["max_new_tokens"]


def test_a_mini_batch_whose_old_logp_equals_the_sampler_s_bitwise_is_no_special_case(tiny_dir):
    """Sync GRPO recomputes old_logp; where a mini-batch's happens to equal sampler_logp bit for bit (seen on
    countdown), the update used to take it for an overlap batch, report the mismatch for that mini-batch only and
    fail averaging the steps' metrics (KeyError). Whether old_logp is the sampler's is the batch's meta now."""
    s = rl.Session(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", prompts_per_step=4,
                   samples_per_prompt=4, max_new_tokens=8, mini_batches_per_step=2, threads=1, seed=0, log_dir=None)
    batch = s.advantage(s.score(s.rollout()))
    assert "old_logp_is_sampler" not in batch.meta
    old_logp = batch["old_logp"].clone()
    old_logp[:8] = batch["sampler_logp"][:8]  # the first mini-batch: equal bit for bit
    stats = s.update(batch.with_columns(old_logp=old_logp))
    assert not any(k.startswith("sampler_") for k in stats)  # the step's row measures the mismatch, from the batch


def test_an_overlap_batch_says_its_old_logp_is_the_sampler_s(tiny_dir):
    s = rl.Session(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", prompts_per_step=4,
                   samples_per_prompt=4, max_new_tokens=8, mini_batches_per_step=2, threads=1, seed=0, log_dir=None,
                   rollout_mode="overlap")
    batch = s.advantage(s.score(s.rollout()))
    assert batch.meta["old_logp_is_sampler"] and torch.equal(batch["old_logp"], batch["sampler_logp"])
    stats = s.update(batch)
    assert {"sampler_mismatch_mean", "sampler_kl"} <= stats.keys()  # every mini-batch's forward measured it


def test_an_update_that_failed_midway_leaves_no_gradient_for_the_next(tiny_dir):
    # the attack: an error in the loss (a user's algorithm, an out-of-memory) stopped an update between micro-batches
    # and left their gradients in .grad: the next update added them to its own, with no warning
    settings = SMALL | dict(model=tiny_dir, micro_batch_tokens=16, log_dir=None)
    with rl.Session(**settings) as broken, rl.Session(**settings) as twin:
        batch, twin_batch = broken.advantage(broken.score(broken.rollout())), twin.advantage(twin.score(twin.rollout()))
        spread = torch.linspace(-1, 1, batch["advantages"].numel()).view_as(batch["advantages"])  # every token counts
        batch, twin_batch = batch.with_columns(advantages=spread), twin_batch.with_columns(advantages=spread)
        policy = broken.policy.workers.hosts[0].objects["policy"]
        real_loss, calls = policy._micro_loss, []

        def fails_on_the_third_micro_batch(*args, **kwargs):  # (a stand-in for a loss that raises)
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("the loss failed")
            return real_loss(*args, **kwargs)

        policy._micro_loss = fails_on_the_third_micro_batch
        with pytest.raises(RuntimeError, match="the loss failed"):
            broken.update(batch)
        del policy._micro_loss
        assert any(p.grad is not None for p in policy.model.parameters())  # what the failed update left
        assert broken.update(batch)["grad_norm"] == twin.update(twin_batch)["grad_norm"]
        after, expected = broken.policy.state_dict(), twin.policy.state_dict()
        assert all(torch.equal(after[k], expected[k]) for k in expected)
