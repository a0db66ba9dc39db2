"""The data contract between the session and an algorithm: an estimator or loss receives only the data
keywords it declares; a reward's components reach the estimators that ask for them."""

import pytest
import torch
from floats import approx, assert_same

import rlbench as rl
from rlbench.tasks import DataTask

SMALL = dict(model="tiny-arith", prompts_per_step=4, samples_per_prompt=8, max_new_tokens=8, cluster="inline",
             seed=0, log_dir=None, temperature=1.5)


def two_components(completion: str, example: dict) -> dict:
    """Two components on different scales: the answer (0 / 1) and a length preference (0 .. 5)."""
    acc = float(completion == example["answer"])
    brevity = 5.0 - min(len(completion), 5)
    return {"score": acc + brevity, "acc": acc, "brevity": brevity}


def two_component_task() -> DataTask:
    arithmetic = rl.tasks.get("arithmetic")
    return DataTask(name="two-components", train=arithmetic.train, test=arithmetic.test, reward=two_components)


def test_gdpo_in_a_session_normalises_the_tasks_components_separately():
    gdpo = rl.algorithms.get("grpo").replace(name="gdpo-test", advantage="gdpo", kl_coef=0.0)
    grpo = rl.algorithms.get("grpo").replace(kl_coef=0.0)
    with rl.Session(**SMALL, task=two_component_task(), algorithm=gdpo) as s:
        scored = s.score(s.rollout())
        assert scored.meta["reward_components"] == ["acc", "brevity"]
        batch = s.advantage(scored)
        mask_B_T = batch["response_mask"].float()
        rewards_B_T = rl.algorithms.outcome_rewards(batch["reward"], mask_B_T)
        components_B_K = torch.stack([batch["acc"], batch["brevity"]], -1)
        assert components_B_K.std(0).gt(0).all()  # both components vary in this batch
        expected, _ = rl.algorithms.advantage_fn("gdpo")(rewards_B_T, mask_B_T, group_ids=batch["group_ids"],
                                                        reward_components_B_K=components_B_K)
        assert_same(batch["advantages"], expected)  # bit for bit: the session calls this same function
        summed, _ = rl.algorithms.advantage_fn("gdpo")(rewards_B_T, mask_B_T, group_ids=batch["group_ids"])
        assert not torch.allclose(batch["advantages"], summed, atol=1e-3)  # not GDPO on the summed score
        grpo_advantages, _ = grpo.estimate(rewards_B_T, mask_B_T, group_ids=batch["group_ids"])
        assert not torch.allclose(batch["advantages"], grpo_advantages, atol=1e-3)


def test_an_estimator_gets_only_the_keywords_it_declares():
    seen = {}

    def mean_baseline(rewards_B_T, mask_B_T, *, group_ids):
        seen["group_ids"] = group_ids
        score_B = rewards_B_T.sum(-1)
        return (score_B - score_B.mean())[:, None] * mask_B_T, rewards_B_T

    algorithm = rl.algorithms.get("grpo").replace(name="mean-baseline", advantage=mean_baseline, kl_coef=0.0)
    with rl.Session(**SMALL, algorithm=algorithm) as s:
        row = s.step()
    assert len(seen["group_ids"]) == 32 and row["advantage_abs_mean"] >= 0
    with pytest.raises(TypeError, match="unknown advantage data"):
        algorithm.estimate(torch.zeros(2, 3), torch.ones(2, 3), group_ids=[0, 0], rewards=None)


def test_a_loss_without_weights_cannot_take_rollout_correction():
    def plain(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T):
        return -advantages_B_T * rl.algorithms.ratio(logp_B_T, old_logp_B_T), {}

    mine = rl.algorithms.get("grpo").replace(name="plain", loss=plain)
    assert mine.actor_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                           ref_logp_B_T=torch.zeros(1, 2))[0].item() == approx(-1.0)
    with pytest.raises(ValueError, match="takes no weights_B_T"):
        mine.replace(correction=rl.algorithms.RolloutCorrection())


def test_ratio_is_the_clamped_exponent():
    logp = torch.tensor([0.0, -1.0, 50.0])
    old = torch.tensor([0.0, 0.0, 0.0])
    assert rl.algorithms.ratio(logp, old).tolist() == approx([1.0, 0.36787944, float(torch.tensor(20.0).exp())])
