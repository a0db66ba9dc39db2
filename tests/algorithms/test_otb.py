"""Optimal Token Baseline and TIR-OTB (docs/algorithms.md; verl 0.9.1 docs/algo/otb.md) on hand-worked tensors."""

import pytest
import torch
from floats import approx, assert_close

from rlbench.algorithms import advantage_fn, get

# group 0: rows 0-2 (lengths 3, 2, 2; scores 1, 0, 1); group 7: row 3 alone (length 2, score 2)
MASK_B_T = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]]).float()
REWARDS_B_T = torch.tensor([[0, 0, 1.0], [0, 0, 0], [0, 1.0, 0], [0, 2.0, 0]])
GROUP_IDS = torch.tensor([0, 0, 0, 7])
# w = 1 - 2π + Σπ²:  row 0: π 0.5, Σπ² [0.5, 1, 0.5] -> w [0.5, 1, 0.5], W [0.5, 1.5, 2]
#                    row 1: π [0.5, 0.25], Σπ² [1, 0.5] -> w [1, 1], W [1, 2]
#                    row 2: π 0.5, Σπ² 0.5 -> w [0.5, 0.5], W [0.5, 1]      (row 3: any; its group has one)
PI_B_T = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.25, 0.5], [0.5, 0.5, 0.5], [0.3, 0.6, 0.5]])
SUM_PI2_B_T = torch.tensor([[0.5, 1.0, 0.5], [1.0, 0.5, 0.5], [0.5, 0.5, 0.5], [0.4, 0.7, 0.5]])
DATA = dict(group_ids=GROUP_IDS, old_logp_B_T=PI_B_T.log(), sum_pi2_B_T=SUM_PI2_B_T)


@pytest.mark.parametrize("name", ["otb", "tir_otb"])
def test_otb_hand_worked(name):
    # G: row 0 [1, 1, 1], row 1 [0, 0], row 2 [1, 1], row 3 [2, 2]
    # t0: B = (1·0.5 + 0·1 + 1·0.5) / (0.5 + 1 + 0.5) = 0.5
    # t1: B = (1·1.5 + 0·2 + 1·1) / (1.5 + 2 + 1) = 5/9
    # t2: row 0 alone, uniquely the longest (3 > 2): zero tail, B = 0 -> A = G = 1
    # row 3: a group of one, B = 0 -> A = G
    adv_B_T, returns_B_T = advantage_fn(name)(REWARDS_B_T, MASK_B_T, **DATA)
    expected = [[0.5, 4 / 9, 1.0], [-0.5, -5 / 9, 0.0], [0.5, 4 / 9, 0.0], [2.0, 2.0, 0.0]]
    assert_close(adv_B_T, torch.tensor(expected))
    assert_close(returns_B_T, torch.tensor([[1.0, 1, 1], [0, 0, 0], [1, 1, 0], [2, 2, 0]]))


def test_otb_without_zero_tail_the_lone_tail_has_no_advantage():
    # t2 of row 0: B = 1·2 / (2 + 1e-8) -> A = 1e-8 / 2 ≈ 0
    adv_B_T, _ = advantage_fn("otb")(REWARDS_B_T, MASK_B_T, **DATA, zero_tail=False)
    assert abs(adv_B_T[0, 2].item()) < 1e-6
    assert_close(adv_B_T[:, :2], torch.tensor([[0.5, 4 / 9], [-0.5, -5 / 9], [0.5, 4 / 9], [2.0, 2.0]]))


def test_otb_rollout_is_weights_enter_squared():
    # ρ̄ of row 1 = [2, 1]: its w = [1·4, 1·1] -> W [4, 5]; the other rows' ρ̄ = 1
    # t0: B = (0.5 + 0 + 0.5) / (0.5 + 4 + 0.5) = 0.2;   t1: B = (1.5 + 0 + 1) / (1.5 + 5 + 1) = 1/3
    weights_B_T = torch.ones(4, 3)
    weights_B_T[1, 0] = 2.0
    adv_B_T, _ = advantage_fn("otb")(REWARDS_B_T, MASK_B_T, **DATA, is_weights_B_T=weights_B_T)
    expected = [[0.8, 2 / 3, 1.0], [-0.2, -1 / 3, 0.0], [0.8, 2 / 3, 0.0], [2.0, 2.0, 0.0]]
    assert_close(adv_B_T, torch.tensor(expected))


def test_tir_otb_equals_otb_on_contiguous_masks():
    generator = torch.Generator().manual_seed(0)
    B, T = 8, 6
    lengths_B = torch.tensor([6, 3, 1, 5, 4, 6, 2, 6])
    mask_B_T = (torch.arange(T) < lengths_B[:, None]).float()
    rewards_B_T = torch.zeros(B, T)
    rewards_B_T[torch.arange(B), lengths_B - 1] = torch.rand(B, generator=generator)
    probs_B_T_V = torch.softmax(torch.randn(B, T, 5, generator=generator), -1)
    data = dict(group_ids=torch.tensor([3, 3, 3, 3, 8, 8, 8, 8]), old_logp_B_T=probs_B_T_V[..., 0].log(),
                sum_pi2_B_T=probs_B_T_V.square().sum(-1), is_weights_B_T=torch.rand(B, T, generator=generator) + 0.5)
    for zero_tail in (True, False):
        otb_B_T, otb_returns_B_T = advantage_fn("otb")(rewards_B_T, mask_B_T, **data, zero_tail=zero_tail)
        tir_B_T, tir_returns_B_T = advantage_fn("tir_otb")(rewards_B_T, mask_B_T, **data, zero_tail=zero_tail)
        assert otb_B_T.abs().sum() > 0
        assert_close(tir_B_T, otb_B_T)
        assert_close(tir_returns_B_T, otb_returns_B_T)


def test_tir_otb_aligns_the_kth_valid_tokens_on_a_holed_mask():
    # row 0 mask [1, 0, 1, 1] (3 valid tokens, score 1), row 1 [1, 1, 0, 0] (2, score 0); w = 1 - 0.5 + 0.5 = 1
    # TIR, compacted: W row 0 [1, 2, 3], row 1 [1, 2]; G row 0 [1, 1, 1], row 1 [0, 0]
    #   k0: B = (1·1 + 0·1) / 2 = 0.5;  k1: B = (1·2 + 0·2) / 4 = 0.5;  k2: row 0 alone, zero tail: B = 0
    #   -> row 0 [0.5, ., 0.5, 1] (its 2nd valid token sits at t2), row 1 [-0.5, -0.5, 0, 0]
    # OTB aligns raw positions (verl): W row 0 [1, 1, 2, 3], row 1 [1, 2, 2, 2]
    #   t0: B = 0.5;  t1: only row 1 valid: B = 0;  t2, t3: only row 0, zero tail from position 2 (its runner-up's
    #   length): B = 0  -> row 0 [0.5, ., 1, 1], row 1 [-0.5, 0, 0, 0]
    mask_B_T = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]]).float()
    rewards_B_T = torch.tensor([[0, 0, 0, 1.0], [0, 0, 0, 0]])
    data = dict(group_ids=torch.tensor([5, 5]), old_logp_B_T=torch.full((2, 4), 0.25).log(),
                sum_pi2_B_T=torch.full((2, 4), 0.5))
    tir_B_T, _ = advantage_fn("tir_otb")(rewards_B_T, mask_B_T, **data)
    assert_close(tir_B_T, torch.tensor([[0.5, 0.0, 0.5, 1.0], [-0.5, -0.5, 0.0, 0.0]]))
    otb_B_T, _ = advantage_fn("otb")(rewards_B_T, mask_B_T, **data)
    assert_close(otb_B_T, torch.tensor([[0.5, 0.0, 1.0, 1.0], [-0.5, 0.0, 0.0, 0.0]]))


def test_otb_names_the_missing_sum_pi2():
    with pytest.raises(ValueError, match=r"otb needs sum_pi2_B_T \(Σ_v π_v² per token"):
        advantage_fn("otb")(REWARDS_B_T, MASK_B_T, group_ids=GROUP_IDS, old_logp_B_T=PI_B_T.log())
    alg = get("grpo").replace(name="otb", advantage="tir_otb")  # the data reaches it through Algorithm.estimate
    adv_B_T, _ = alg.estimate(REWARDS_B_T, MASK_B_T, **DATA, is_weights_B_T=None, values_B_T=None)
    assert_close(adv_B_T[1], torch.tensor([-0.5, -5 / 9, 0.0]))


def test_sum_pi2_from_logits_hand_worked():
    # logits [0, ln 3]: π = [1/4, 3/4], Σπ² = 1/16 + 9/16 = 0.625; token 1: log 3/4
    from rlbench.algorithms import token_logp, token_logp_and_sum_pi2
    logits_B_T_V = torch.tensor([[[0.0, 3.0 ** 0.5], [0.0, float(torch.tensor(3.0).log())]]])
    ids_B_T = torch.tensor([[0, 1]])
    logp_B_T, sum_pi2_B_T = token_logp_and_sum_pi2(logits_B_T_V, ids_B_T)
    assert_close(logp_B_T, token_logp(logits_B_T_V, ids_B_T))
    assert_close(sum_pi2_B_T, torch.softmax(logits_B_T_V, -1).square().sum(-1))
    assert sum_pi2_B_T[0, 1].item() == approx(0.625) and logp_B_T[0, 1].exp().item() == approx(0.75)


def test_needs_sum_pi2_is_declared_by_the_estimator():
    assert get("grpo").replace(advantage="otb").needs_sum_pi2 and get("grpo").replace(advantage="tir_otb").needs_sum_pi2
    assert not get("grpo").needs_sum_pi2
