"""Rollout correction: TIS, IcePop/MIS masking, rejection, sequence levels, mismatch metrics (docs/algorithms.md, rollout corrections);
batch normalisation, rejection statistics and the named corrections (§9)."""

import dataclasses
import math

import pytest
import torch
from floats import approx, assert_close

from rlbench.algorithms import Rejection, RolloutCorrection, describe, get, get_correction, mismatch_metrics, names

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
    assert_close(weights_B_T, torch.tensor([[2.0, 0.5, 1.2, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    assert mask_B_T is MASK_B_T
    assert metrics["correction/outside_frac"].item() == approx(0.2)


def test_token_mask_zeroes_weights_outside_the_band():
    # IcePop / MIS: band [1/2, 2] (low defaults to 1/high): ρ = 3 -> 0 ; 0.5 and 1.2 kept ; the mask is unchanged
    weights_B_T, mask_B_T, _ = correct(level="token", mode="mask", high=2.0)
    assert_close(weights_B_T, torch.tensor([[0.0, 0.5, 1.2, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    assert mask_B_T is MASK_B_T


def test_token_reject_drops_tokens_from_the_mask():
    # band [0.6, 2]: ρ = 3 and ρ = 0.5 leave it -> mask 0 ; kept tokens weigh 1
    weights_B_T, mask_B_T, metrics = correct(level="token", mode="reject", low=0.6, high=2.0)
    assert_close(mask_B_T, torch.tensor([[0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    assert_close(weights_B_T, mask_B_T)
    assert metrics["correction/outside_frac"].item() == approx(0.4)  # 2 of 5 valid tokens


def test_sequence_level():
    # row 0: Σ log ρ over valid tokens = ln(3·0.5·1.2) = ln 1.8 -> weight 1.8 on every valid token ; row 1: 1
    weights_B_T, _, _ = correct(level="sequence", mode="tis", high=2.0)
    assert_close(weights_B_T, torch.tensor([[1.8, 1.8, 1.8, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    weights_B_T, _, _ = correct(level="sequence", mode="tis", high=1.5)  # TIS: min(1.8, 1.5)
    assert_close(weights_B_T, torch.tensor([[1.5, 1.5, 1.5, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    # rejection with band [1/1.5, 1.5] drops the whole of row 0
    _, mask_B_T, _ = correct(level="sequence", mode="reject", high=1.5)
    assert_close(mask_B_T, torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]))


def test_geometric_level():
    # row 0: exp(mean log ρ) = 1.8^(1/3) = 1.216440
    weights_B_T, _, _ = correct(level="geometric", mode="tis", high=2.0)
    assert weights_B_T[0, 0].item() == approx(1.8 ** (1 / 3))


def test_weights_are_detached():
    old_logp_B_T = OLD_LOGP_B_T.clone().requires_grad_()
    weights_B_T, _, _ = RolloutCorrection()(old_logp_B_T, SAMPLER_LOGP_B_T, MASK_B_T)
    assert not weights_B_T.requires_grad


def test_mismatch_metrics():
    # valid log ρ: ln 3, ln 0.5, ln 1.2, 0, 0
    metrics = mismatch_metrics(OLD_LOGP_B_T, SAMPLER_LOGP_B_T, MASK_B_T)
    log_rho = [math.log(3), math.log(0.5), math.log(1.2), 0.0, 0.0]
    assert metrics["sampler_mismatch_mean"].item() == approx(sum(map(abs, log_rho)) / 5)
    assert metrics["sampler_mismatch_max"].item() == approx(math.log(3))
    assert metrics["sampler_kl"].item() == approx(-sum(log_rho) / 5)  # k1 of KL(sampler‖trainer)
    k3 = sum(math.exp(x) - x - 1 for x in log_rho) / 5  # ρ - 1 - log ρ
    assert metrics["sampler_kl_k3"].item() == approx(k3)
    assert metrics["sampler_ratio_max"].item() == approx(3.0)  # the masked 100 is ignored
    assert metrics["sampler_ratio_min"].item() == approx(0.5)


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


# ---- batch normalisation (verl's rollout_is_batch_normalize), on the fixture above


def test_token_normalize_divides_by_the_masked_token_mean():
    # TIS weights [2, 0.5, 1.2 | 1, 1]: mean over the 5 valid tokens = 5.7 / 5 = 1.14
    weights_B_T, _, metrics = correct(level="token", mode="tis", high=2.0, normalize=True)
    expected = torch.tensor([[2.0, 0.5, 1.2, 0.0], [1.0, 1.0, 0.0, 0.0]]) / 1.14
    assert_close(weights_B_T, expected)
    assert metrics["correction/weight_mean"].item() == approx(1.0)
    # IcePop band [1/2, 2]: [0, 0.5, 1.2 | 1, 1], mean 3.7 / 5 = 0.74 (the zeroed token counts)
    weights_B_T, _, _ = correct(level="token", mode="mask", high=2.0, normalize=True)
    assert_close(weights_B_T, torch.tensor([[0.0, 0.5, 1.2, 0.0], [1.0, 1.0, 0.0, 0.0]]) / 0.74)


def test_sequence_normalize_divides_by_the_mean_of_the_sequence_weights():
    # sequence weights 1.8 (row 0, 3 tokens) and 1 (row 1, 2 tokens): mean of the two = 1.4, not the token
    # mean (3·1.8 + 2·1) / 5 = 1.48 -> 1.8 / 1.4 = 1.285714, 1 / 1.4 = 0.714286
    weights_B_T, _, _ = correct(level="sequence", mode="tis", high=2.0, normalize=True)
    assert_close(weights_B_T, torch.tensor([[1.8, 1.8, 1.8, 0.0], [1.0, 1.0, 0.0, 0.0]]) / 1.4)
    # geometric: 1.8^(1/3) = 1.216440 and 1: mean 1.108220 -> 1.097652, 0.902348
    weights_B_T, _, _ = correct(level="geometric", mode="tis", high=2.0, normalize=True)
    assert_close(weights_B_T[:, 0], torch.tensor([1.097652, 0.902348]))


# ---- rejection statistics (verl's rollout_rs), on a fixture with simple log ρ
# row 0: log ρ = [0.5, -1, 0.2], row 1: [0.1, -0.1], row 2: [-0.3] x 4; padding has log ρ = 5 (must be ignored)
#            k1 = -log ρ             k2 = ½(log ρ)²               k3 = ρ - 1 - log ρ
# row 0   [-0.5, 1, -0.2]        [0.125, 0.5, 0.02]       [0.148721, 0.367879, 0.021403]
# row 1   [-0.1, 0.1]            [0.005, 0.005]           [0.005171, 0.004837]
# row 2   [0.3] x 4              [0.045] x 4              [0.040818] x 4
#  sum    0.3 / 0 / 1.2          0.645 / 0.01 / 0.18      0.538004 / 0.010008 / 0.163273
#  mean   0.1 / 0 / 0.3          0.215 / 0.005 / 0.045    0.179335 / 0.005004 / 0.040818
#  max                           0.5 / 0.005 / 0.045      0.367879 / 0.005171 / 0.040818
RULE_MASK_B_T = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
RULE_LOG_RHO_B_T = torch.tensor([[0.5, -1.0, 0.2, 5.0], [0.1, -0.1, 5.0, 5.0], [-0.3, -0.3, -0.3, -0.3]])
RULE_SAMPLER_LOGP_B_T = torch.full((3, 4), -2.0)
RULE_OLD_LOGP_B_T = RULE_SAMPLER_LOGP_B_T + RULE_LOG_RHO_B_T
KEEP_ALL, DROP_ALL = [1, 1, 1, 1], [0, 0, 0, 0]


def reject(*rules, **settings):
    correction = RolloutCorrection(**{"mode": None, **settings}, reject=rules)
    return correction(RULE_OLD_LOGP_B_T, RULE_SAMPLER_LOGP_B_T, RULE_MASK_B_T)


@pytest.mark.parametrize(
    "rule, keep",
    [
        # k1 band [log 0.4, log 2.5] = [-0.916, 0.916] per token: row 0's k1 = 1 leaves it
        (Rejection("k1", "token", high=2.5), [[1, 0, 1, 1], KEEP_ALL, KEEP_ALL]),
        # [log 1/3, log 3] = [-1.099, 1.099] on the sum: row 2's 1.2 leaves it, the whole sequence goes
        (Rejection("k1", "seq_sum", high=3.0), [KEEP_ALL, KEEP_ALL, DROP_ALL]),
        # [log 1.15, log 1.5] = [0.140, 0.405] on the mean (a band on -log ρ): rows 0 (0.1) and 1 (0) leave it
        (Rejection("k1", "seq_mean", low=1.15, high=1.5), [DROP_ALL, DROP_ALL, KEEP_ALL]),
        (Rejection("k2", "token", high=0.1), [[0, 0, 1, 1], KEEP_ALL, KEEP_ALL]),  # 0.125, 0.5 > 0.1
        (Rejection("k2", "seq_sum", high=0.2), [DROP_ALL, KEEP_ALL, KEEP_ALL]),  # 0.645 > 0.2
        (Rejection("k2", "seq_mean", high=0.04), [DROP_ALL, KEEP_ALL, DROP_ALL]),  # 0.215, 0.045 > 0.04
        (Rejection("k2", "seq_max", high=0.3), [DROP_ALL, KEEP_ALL, KEEP_ALL]),  # 0.5 > 0.3 (its mean 0.215 is not)
        (Rejection("k3", "token", high=0.1), [[0, 0, 1, 1], KEEP_ALL, KEEP_ALL]),  # 0.1487, 0.3679 > 0.1
        (Rejection("k3", "seq_sum", high=0.5), [DROP_ALL, KEEP_ALL, KEEP_ALL]),  # 0.538 > 0.5
        (Rejection("k3", "seq_mean", high=0.03), [DROP_ALL, KEEP_ALL, DROP_ALL]),  # 0.1793, 0.0408 > 0.03
        (Rejection("k3", "seq_max", high=0.2), [DROP_ALL, KEEP_ALL, KEEP_ALL]),  # 0.3679 > 0.2
    ],
    ids=lambda x: f"{x.stat}-{x.level}" if isinstance(x, Rejection) else "",
)
def test_rejection_statistic(rule, keep):
    weights_B_T, mask_B_T, metrics = reject(rule)
    expected_B_T = RULE_MASK_B_T * torch.tensor(keep)
    assert_close(mask_B_T, expected_B_T.float())
    assert_close(weights_B_T, expected_B_T.float())  # no IS weights: 1 on kept tokens
    dropped = int(RULE_MASK_B_T.sum() - expected_B_T.sum())
    assert metrics["correction/rejected_frac"].item() == approx(dropped / 9)  # 9 valid tokens
    assert metrics["correction/outside_frac"].item() == 0.0


def test_rules_and_together():
    # k1 sum band [log 1/3, log 3] drops row 2 ; k2 <= 0.1 per token drops row 0's first two tokens
    _, mask_B_T, metrics = reject(Rejection("k1", "seq_sum", high=3.0), Rejection("k2", "token", high=0.1))
    assert_close(mask_B_T, torch.tensor([[0.0, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]))
    assert metrics["correction/rejected_frac"].item() == approx(6 / 9)
    # with the "reject" mode's token ratio band [1/2, 2] too: row 0's third token (ρ = e^0.2 = 1.22) is inside,
    # row 1 (ρ = e^±0.1) inside: the same mask
    _, banded_B_T, _ = reject(Rejection("k1", "seq_sum", high=3.0), Rejection("k2", "token", high=0.1), mode="reject")
    assert_close(banded_B_T, mask_B_T)
    # the sum rule with the band [0.95, 2] alone: ρ = e^-1 = 0.368 (row 0) and e^-0.1 = 0.905 (row 1) leave it
    _, banded_B_T, _ = reject(Rejection("k1", "seq_sum", high=3.0), mode="reject", low=0.95, high=2.0)
    assert_close(banded_B_T, torch.tensor([[1.0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]))


def test_rules_combine_with_is_weights_and_normalize():
    # token TIS at 2 with the k2 token rule: ρ = [e^0.5, e^-1, e^0.2 | e^0.1, e^-0.1 | e^-0.3 x 4] (none above 2)
    # normalised over all 9 valid tokens (verl: the weights' mean is over the response mask, before rejection),
    # then row 0's first two tokens are dropped
    weights_B_T, mask_B_T, _ = reject(Rejection("k2", "token", high=0.1), mode="tis", normalize=True)
    rho_B_T = RULE_LOG_RHO_B_T.exp() * RULE_MASK_B_T
    mean = rho_B_T.sum() / 9  # (1.648721 + 0.367879 + 1.221403 + 1.105171 + 0.904837 + 4·0.740818) / 9 = 0.912365
    assert mean.item() == approx(0.912365)
    assert_close(weights_B_T, rho_B_T / mean * mask_B_T)
    assert mask_B_T[0].tolist() == [0, 0, 1, 0]


def test_mis():
    # sequence log ρ = -0.3 / 0 / -1.2 -> w = min(Π ρ, 2) = 0.740818 / 1 / 0.301194 ; k1 sums 0.3 / 0 / 1.2
    # against the band [log 0.5, log 2] = [-0.693, 0.693]: row 2 is dropped
    weights_B_T, mask_B_T, metrics = get_correction("mis")(RULE_OLD_LOGP_B_T, RULE_SAMPLER_LOGP_B_T, RULE_MASK_B_T)
    assert_close(mask_B_T, torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]))
    expected = torch.tensor([[0.740818] * 3 + [0], [1, 1, 0, 0], [0] * 4])
    assert_close(weights_B_T, expected)
    assert metrics["correction/rejected_frac"].item() == approx(4 / 9)


def test_geo_reject():
    # k1 means 0.1 / 0 / 0.3 against [log 0.999, log 1.001] = [-0.0010005, 0.0009995]: only row 1 stays
    weights_B_T, mask_B_T, _ = get_correction("geo_reject")(RULE_OLD_LOGP_B_T, RULE_SAMPLER_LOGP_B_T, RULE_MASK_B_T)
    assert_close(mask_B_T, torch.tensor([[0.0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]))
    assert_close(weights_B_T, mask_B_T)


@pytest.mark.parametrize(
    "name, correction",
    [
        ("token_tis", RolloutCorrection(level="token", mode="tis", high=2.0)),
        ("seq_tis", RolloutCorrection(level="sequence", mode="tis", high=2.0)),
        ("icepop", RolloutCorrection(level="token", mode="mask", low=0.5, high=5.0)),
        ("mis", RolloutCorrection(level="sequence", mode="tis", high=2.0,
                                  reject=Rejection("k1", "seq_sum", low=0.5, high=2.0))),
        ("geo_reject", RolloutCorrection(mode=None, reject=Rejection("k1", "seq_mean", low=0.999, high=1.001))),
    ],
)
def test_presets_resolve_to_their_configuration(name, correction):
    assert get_correction(name) == correction
    assert name in names("correction")
    algorithm = get("grpo").replace(correction=name)
    assert algorithm.correction == correction
    assert f"{name} (correction)" in describe(name) and "verl" in describe(name) + describe(algorithm)
    assert f"{name} (correction)" in algorithm.describe()


def test_presets_name_their_source():
    sources = {"token_tis": "Yao et al. 2025", "seq_tis": "Yao et al. 2025", "icepop": "Ring-1T", "mis": "verl",
               "geo_reject": "verl"}
    assert set(names("correction")) == set(sources)
    for name, source in sources.items():
        assert source in describe(name), name


def test_unknown_preset_lists_the_valid_names():
    message = r"^unknown correction 'mist'; valid: geo_reject, icepop, mis, seq_tis, token_tis"
    with pytest.raises(ValueError, match=message):
        get("grpo").replace(correction="mist")
    with pytest.raises(ValueError, match=message):
        get_correction("mist")
    with pytest.raises(TypeError, match="correction must be a RolloutCorrection, a registered correction name"):
        get("grpo").replace(correction=2.0)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Rejection("k4", "token", high=2.0), r"unknown rejection statistic 'k4'; valid: k1, k2, k3"),
        (lambda: Rejection("k1", "seq", high=2.0),
         r"unknown rejection level 'seq'; valid: token, seq_sum, seq_mean, seq_max"),
        (lambda: Rejection("k1", "seq_max", high=2.0), r"'seq_max' takes k2 or k3.*token, seq_sum, seq_mean"),
        (lambda: Rejection("k1", "token", low=3.0, high=2.0), "0 < low <= high"),
        (lambda: Rejection("k1", "token", high=0.0), "0 < low <= high"),
        (lambda: Rejection("k2", "seq_sum", low=0.1, high=2.0), "k2 takes only an upper bound"),
        (lambda: Rejection("k3", "token", high=-1.0), "k3 takes only an upper bound high > 0"),
        (lambda: RolloutCorrection(mode="none"), r"unknown correction mode 'none'; valid: tis, mask, reject, None"),
        (lambda: RolloutCorrection(mode="reject", normalize=True), "normalize needs importance weights"),
        (lambda: RolloutCorrection(mode=None, normalize=True), "normalize needs importance weights"),
    ],
)
def test_invalid_rules(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_reject_takes_rejection_rules():
    with pytest.raises(TypeError, match="reject takes Rejection rules"):
        RolloutCorrection(reject=("k1",))
    single = RolloutCorrection(reject=Rejection("k2", "token", high=1.0))  # one rule needs no tuple
    assert single.reject == (Rejection("k2", "token", high=1.0),)


def test_weights_and_mask_of_every_preset_are_detached():
    old_logp_B_T = RULE_OLD_LOGP_B_T.clone().requires_grad_()
    for name in names("correction"):
        correction = get_correction(name)
        for settings in ({}, {"normalize": True} if correction.mode in ("tis", "mask") else {}):
            weights_B_T, mask_B_T, metrics = dataclasses.replace(correction, **settings)(
                old_logp_B_T, RULE_SAMPLER_LOGP_B_T, RULE_MASK_B_T)
            assert not weights_B_T.requires_grad and not mask_B_T.requires_grad, name
            assert not any(v.requires_grad for v in metrics.values()), name
