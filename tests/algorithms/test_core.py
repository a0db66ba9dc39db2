"""Masked statistics, reductions, KL estimators, entropy, critic loss, KL in the reward: hand-worked values."""

import math

import pytest
import torch
from floats import approx, assert_close

from rlbench.algorithms import (
    REDUCTIONS,
    AdaptiveKL,
    aggregate,
    entropy_from_logits,
    kl,
    kl_in_reward,
    masked_mean,
    masked_var,
    masked_whiten,
    to_float,
    value_loss,
)
from rlbench.algorithms.losses import ppo_clip

X_B_T = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M_B_T = torch.tensor([[1, 1, 0], [1, 0, 0]])  # lengths 2 and 1


def test_masked_mean():
    # valid: 1, 2, 4 -> 7/3 ; per row: (1+2)/2 = 1.5 and 4/1 = 4
    assert masked_mean(X_B_T, M_B_T).item() == approx(7 / 3)
    assert_close(masked_mean(X_B_T, M_B_T, dim=-1), torch.tensor([1.5, 4.0]))


def test_to_float_writes_a_float32_as_its_shortest_decimal():
    # float32's value nearest 0.36 is 0.36000001430511475 (float(x) of the tensor); "0.36" rounds back to it
    assert to_float(torch.tensor(0.36)) == 0.36 and float(torch.tensor(0.36)) == 0.36000001430511475
    assert to_float(torch.tensor(1 / 3)) == 0.33333334  # float32: 0.3333333432674408, 8 digits round back
    assert to_float(torch.tensor(0.36, dtype=torch.bfloat16)) == 0.359375  # bfloat16's value, exact in float32
    assert to_float(torch.tensor(1 / 3, dtype=torch.float64)) == 1 / 3  # float64: as it is
    assert to_float(torch.tensor(3)) == 3.0 and math.isnan(to_float(torch.tensor(math.nan)))


def test_masked_var_is_unbiased():
    # valid 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9, / (N-1 = 2) = 7/3
    assert masked_var(X_B_T, M_B_T).item() == approx(7 / 3)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(X_B_T, torch.tensor([[1, 0, 0], [0, 0, 0]]))


def test_masked_whiten():
    # (x - 7/3) / sqrt(7/3): 1 -> -0.872872, 2 -> -0.218218, 4 -> 1.091089 (masked entries are not zeroed)
    white_B_T = masked_whiten(X_B_T, M_B_T)
    assert_close(white_B_T[M_B_T.bool()], torch.tensor([-0.872872, -0.218218, 1.091089]))


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("token-sum", 7.0),  # 1 + 2 + 4
        ("seq-mean-token-sum", 3.5),  # ((1+2) + 4) / 2 sequences
        ("seq-mean-token-mean", 2.75),  # (3/2 + 4/1) / 2
        ("seq-mean-token-sum-norm", 7 / 6),  # 7 / (2 sequences * T=3)
    ],
)
def test_aggregate_modes(mode, expected):
    assert aggregate(X_B_T, M_B_T, mode).item() == approx(expected)


def test_aggregate_global_counts_and_norm_length():
    assert aggregate(X_B_T, M_B_T, "token-mean", num_tokens=10).item() == approx(0.7)  # 7 / 10
    assert aggregate(X_B_T, M_B_T, "seq-mean-token-sum", num_seqs=4).item() == approx(1.75)  # 7 / 4
    assert aggregate(X_B_T, M_B_T, "seq-mean-token-sum-norm", norm_length=7).item() == approx(0.5)  # 7/(2*7)
    assert aggregate(X_B_T, torch.zeros_like(M_B_T), "token-mean").item() == 0.0  # empty: 0, not NaN


def test_aggregate_unknown_mode_lists_valid():
    with pytest.raises(ValueError, match="token-mean, token-sum, seq-mean-token-sum"):
        aggregate(X_B_T, M_B_T, "seq-mean")


def _mini_batch():
    generator = torch.Generator().manual_seed(0)
    B, T = 6, 7
    lengths_B = torch.tensor([7, 2, 5, 1, 4, 6])
    mask_B_T = (torch.arange(T) < lengths_B[:, None]).float()
    old_logp_B_T = -torch.rand(B, T, generator=generator) * 2
    logp_B_T = old_logp_B_T + 0.3 * torch.randn(B, T, generator=generator)
    adv_B_T = torch.randn(B, T, generator=generator) * mask_B_T
    return logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, lengths_B


@pytest.mark.parametrize("mode", REDUCTIONS)
@pytest.mark.parametrize("splits", [[6], [3, 3], [1, 4, 1], [2, 1, 3], [1] * 6])
def test_micro_batch_gradients_sum_to_mini_batch_gradient(mode, splits):
    logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, lengths_B = _mini_batch()
    counts = dict(num_tokens=mask_B_T.sum(), num_seqs=len(mask_B_T), norm_length=mask_B_T.shape[1])

    whole_B_T = logp_B_T.clone().requires_grad_()
    loss_B_T, _ = ppo_clip(whole_B_T, old_logp_B_T, adv_B_T, mask_B_T)
    aggregate(loss_B_T, mask_B_T, mode, **counts).backward()

    parts_B_T = logp_B_T.clone().requires_grad_()
    total, start = 0.0, 0
    for size in splits:
        rows = slice(start, start + size)
        width = int(lengths_B[rows].max())  # each micro-batch padded to its own length
        part_loss_B_T, _ = ppo_clip(
            parts_B_T[rows, :width], old_logp_B_T[rows, :width], adv_B_T[rows, :width], mask_B_T[rows, :width]
        )
        total = total + aggregate(part_loss_B_T, mask_B_T[rows, :width], mode, **counts)
        start += size
    total.backward()

    assert total.item() == approx(aggregate(loss_B_T, mask_B_T, mode, **counts).item())
    assert_close(parts_B_T.grad, whole_B_T.grad)


LOGP_T = torch.tensor([0.0, -1.0])
REF_T = torch.tensor([-1.0, 0.0])  # k = logp - ref = [1, -1]


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", [1.0, -1.0]),
        ("abs", [1.0, 1.0]),
        ("k2", [0.5, 0.5]),  # ½k²
        # κ = ref - logp = [-1, 1]: e^κ - κ - 1 = [e^-1, e - 2]
        ("k3", [math.exp(-1), math.e - 2]),
    ],
)
def test_kl_estimators(kind, expected):
    assert_close(kl(LOGP_T, REF_T, kind), torch.tensor(expected))


def test_k3_is_clamped():
    # κ = clamp(-30, -20, 20) = -20: e^-20 + 20 - 1 ≈ 19 -> clamped to 10
    assert kl(torch.tensor([0.0]), torch.tensor([-30.0]), "k3").item() == 10.0


@pytest.mark.parametrize("base", ["k1", "abs", "k2", "k3"])
def test_straight_through_kl_has_base_value_and_k2_gradient(base):
    logp_T = LOGP_T.clone().requires_grad_()
    value_T = kl(logp_T, REF_T, base + "+")
    value_T.sum().backward()
    assert_close(value_T.detach(), kl(LOGP_T, REF_T, base))
    # d(½k²)/dlogp = k = [1, -1]
    assert_close(logp_T.grad, torch.tensor([1.0, -1.0]))


def test_k3_gradient_differs_from_k2():
    # d/dlogp (e^κ - κ - 1), κ = ref - logp: -(e^κ - 1) = [1 - e^-1, 1 - e]: why "k3+" exists
    logp_T = LOGP_T.clone().requires_grad_()
    kl(logp_T, REF_T, "k3").sum().backward()
    assert_close(logp_T.grad, torch.tensor([1 - math.exp(-1), 1 - math.e]))


def test_kl_unknown_kind_lists_valid():
    with pytest.raises(ValueError, match="k1, abs, k2, k3, k1\\+"):
        kl(LOGP_T, REF_T, "low_var")


def test_entropy_from_logits():
    # [0, 0]: ln 2 ; [0, ln 3]: p = [1/4, 3/4], H = ln 4 - 3/4·ln 3 = 0.562335
    logits_B_T_V = torch.tensor([[[0.0, 0.0], [0.0, math.log(3)]]])
    assert_close(entropy_from_logits(logits_B_T_V), torch.tensor([[math.log(2), 0.562335]]))


def test_value_loss_clips_around_old_values():
    values_B_T = torch.tensor([[1.0, 1.0, 5.0]])
    old_values_B_T = torch.tensor([[0.0, 0.0, 0.0]])
    returns_B_T = torch.tensor([[0.0, 2.0, 0.0]])
    mask_B_T = torch.tensor([[1, 1, 0]])
    # clip(v, old ± 0.5) = 0.5 on both valid tokens
    # token 0: max((1-0)², (0.5-0)²) = 1 ; token 1: max((1-2)², (0.5-2)²) = 2.25 (clipped term larger)
    # loss = ½ · (1 + 2.25) / 2 = 0.8125 ; vf_clip_frac = 1/2
    loss, metrics = value_loss(values_B_T, old_values_B_T, returns_B_T, mask_B_T)
    assert loss.item() == approx(0.8125)
    assert metrics["vf_clip_frac"].item() == approx(0.5)
    # seq-mean-token-sum: ½ · (1 + 2.25) / 1 sequence
    loss, _ = value_loss(values_B_T, old_values_B_T, returns_B_T, mask_B_T, mode="seq-mean-token-sum")
    assert loss.item() == approx(1.625)


def test_kl_in_reward():
    # k1 = logp - ref = [1, 0] -> rewards [0 - 0.1·1, 1 - 0] ; batch KL = mean_i of token mean = 0.5
    rewards_B_T, batch_kl = kl_in_reward(
        torch.tensor([[0.0, 1.0]]), torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, -1.0]]),
        torch.tensor([[1, 1]]), coef=0.1, kind="k1",
    )
    assert_close(rewards_B_T, torch.tensor([[-0.1, 1.0]]))
    assert batch_kl.item() == approx(0.5)


def test_adaptive_kl():
    controller = AdaptiveKL(coef=0.1, target=0.1, horizon=10000)
    # KL 0.2: error clip(2 - 1, ±0.2) = 0.2 -> β = 0.1·(1 + 0.2·100/10000) = 0.1002
    assert controller.update(0.2, n_steps=100) == approx(0.1002)
    # KL 0.09: error -0.1 -> β·(1 - 0.1·1000/10000) = 0.1002·0.99
    assert controller.update(0.09, n_steps=1000) == approx(0.1002 * 0.99)
    fixed = AdaptiveKL(coef=0.05, target=None)
    assert fixed.update(5.0, n_steps=1000) == 0.05
