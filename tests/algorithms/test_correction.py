"""Rollout correction: TIS, IcePop/MIS masking, rejection, sequence levels, mismatch metrics (ALGORITHMS.md §6)."""

import math

import pytest
import torch

from rlbench.algorithms import RolloutCorrection, mismatch_metrics

# Row 0: token ratios ρ = old/sampler probabilities = [3, 0.5, 1.2] and a masked token with ρ = 100.
# Row 1: ρ = [1, 1], then two masked tokens.
SAMPLER_LOGP_B_T = torch.full((2, 4), -2.0)
OLD_LOGP_B_T = SAMPLER_LOGP_B_T + torch.log(torch.tensor([[3.0, 0.5, 1.2, 100.0], [1.0, 1.0, 1.0, 1.0]]))
MASK_B_T = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def correct(**settings):
    return RolloutCorrection(**settings)(OLD_LOGP_B_T, SAMPLER_LOGP_B_T, MASK_B_T)


def test_token_tis_truncates_at_high():
    # min(ρ, 2) = [2, 0.5, 1.2] ; 1 of 5 valid tokens truncated ; masked tokens weigh 0
    weights_B_T, mask_B_T, metrics = correct(level="token", mode="tis", high=2.0)
    torch.testing.assert_close(weights_B_T, torch.tensor([[2.0, 0.5, 1.2, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    assert mask_B_T is MASK_B_T
    assert metrics["correction/outside_frac"].item() == pytest.approx(0.2)


def test_token_mask_zeroes_weights_outside_the_band():
    # IcePop / MIS: band [1/2, 2] (low defaults to 1/high): ρ = 3 -> 0 ; 0.5 and 1.2 kept ; the mask is unchanged
    weights_B_T, mask_B_T, _ = correct(level="token", mode="mask", high=2.0)
    torch.testing.assert_close(weights_B_T, torch.tensor([[0.0, 0.5, 1.2, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    assert mask_B_T is MASK_B_T


def test_token_reject_drops_tokens_from_the_mask():
    # band [0.6, 2]: ρ = 3 and ρ = 0.5 leave it -> mask 0 ; kept tokens weigh 1
    weights_B_T, mask_B_T, metrics = correct(level="token", mode="reject", low=0.6, high=2.0)
    torch.testing.assert_close(mask_B_T, torch.tensor([[0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    torch.testing.assert_close(weights_B_T, mask_B_T)
    assert metrics["correction/outside_frac"].item() == pytest.approx(0.4)  # 2 of 5 valid tokens


def test_sequence_level():
    # row 0: Σ log ρ over valid tokens = ln(3·0.5·1.2) = ln 1.8 -> weight 1.8 on every valid token ; row 1: 1
    weights_B_T, _, _ = correct(level="sequence", mode="tis", high=2.0)
    torch.testing.assert_close(weights_B_T, torch.tensor([[1.8, 1.8, 1.8, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    weights_B_T, _, _ = correct(level="sequence", mode="tis", high=1.5)  # TIS: min(1.8, 1.5)
    torch.testing.assert_close(weights_B_T, torch.tensor([[1.5, 1.5, 1.5, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    # rejection with band [1/1.5, 1.5] drops the whole of row 0
    _, mask_B_T, _ = correct(level="sequence", mode="reject", high=1.5)
    torch.testing.assert_close(mask_B_T, torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]))


def test_geometric_level():
    # row 0: exp(mean log ρ) = 1.8^(1/3) = 1.216440
    weights_B_T, _, _ = correct(level="geometric", mode="tis", high=2.0)
    assert weights_B_T[0, 0].item() == pytest.approx(1.8 ** (1 / 3), rel=1e-6)


def test_weights_are_detached():
    old_logp_B_T = OLD_LOGP_B_T.clone().requires_grad_()
    weights_B_T, _, _ = RolloutCorrection()(old_logp_B_T, SAMPLER_LOGP_B_T, MASK_B_T)
    assert not weights_B_T.requires_grad


def test_mismatch_metrics():
    # valid log ρ: ln 3, ln 0.5, ln 1.2, 0, 0
    metrics = mismatch_metrics(OLD_LOGP_B_T, SAMPLER_LOGP_B_T, MASK_B_T)
    log_rho = [math.log(3), math.log(0.5), math.log(1.2), 0.0, 0.0]
    assert metrics["sampler_mismatch_mean"].item() == pytest.approx(sum(map(abs, log_rho)) / 5, rel=1e-5)
    assert metrics["sampler_mismatch_max"].item() == pytest.approx(math.log(3), rel=1e-5)
    assert metrics["sampler_kl"].item() == pytest.approx(-sum(log_rho) / 5, rel=1e-5)  # k1 of KL(sampler‖trainer)
    k3 = sum(math.exp(x) - x - 1 for x in log_rho) / 5  # ρ - 1 - log ρ
    assert metrics["sampler_kl_k3"].item() == pytest.approx(k3, rel=1e-5)
    assert metrics["sampler_ratio_max"].item() == pytest.approx(3.0, rel=1e-5)  # the masked 100 is ignored
    assert metrics["sampler_ratio_min"].item() == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(level="tokens"), "unknown correction level"),
        (dict(mode="clip"), "unknown correction mode"),
        (dict(low=3.0, high=2.0), "0 < low <= high"),
        (dict(high=-1.0), "0 < low <= high"),
    ],
)
def test_invalid_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrection(**settings)
