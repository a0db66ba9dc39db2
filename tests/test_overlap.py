"""rollout_mode="overlap": the next batch is sampled during the update, by the weights before it (one step off-policy)."""

import dataclasses

import pytest
import torch
from floats import approx

import rlbench as rl
from rlbench.policy import Policy
from rlbench.policy.training import OptimSettings

SMALL = dict(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", prompts_per_step=4,
             samples_per_prompt=4, max_new_tokens=8, threads=1, log_dir=None)


def test_each_batch_was_sampled_by_the_weights_before_the_previous_update(tiny_dir):
    with rl.Session(**SMALL, seed=1, lr=1e-3, rollout_mode="overlap") as s:
        s.step()
        after_first = {k: v.clone() for k, v in s.policy.state_dict().items()}
        s.step()
        batch = s.last_batch  # trained on by the second update, sampled while the first one ran
    assert torch.equal(batch["old_logp"], batch["sampler_logp"])  # PPO's old policy: the one that sampled
    initial, first = (Policy(tiny_dir, OptimSettings(lr=1e-3)) for _ in range(2))
    first.model.load_state_dict(after_first)
    mask = batch["response_mask"].bool()
    assert (initial.log_probs(batch) - batch["sampler_logp"])[mask].abs().max() < 1e-4
    assert (first.log_probs(batch) - batch["sampler_logp"])[mask].abs().max() > 1e-2  # not the first update's


def test_overlapped_training_learns(tiny_dir):
    algorithm = rl.algorithms.get("grpo").replace(kl_coef=0.0)
    with rl.Session(**SMALL | dict(prompts_per_step=16, samples_per_prompt=8, algorithm=algorithm), seed=0,
                    rollout_mode="overlap") as s:
        before = s.evaluate()["greedy_accuracy"]
        metrics = s.run(100, progress=False)
        after = s.evaluate()["greedy_accuracy"]
    assert after > before + 0.1, (before, after)
    assert metrics["clip_frac"].gt(0).any()  # the ratio to the sampling weights is not identically 1


@dataclasses.dataclass
class Breakable:
    """The arithmetic task, whose reward raises while `broken`."""
    name: str = "breakable"
    truncated_reward: float | None = None
    broken: bool = False

    def __post_init__(self):
        base = rl.tasks.get("arithmetic")
        self.train, self.test = base.train, base.test

    def reward(self, completion, example):
        if self.broken:
            raise ConnectionError("reward server down")
        return float(completion == example["answer"])


def test_a_failed_background_rollout_surfaces_at_the_next_step_and_loses_no_update():
    task = Breakable()
    with rl.Session(**SMALL | dict(task=task), seed=0, rollout_mode="overlap") as s:
        s.step()
        task.broken = True
        s.step()  # its update ran; the batch sampled meanwhile could not be scored
        assert s.step_count == 2 and len(s.metrics) == 2
        with pytest.raises(rl.rewards.RewardError, match="reward server down"):
            s.step()
        assert s.step_count == 2
        task.broken = False
        s.step()  # samples afresh
        assert s.metrics["step"].tolist() == [0, 1, 2]


def test_overlap_and_on_policy_old_logp_exclude_each_other():
    with pytest.raises(ValueError, match="rollout_mode='overlap' trains on batches sampled by older weights"):
        rl.config.make_config(on_policy_old_logp=True, overlap_rollout=True)


def test_with_rollout_correction_old_logp_is_the_policy_and_the_weights_carry_the_lag(tiny_dir):
    algorithm = rl.algorithms.get("grpo").replace(correction=rl.algorithms.RolloutCorrection(level="token", mode="tis"))
    with rl.Session(**SMALL | dict(algorithm=algorithm), seed=1, lr=1e-3, rollout_mode="overlap") as s:
        first = s.step()
        second = s.step()
        batch = s.last_batch
    mask = batch["response_mask"].bool()
    # step 0 trains on the first weights' own samples; step 1 on samples of the weights before its update
    assert first["correction/weight_mean"] == approx(1.0, abs=1e-4)  # 1e-4: sampler and trainer differ by kernels
    assert (batch["old_logp"] - batch["sampler_logp"])[mask].abs().max() > 1e-2
    assert (batch["correction_weights"][mask] - 1).abs().max() > 1e-2 and second["correction/weight_mean"] != 1.0


def test_inline_the_next_rollout_starts_at_the_backward(monkeypatch):
    # in one process the sampler's small ops and the forward's would contend for the GIL; the backward releases it
    events = []
    real_backward = rl.policy.fsdp.backward
    monkeypatch.setattr(rl.policy.fsdp, "backward", lambda *args: (events.append("backward"), real_backward(*args)))
    with rl.Session(**SMALL, seed=0, rollout_mode="overlap") as s:
        real_rollout = s.rollout
        monkeypatch.setattr(s, "rollout", lambda: (events.append("rollout"), real_rollout())[1])
        s.step()
        s.step()
        assert s.policy.workers.hosts[0].objects["policy"].before_backward is None  # the hook is gone between steps
    assert events == ["rollout", "backward", "rollout", "backward", "rollout"]


def test_restored_without_overlap_the_next_step_samples_afresh(tmp_path):
    with rl.Session(**SMALL, seed=2, lr=1e-3, rollout_mode="overlap") as s:
        s.step()
        folder = s.save(tmp_path)
    assert (folder / "next_batch.pt").is_file()
    with rl.Session.restore(folder, overlap_rollout=False) as r:
        r.step()
        batch = r.last_batch  # sampled by the restored weights, so on-policy: old_logp is the sampler's to float
    mask = batch["response_mask"].bool()
    assert (batch["old_logp"] - batch["sampler_logp"])[mask].abs().max() < 1e-4


def test_overlap_rollout_is_the_former_name_of_rollout_mode_overlap():
    assert rl.config.make_config(overlap_rollout=True).rollout_mode == "overlap"
    assert rl.config.make_config(rollout_mode="overlap").overlap_rollout
    record = rl.config.make_config(rollout_mode="overlap").to_record()
    assert rl.Config.from_record(record, overlap_rollout=False).rollout_mode == "sync"
    assert rl.Config.from_record(record, rollout_mode="async").overlap_rollout is False
