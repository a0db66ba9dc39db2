"""Bypass mode (docs/algorithms.md; verl 0.9.1 docs/algo/rollout_corr.md): old_logp is the sampler's, and the
correction runs in the loss on log ρ = sg(logp) - sampler_logp. Hand-worked values of both variants."""

import math

import pytest
import torch
from floats import approx, assert_close

from rlbench.algorithms import Algorithm, Rejection, RolloutCorrection, describe, get

# sampler probability 0.25 on every token; the trainer's ratios ρ = π_θ/π_sampler = [1.5, 3, 0.9, 0.25]
RATIOS = [1.5, 3.0, 0.9, 0.25]
SAMPLER_LOGP_B_T = torch.log(torch.full((1, 4), 0.25))
ADV_B_T = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
MASK_B_T = torch.ones(1, 4)


def logp():
    return (SAMPLER_LOGP_B_T + torch.log(torch.tensor([RATIOS]))).requires_grad_()


def test_ppo_clip_variant_clips_on_the_kept_tokens_without_is_weights():
    # the rejection keeps tokens with ρ in [0.5, 2]: tokens 1 (ρ 3) and 3 (ρ 0.25) leave the mask
    # token 0: ρ 1.5, A +1: max(-1.5, -1.2) = -1.2 (clipped, no gradient)
    # token 2: ρ 0.9, A -1: max(0.9, 0.9) = 0.9, dual-clip min(0.9, 3) = 0.9; dL/dlogp = -A·ρ = 0.9
    # token-mean over the 2 kept tokens: (-1.2 + 0.9) / 2 = -0.15; gradient [0, 0, 0.45, 0]
    correction = RolloutCorrection(mode=None, reject=(Rejection("k1", "token", high=2.0),))
    alg = Algorithm(name="t", advantage="grpo", loss="ppo_clip", bypass="ppo_clip", correction=correction)
    logp_B_T = logp()
    loss, metrics = alg.actor_loss(logp_B_T, SAMPLER_LOGP_B_T, ADV_B_T, MASK_B_T)
    assert loss.item() == approx(-0.15)
    loss.backward()
    assert_close(logp_B_T.grad, torch.tensor([[0.0, 0.0, 0.45, 0.0]]))
    assert metrics["correction/rejected_frac"].item() == approx(0.5)
    assert metrics["clip_frac"].item() == approx(0.5)  # token 0 of the 2 kept
    # the caller's global count (4 tokens, rejected ones included) keeps the loss independent of the split
    loss, _ = alg.actor_loss(logp(), SAMPLER_LOGP_B_T, ADV_B_T, MASK_B_T, num_tokens=4)
    assert loss.item() == approx(-0.075)


def test_ppo_clip_variant_without_a_correction_is_ppo_against_the_sampler():
    alg = Algorithm(name="t", advantage="grpo", loss="ppo_clip", bypass="ppo_clip")
    plain = Algorithm(name="p", advantage="grpo", loss="ppo_clip")
    logp_B_T = logp()
    loss, _ = alg.actor_loss(logp_B_T, SAMPLER_LOGP_B_T, ADV_B_T, MASK_B_T)
    # (-1.2 - 1.2 + 0.9 + 0.8) / 4: token 1 clipped at 1.2, token 3 (ρ 0.25, A -1): max(0.25, 0.8) = 0.8
    assert loss.item() == approx((-1.2 - 1.2 + 0.9 + 0.8) / 4)
    assert loss.item() == approx(plain.actor_loss(logp(), SAMPLER_LOGP_B_T, ADV_B_T, MASK_B_T)[0].item())


def test_reinforce_variant_is_the_policy_gradient_with_truncated_is_weights():
    # w = min(ρ, 2) = [1.5, 2, 0.9, 0.25] (detached), L = -A·logp·w, logp = ln(0.25·ρ) = ln [0.375, 0.75, 0.225, 0.0625]
    # L = [1.5·0.980829, 2·0.287682, -0.9·1.491655, -0.25·2.772589] = [1.471244, 0.575364, -1.342489, -0.693147]
    # token-mean: 0.010972 / 4 = 0.002743;  dL/dlogp = -A·w / 4 = [-0.375, -0.5, 0.225, 0.0625]
    alg = Algorithm(name="t", advantage="grpo", loss="gpg", bypass="reinforce", correction="token_tis")
    logp_B_T = logp()
    loss, metrics = alg.actor_loss(logp_B_T, SAMPLER_LOGP_B_T, ADV_B_T, MASK_B_T)
    expected = -sum(a * min(r, 2.0) * math.log(0.25 * r) for a, r in zip([1, 1, -1, -1], RATIOS)) / 4
    assert expected == approx(0.002743)
    assert loss.item() == approx(expected)
    loss.backward()
    assert_close(logp_B_T.grad, torch.tensor([[-0.375, -0.5, 0.225, 0.0625]]))
    assert metrics["correction/weight_mean"].item() == approx((1.5 + 2 + 0.9 + 0.25) / 4)
    assert metrics["correction/outside_frac"].item() == approx(0.25)  # ρ 3 truncated


def test_bypass_declarations_are_checked():
    with pytest.raises(ValueError, match="unknown bypass mode 'ppo'; valid: ppo_clip, reinforce"):
        get("grpo").replace(bypass="ppo")
    with pytest.raises(ValueError, match="bypass='reinforce' trains L = -A·logp·w, the gpg loss, not 'ppo_clip'"):
        get("grpo").replace(bypass="reinforce")
    with pytest.raises(ValueError, match="normalize=False"):
        get("grpo").replace(bypass="ppo_clip", correction=RolloutCorrection(normalize=True))
    with pytest.raises(ValueError, match="bypass mode: it computes its correction weights itself"):
        get("grpo_bypass").actor_loss(logp(), SAMPLER_LOGP_B_T, ADV_B_T, MASK_B_T, ref_logp_B_T=SAMPLER_LOGP_B_T,
                                      weights_B_T=torch.ones(1, 4))


def test_bypass_presets_describe_the_mode():
    assert get("grpo_bypass").bypass == "ppo_clip" and get("grpo_bypass_pg").bypass == "reinforce"
    assert "bypass mode 'ppo_clip'" in describe("grpo_bypass") and "no IS weights" in describe("grpo_bypass")
    text = describe("grpo_bypass_pg")
    assert "bypass mode 'reinforce'" in text and "L = -A·logp·w" in text and "token_tis (correction)" in text
