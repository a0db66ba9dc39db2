"""Advantage estimators on tiny hand-worked batches (docs/algorithms.md, advantage estimators)."""

import math

import pytest
import torch
from floats import assert_close

from rlbench.algorithms import advantage_fn


def outcome(scores, lengths, T=3):
    """Token-level rewards with each score on the last valid token, and the mask."""
    mask_B_T = (torch.arange(T) < torch.tensor(lengths)[:, None]).float()
    rewards_B_T = torch.zeros(len(scores), T)
    rewards_B_T[torch.arange(len(scores)), torch.tensor(lengths) - 1] = torch.tensor(scores, dtype=torch.float32)
    return rewards_B_T, mask_B_T


# Group 7: scores 1, 0, 2 (lengths 3, 2, 1); group 9: a group of one, score 5.
REWARDS_B_T, MASK_B_T = outcome([1.0, 0.0, 2.0, 5.0], [3, 2, 1, 3])
GROUPS_B = torch.tensor([7, 7, 7, 9])


def per_token(adv_B):
    return torch.tensor(adv_B).unsqueeze(-1) * MASK_B_T


def test_grpo():
    # group 7: mean 1, unbiased std sqrt((0 + 1 + 1)/2) = 1 -> (s - 1)/(1 + 1e-6) = [0, -1, 1]
    # group of one: mean 0, std 1 -> 5/(1 + 1e-6)
    adv_B_T, returns_B_T = advantage_fn("grpo")(REWARDS_B_T, MASK_B_T, group_ids=GROUPS_B)
    assert_close(adv_B_T, per_token([0.0, -1.0, 1.0, 5.0]) / (1 + 1e-6))
    assert_close(returns_B_T, adv_B_T)
    assert (adv_B_T[MASK_B_T == 0] == 0).all()


def test_grpo_without_std_is_dr_grpo():
    adv_B_T, _ = advantage_fn("grpo")(REWARDS_B_T, MASK_B_T, group_ids=GROUPS_B, norm_by_std=False)
    assert_close(adv_B_T, per_token([0.0, -1.0, 1.0, 5.0]))  # s - mean_g


def test_grpo_equal_scores_give_zero():
    rewards_B_T, mask_B_T = outcome([1.0, 1.0], [2, 3])
    adv_B_T, _ = advantage_fn("grpo")(rewards_B_T, mask_B_T, group_ids=torch.tensor([0, 0]))
    assert (adv_B_T == 0).all()  # (1 - 1)/(0 + 1e-6)


def test_rloo():
    # group 7: s_i - mean of the others: 1 - (0+2)/2 = 0, 0 - (1+2)/2 = -1.5, 2 - (1+0)/2 = 1.5
    # group of one: s_i = 5
    adv_B_T, _ = advantage_fn("rloo")(REWARDS_B_T, MASK_B_T, group_ids=GROUPS_B)
    assert_close(adv_B_T, per_token([0.0, -1.5, 1.5, 5.0]))


def test_reinforce_plus_plus_baseline():
    # groups {1, 0} and {3, 1}: a = [0.5, -0.5, 1, -1]; lengths 1, 2, 1, 2 -> 6 tokens:
    # 0.5 | -0.5 -0.5 | 1 | -1 -1 ; mean -0.25 ; deviations .75 -.25 -.25 1.25 -.75 -.75
    # unbiased var = (0.5625 + 2·0.0625 + 1.5625 + 2·0.5625)/5 = 0.675 ; std 0.821584
    rewards_B_T, mask_B_T = outcome([1.0, 0.0, 3.0, 1.0], [1, 2, 1, 2], T=2)
    estimator = advantage_fn("reinforce_plus_plus_baseline")
    adv_B_T, _ = estimator(rewards_B_T, mask_B_T, group_ids=torch.tensor([0, 0, 1, 1]))
    std = math.sqrt(0.675)
    expected_B_T = torch.tensor([[0.75, 0.0], [-0.25, -0.25], [1.25, 0.0], [-0.75, -0.75]]) / std
    assert_close(adv_B_T, expected_B_T)


def test_reinforce_plus_plus_masked_token_carries_return():
    # γ = 0.5, reward 2 on the last token, middle token masked:
    # t2: G = 2 ; t1 (masked): carries G = 2 undiscounted, stores 0 ; t0: G = 0 + 0.5·2 = 1
    # whiten over valid [1, 2]: mean 1.5, unbiased std sqrt(0.5) -> [-1/√2, 0, 1/√2]
    rewards_B_T = torch.tensor([[0.0, 0.0, 2.0]])
    mask_B_T = torch.tensor([[1, 0, 1]])
    adv_B_T, returns_B_T = advantage_fn("reinforce_plus_plus")(rewards_B_T, mask_B_T, gamma=0.5)
    assert_close(returns_B_T, torch.tensor([[1.0, 0.0, 2.0]]))
    assert_close(adv_B_T, torch.tensor([[-1.0, 0.0, 1.0]]) / math.sqrt(2))


def test_remax():
    # reward-to-go G: row 0 [1, 1, 1], row 1 [2, 2, 0 (masked)] ; minus greedy baselines 0.5 and 1
    rewards_B_T = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask_B_T = torch.tensor([[1, 1, 1], [1, 1, 0]])
    baselines_B = torch.tensor([0.5, 1.0])
    adv_B_T, returns_B_T = advantage_fn("remax")(rewards_B_T, mask_B_T, baselines_B=baselines_B)
    assert_close(adv_B_T, torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]]))
    assert_close(returns_B_T, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    with pytest.raises(ValueError, match="baselines_B"):
        advantage_fn("remax")(rewards_B_T, mask_B_T)


def test_gpg():
    # scores [1, 0 | 0, 0]: group means 0.5 and 0 ; one non-zero score of 4 -> α = 4/1
    # A = 4·[0.5, -0.5, 0, 0]
    rewards_B_T, mask_B_T = outcome([1.0, 0.0, 0.0, 0.0], [1, 1, 1, 1], T=1)
    adv_B_T, _ = advantage_fn("gpg")(rewards_B_T, mask_B_T, group_ids=torch.tensor([0, 0, 1, 1]))
    assert_close(adv_B_T, torch.tensor([[2.0], [-2.0], [0.0], [0.0]]))


def test_opo_length_weighted_baseline():
    # group 0: scores 1, 0, 1 with lengths 1, 3, 2 -> baseline (1·1 + 3·0 + 2·1)/6 = 0.5
    # group 1 (one sample): baseline 0 -> A = 2
    rewards_B_T, mask_B_T = outcome([1.0, 0.0, 1.0, 2.0], [1, 3, 2, 2])
    adv_B_T, _ = advantage_fn("opo")(rewards_B_T, mask_B_T, group_ids=torch.tensor([0, 0, 0, 1]))
    assert_close(adv_B_T, torch.tensor([0.5, -0.5, 0.5, 2.0]).unsqueeze(-1) * mask_B_T)


def test_grpo_passk_rewards_only_the_best():
    # group 0: scores 3, 1, 2: best 3, runner-up 2, std([3,1,2]) = 1 -> A_best = 1/(1 + 1e-6)
    # group 1: tie 0.5, 0.5 -> margin 0
    rewards_B_T, mask_B_T = outcome([3.0, 1.0, 2.0, 0.5, 0.5], [1] * 5, T=1)
    groups_B = torch.tensor([0, 0, 0, 1, 1])
    adv_B_T, _ = advantage_fn("grpo_passk")(rewards_B_T, mask_B_T, group_ids=groups_B)
    assert_close(adv_B_T.squeeze(-1), torch.tensor([1 / (1 + 1e-6), 0, 0, 0, 0]))
    adv_B_T, _ = advantage_fn("grpo_passk")(rewards_B_T, mask_B_T, group_ids=groups_B, norm_by_std=False)
    assert_close(adv_B_T.squeeze(-1), torch.tensor([1.0, 0, 0, 0, 0]))


def test_grpo_passk_rejects_group_of_one():
    with pytest.raises(ValueError, match="at least 2"):
        advantage_fn("grpo_passk")(REWARDS_B_T, MASK_B_T, group_ids=GROUPS_B)


def test_gae_skips_masked_tokens():
    # γ = 0.9, λ = 0.5, V = [0.5, 0.2, 0.4], reward 1 on the last token, middle token masked
    # t2: δ = 1 + 0 - 0.4 = 0.6, Â = 0.6
    # t1: masked, carries V_next = 0.4 and Â = 0.6
    # t0: δ = 0 + 0.9·0.4 - 0.5 = -0.14, Â = -0.14 + 0.9·0.5·0.6 = 0.13
    # returns = Â + V on valid tokens = [0.63, 0, 1.0] ; whitened [0.13, 0.6] = [-1/√2, 1/√2]
    rewards_B_T = torch.tensor([[0.0, 0.0, 1.0]])
    values_B_T = torch.tensor([[0.5, 0.2, 0.4]])
    mask_B_T = torch.tensor([[1, 0, 1]])
    adv_B_T, returns_B_T = advantage_fn("gae")(
        rewards_B_T, mask_B_T, values_B_T=values_B_T, gamma=0.9, lam=0.5
    )
    assert_close(returns_B_T, torch.tensor([[0.63, 0.0, 1.0]]))
    assert_close(adv_B_T, torch.tensor([[-1.0, 0.0, 1.0]]) / math.sqrt(2), atol=1e-5)  # 1e-5: whitening's 1e-8
    with pytest.raises(ValueError, match="values_B_T"):
        advantage_fn("gae")(rewards_B_T, mask_B_T)


def test_gdpo_normalises_each_component():
    # groups [0, 0, 1, 1]; component 1 = [1, 0, 1, 1], component 2 = [0, 0, 2, 0], weights [1, 0.5]
    # grpo(c1) = [0.7071, -0.7071, 0, 0] (group 1 all equal) ; grpo(c2) = [0, 0, 0.7071, -0.7071]
    # sum = [0.7071, -0.7071, 0.3536, -0.3536] ; mean 0, unbiased var 1.25/3 -> / 0.645497
    components_B_K = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 2.0], [1.0, 0.0]])
    mask_B_T = torch.ones(4, 1)
    adv_B_T, _ = advantage_fn("gdpo")(
        components_B_K.sum(-1, keepdim=True), mask_B_T, group_ids=torch.tensor([0, 0, 1, 1]),
        reward_components_B_K=components_B_K, component_weights=[1.0, 0.5],
    )
    expected_B = torch.tensor([1.095445, -1.095445, 0.547723, -0.547723])
    assert_close(adv_B_T.squeeze(-1), expected_B, atol=1e-5)  # 1e-5: ε (1e-6) in the stds, left out by hand


def test_gdpo_without_components_is_whitened_grpo():
    grpo_B_T, _ = advantage_fn("grpo")(REWARDS_B_T, MASK_B_T, group_ids=GROUPS_B)
    gdpo_B_T, _ = advantage_fn("gdpo")(REWARDS_B_T, MASK_B_T, group_ids=GROUPS_B)
    valid_B_T = MASK_B_T.bool()
    white = (grpo_B_T[valid_B_T] - grpo_B_T[valid_B_T].mean()) / grpo_B_T[valid_B_T].std()
    assert_close(gdpo_B_T[valid_B_T], white, atol=1e-5)  # 1e-5: ε (1e-6) in GDPO's std, not in `white`


@pytest.mark.parametrize("name", ["grpo", "rloo", "gpg", "opo", "reinforce_plus_plus_baseline"])
def test_group_ids_are_any_integers(name):
    # relabelling groups (any ids, any order) does not change the advantages
    fn = advantage_fn(name)
    adv_B_T, _ = fn(REWARDS_B_T, MASK_B_T, group_ids=GROUPS_B)
    relabelled_B_T, _ = fn(REWARDS_B_T, MASK_B_T, group_ids=torch.tensor([-3, -3, -3, 1000]))
    assert_close(relabelled_B_T, adv_B_T)
