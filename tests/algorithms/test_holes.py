"""A loss mask with holes (multi-turn: tool output between sampled turns): a hole is not a step.

Every estimator, loss, reduction and reward helper must give on a holed row what it gives on the compacted row
(the sampled tokens only, contiguous, same T), scattered back, with 0 on the holes.
"""

import math

import pytest
import torch
from floats import approx, assert_close
from test_turns import episodes

from rlbench.algorithms import (
    REDUCTIONS,
    Rejection,
    RolloutCorrection,
    advantage_fn,
    aggregate,
    declared,
    get_correction,
    kl_in_reward,
    loss_fn,
    names,
    outcome_rewards,
    value_loss,
)
from rlbench.algorithms.correction import LEVELS, MODES, REJECTION_LEVELS, STATS

# two prompt groups: episodes 0-2 and 3-4; tool output ('o') and padding ('.') are holes of the loss mask
LAYOUTS = ["00oo111o2.", "0o11......", "000ooo1111", "0oo1oo2oo.", "00000....."]
MASK_B_T, TURN_B_T = episodes(LAYOUTS)
B, T = MASK_B_T.shape


def compact(x_B_T, fill=0):
    """Each row's valid entries moved to its front, in order; ``fill`` after them."""
    out_B_T = torch.full_like(x_B_T, fill)
    for b in range(B):
        valid = MASK_B_T[b].nonzero().squeeze(-1)
        out_B_T[b, : len(valid)] = x_B_T[b, valid]
    return out_B_T


def scatter(x_B_T):
    """The inverse of ``compact`` on the valid entries; 0 on the holes."""
    out_B_T = torch.zeros_like(x_B_T)
    for b in range(B):
        valid = MASK_B_T[b].nonzero().squeeze(-1)
        out_B_T[b, valid] = x_B_T[b, : len(valid)]
    return out_B_T


COMPACT_MASK_B_T = compact(MASK_B_T)
REQUIRED_LOSS_KWARGS = {"dro": {"beta": 0.3}}
"""Hyperparameters without a default, by loss."""


def batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    logp_B_T = -torch.rand(B, T, generator=generator) * 3
    return dict(
        scores_B=torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0]),
        old_logp_B_T=logp_B_T,
        ref_logp_B_T=logp_B_T + 0.3 * torch.randn(B, T, generator=generator),
        logp_B_T=logp_B_T + 0.2 * torch.randn(B, T, generator=generator),
        sampler_logp_B_T=logp_B_T + 0.5 * torch.randn(B, T, generator=generator),
        values_B_T=torch.randn(B, T, generator=generator),
        sum_pi2_B_T=torch.exp(logp_B_T) ** 2 + 0.3 * torch.rand(B, T, generator=generator),
        is_weights_B_T=0.5 + torch.rand(B, T, generator=generator),
        teacher_logp_B_T=logp_B_T + 0.4 * torch.randn(B, T, generator=generator),
        advantages_B_T=torch.randn(B, T, generator=generator),
        data=dict(
            group_ids=torch.tensor([4, 4, 4, 9, 9]),
            baselines_B=torch.rand(B, generator=generator),
            reward_components_B_K=torch.rand(B, 2, generator=generator),
            turn_rewards_B_N=torch.rand(B, 3, generator=generator) * (torch.arange(3) < torch.tensor(
                [3, 2, 2, 3, 1])[:, None]),
            turns_B=torch.tensor([3, 2, 2, 3, 1]),
            turn_state_B_N=torch.tensor([[1, 2, 3], [1, 3, -1], [1, 2, -1], [5, 5, 6], [5, -1, -1]]),
        ),
    )


def test_outcome_reward_sits_on_the_last_sampled_token():
    # row 0 "00oo111o2.": the last 1 of the mask is t8 (Σm - 1 = 5 would be a sampled token of turn 1)
    rewards_B_T = outcome_rewards(torch.tensor([2.0, 3.0]), torch.tensor([[1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0]]))
    assert_close(rewards_B_T, torch.tensor([[0.0, 0, 0, 0, 2, 0], [0, 0, 0, 0, 0, 0]]))
    rewards_B_T = outcome_rewards(torch.arange(1.0, 6.0), MASK_B_T)
    assert rewards_B_T[0, 8] == 1 and rewards_B_T[2, 9] == 3 and rewards_B_T[3, 6] == 4
    assert_close(scatter(outcome_rewards(torch.arange(1.0, 6.0), COMPACT_MASK_B_T)), rewards_B_T)


def rewards_with_kl(b, mask_B_T, squeeze):
    rewards_B_T = outcome_rewards(b["scores_B"], mask_B_T)
    return kl_in_reward(rewards_B_T, squeeze(b["old_logp_B_T"]), squeeze(b["ref_logp_B_T"]), mask_B_T, coef=0.1,
                        kind="k1")


def test_kl_in_reward_is_the_compact_one():
    b = batch()
    holed_B_T, holed_kl = rewards_with_kl(b, MASK_B_T, lambda x: x)
    compact_B_T, compact_kl = rewards_with_kl(b, COMPACT_MASK_B_T, compact)
    assert_close(holed_B_T, scatter(compact_B_T))
    assert_close(holed_kl, compact_kl)


# otb aligns raw positions across a group, as verl's; tir_otb is its form for holed masks (test_otb.py)
@pytest.mark.parametrize("name", sorted(set(names("advantage")) - {"otb"}))
def test_every_estimator_on_a_holed_batch_is_the_compact_one_scattered(name):
    b = batch()
    holed_B_T, _ = rewards_with_kl(b, MASK_B_T, lambda x: x)
    compact_B_T, _ = rewards_with_kl(b, COMPACT_MASK_B_T, compact)
    fn = advantage_fn(name)
    per_token = ("values_B_T", "old_logp_B_T", "sum_pi2_B_T", "is_weights_B_T", "teacher_logp_B_T")
    holed = dict(b["data"], **{k: b[k] for k in per_token}, turn_B_T=TURN_B_T)
    squeezed = dict(b["data"], **{k: compact(b[k]) for k in per_token}, turn_B_T=compact(TURN_B_T, fill=-1))
    adv_B_T, returns_B_T = fn(holed_B_T, MASK_B_T, **declared(fn, holed))
    compact_adv_B_T, compact_returns_B_T = fn(compact_B_T, COMPACT_MASK_B_T, **declared(fn, squeezed))
    assert adv_B_T.abs().sum() > 0
    # 1e-5: the two layouts sum in another order, and most estimators then divide by a std
    assert_close(adv_B_T, scatter(compact_adv_B_T), atol=1e-5)
    assert_close(returns_B_T, scatter(compact_returns_B_T), atol=1e-5)


@pytest.mark.parametrize("name", names("loss"))
def test_every_loss_and_reduction_on_a_holed_batch_is_the_compact_one(name):
    b = batch(seed=1)
    fn = loss_fn(name)
    columns = ("logp_B_T", "old_logp_B_T", "advantages_B_T")
    kwargs = REQUIRED_LOSS_KWARGS.get(name, {})
    loss_B_T, metrics = fn(*(b[c] for c in columns), MASK_B_T, **kwargs)
    compact_loss_B_T, compact_metrics = fn(*(compact(b[c]) for c in columns), COMPACT_MASK_B_T, **kwargs)
    assert_close(loss_B_T * MASK_B_T, scatter(compact_loss_B_T * COMPACT_MASK_B_T))
    for key, value in metrics.items():
        assert_close(value, compact_metrics[key], msg=key)
    for mode in REDUCTIONS:
        assert_close(aggregate(loss_B_T, MASK_B_T, mode, norm_length=T),
                     aggregate(compact_loss_B_T, COMPACT_MASK_B_T, mode, norm_length=T), msg=mode)


def test_value_loss_on_a_holed_batch_is_the_compact_one():
    b = batch(seed=2)
    columns = ("values_B_T", "old_logp_B_T", "advantages_B_T")  # any three tensors: values, old values, returns
    loss, metrics = value_loss(*(b[c] for c in columns), MASK_B_T)
    compact_loss, compact_metrics = value_loss(*(compact(b[c]) for c in columns), COMPACT_MASK_B_T)
    assert_close(loss, compact_loss)
    assert_close(metrics["vf_clip_frac"], compact_metrics["vf_clip_frac"])


def assert_correction_on_a_holed_batch_is_the_compact_one(correction):
    """Returns the metrics of the holed batch."""
    b = batch(seed=3)
    weights_B_T, mask_B_T, metrics = correction(b["old_logp_B_T"], b["sampler_logp_B_T"], MASK_B_T)
    compact_weights_B_T, compact_mask_B_T, compact_metrics = correction(
        compact(b["old_logp_B_T"]), compact(b["sampler_logp_B_T"]), COMPACT_MASK_B_T)
    assert_close(weights_B_T, scatter(compact_weights_B_T))
    assert_close(mask_B_T, scatter(compact_mask_B_T))
    for key, value in metrics.items():
        assert_close(value, compact_metrics[key], msg=key)
    return metrics


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
def test_rollout_correction_on_a_holed_batch_is_the_compact_one(level, mode):
    assert_correction_on_a_holed_batch_is_the_compact_one(RolloutCorrection(level=level, mode=mode, high=1.5))


@pytest.mark.parametrize("level", LEVELS)
def test_normalized_weights_on_a_holed_batch_are_the_compact_ones(level):
    assert_correction_on_a_holed_batch_is_the_compact_one(RolloutCorrection(level=level, high=1.5, normalize=True))


@pytest.mark.parametrize("stat, level", [(s, lv) for s in STATS for lv in REJECTION_LEVELS if (s, lv) != ("k1", "seq_max")])
def test_rejection_rules_on_a_holed_batch_are_the_compact_ones(stat, level):
    # bounds that drop some tokens or sequences of this batch and keep others
    high = {"seq_sum": 4.0}.get(level, 1.5) if stat == "k1" else {"seq_sum": 1.0, "seq_max": 0.5}.get(level, 0.3)
    correction = RolloutCorrection(mode=None, reject=Rejection(stat, level, high=high))
    metrics = assert_correction_on_a_holed_batch_is_the_compact_one(correction)
    assert 0 < metrics["correction/rejected_frac"] < 1


@pytest.mark.parametrize("name", names("correction"))
def test_named_corrections_on_a_holed_batch_are_the_compact_ones(name):
    assert_correction_on_a_holed_batch_is_the_compact_one(get_correction(name))


def test_gae_skips_holes_hand_worked():
    # sampled t0, holes t1 t2 (tool output: V = 9 there must not be read), sampled t3 t4, padding t5
    # γ = 0.9, λ = 0.5, V = [0.5, 9, 9, 0.2, 0.4, 7], outcome 1 on t4 (the last sampled token)
    # t4: δ = 1 + 0 - 0.4 = 0.6, Â = 0.6
    # t3: δ = 0 + 0.9·0.4 - 0.2 = 0.16, Â = 0.16 + 0.45·0.6 = 0.43
    # t0: the next sampled token is t3: δ = 0 + 0.9·0.2 - 0.5 = -0.32, Â = -0.32 + 0.45·0.43 = -0.1265
    # returns Â + V = [0.3735, 0, 0, 0.63, 1.0, 0]; advantages: Â whitened over the 3 sampled tokens
    mask_B_T = torch.tensor([[1, 0, 0, 1, 1, 0]])
    values_B_T = torch.tensor([[0.5, 9.0, 9.0, 0.2, 0.4, 7.0]])
    rewards_B_T = outcome_rewards(torch.tensor([1.0]), mask_B_T)
    adv_B_T, returns_B_T = advantage_fn("gae")(rewards_B_T, mask_B_T, values_B_T=values_B_T, gamma=0.9, lam=0.5)
    assert_close(returns_B_T, torch.tensor([[0.3735, 0.0, 0.0, 0.63, 1.0, 0.0]]))
    raw = torch.tensor([-0.1265, 0.43, 0.6])
    mean = raw.mean()  # 0.301167 ; unbiased std sqrt(0.288798/2) = 0.380000
    assert raw.std().item() == approx(math.sqrt(0.288798 / 2))
    white = (raw - mean) / raw.std()
    assert_close(adv_B_T, torch.tensor([[white[0], 0, 0, white[1], white[2], 0]]), atol=1e-5)  # whitening's 1e-8
