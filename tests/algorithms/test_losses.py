"""Policy losses on tiny hand-worked tensors (docs/algorithms.md, losses)."""

import math

import pytest
import torch
from floats import approx, assert_close

from rlbench.algorithms import aggregate, get, loss_fn, loss_reduction


def tokens(old_logp, ratios):
    """logp_B_T with the given token ratios r = exp(logp - old_logp); one sequence."""
    old_logp_B_T = torch.tensor([old_logp])
    return (old_logp_B_T + torch.log(torch.tensor([ratios]))).requires_grad_(), old_logp_B_T


# PPO tokens: (r, A) = (1.5, +1) (1.5 clipped at 1.2), (0.5, +1), (1.1, -1), (5, -1) (dual-clip), + a masked token
PPO_LOGP, PPO_OLD = tokens([-1.0] * 5, [1.5, 0.5, 1.1, 5.0, 10.0])
PPO_ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
PPO_MASK = torch.tensor([[1, 1, 1, 1, 0]])


def test_ppo_clip_with_dual_clip():
    # (1.5, +1): max(-1.5, -1.2) = -1.2 (clipped)
    # (0.5, +1): max(-0.5, -0.8) = -0.5
    # (1.1, -1): max(1.1, 1.1) = 1.1, min(1.1, -A·c = 3) = 1.1
    # (5.0, -1): max(5, 1.2) = 5, dual-clip min(5, 3) = 3
    loss_B_T, metrics = loss_fn("ppo_clip")(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK)
    assert_close(loss_B_T[:, :4], torch.tensor([[-1.2, -0.5, 1.1, 3.0]]))
    assert metrics["clip_frac"].item() == approx(0.25)
    assert metrics["clip_frac_lower"].item() == approx(0.25)
    # approx_kl = -mean(log r) over valid = -(ln 1.5 + ln 0.5 + ln 1.1 + ln 5)/4
    assert metrics["approx_kl"].item() == approx(-math.log(1.5 * 0.5 * 1.1 * 5.0) / 4)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_ppo_clip_gradient_is_zero_where_clipped():
    # d(-A·r)/dlogp = -A·r on unclipped tokens: (0.5, +1) -> -0.5 ; (1.1, -1) -> 1.1 ; clipped ones 0
    logp_B_T = PPO_LOGP.detach().clone().requires_grad_()
    loss_B_T, _ = loss_fn("ppo_clip")(logp_B_T, PPO_OLD, PPO_ADV, PPO_MASK)
    (loss_B_T * PPO_MASK).sum().backward()
    assert_close(logp_B_T.grad, torch.tensor([[0.0, -0.5, 1.1, 0.0, 0.0]]))


def test_ppo_clip_higher_and_weights():
    # clip_high 0.28: r = 1.5 is clipped at 1.28 -> -1.28 ; weights multiply the per-token loss
    weights_B_T = torch.tensor([[2.0, 1.0, 0.5, 1.0, 1.0]])
    loss_B_T, _ = loss_fn("ppo_clip")(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK, weights_B_T=weights_B_T, clip_high=0.28)
    assert_close(loss_B_T[:, :4], torch.tensor([[-2.56, -0.5, 0.55, 3.0]]))


@pytest.mark.parametrize("clip_c", [1.0, 0.5])
def test_ppo_clip_c_must_exceed_one(clip_c):
    with pytest.raises(ValueError, match="clip_c"):
        loss_fn("ppo_clip")(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK, clip_c=clip_c)


def test_gspo_sequence_ratio():
    # both sequences: token log-ratios [0.2, -0.1] (+ a masked 5.0) -> ŝ = 0.05, s = e^0.05 = 1.051271
    # A = +1: max(-1.051271, -clip(s, 1 ± 4e-4) = -1.0004) = -1.0004 (clipped, no gradient)
    # A = -1: max(1.051271, 1.0004) = 1.051271 ; d/dlogp_t of -A·s_{i,t} = -A·s = 1.051271 on each valid token
    old_logp_B_T = torch.full((2, 3), -1.0)
    logp_B_T = (old_logp_B_T + torch.tensor([0.2, -0.1, 5.0])).requires_grad_()
    adv_B_T = torch.tensor([[1.0], [-1.0]]).expand(2, 3)
    mask_B_T = torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss_B_T, metrics = loss_fn("gspo")(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T)
    s = math.exp(0.05)
    assert_close(loss_B_T[:, :2], torch.tensor([[-1.0004, -1.0004], [s, s]]))
    assert metrics["clip_frac"].item() == approx(0.5)
    (loss_B_T * mask_B_T).sum().backward()
    assert_close(logp_B_T.grad, torch.tensor([[0.0, 0.0, 0.0], [s, s, 0.0]]))


def test_cispo_keeps_gradient_of_clipped_tokens():
    # token 0: p 0.4 -> 0.6, r = 1.5 clipped to 1.2, A = +1: L = -1.2·ln 0.6 = 0.612991, dL/dlogp = -1.2
    # token 1: p 0.4 -> 0.2, r = 0.5 (no lower clip), A = -1: L = 0.5·ln 0.2 = -0.804719, dL/dlogp = 0.5
    old_logp_B_T = torch.log(torch.tensor([[0.4, 0.4]]))
    logp_B_T = torch.log(torch.tensor([[0.6, 0.2]])).requires_grad_()
    adv_B_T = torch.tensor([[1.0, -1.0]])
    loss_B_T, metrics = loss_fn("cispo")(logp_B_T, old_logp_B_T, adv_B_T, torch.ones(1, 2))
    assert_close(loss_B_T, torch.tensor([[-1.2 * math.log(0.6), 0.5 * math.log(0.2)]]))
    assert metrics["clip_frac"].item() == approx(0.5)
    loss_B_T.sum().backward()
    assert_close(logp_B_T.grad, torch.tensor([[-1.2, 0.5]]))
    # with a lower clip of 0.2, r = 0.5 -> 0.8: L = 0.8·ln 0.2
    loss_B_T, _ = loss_fn("cispo")(logp_B_T, old_logp_B_T, adv_B_T, torch.ones(1, 2), clip_low=0.2)
    assert loss_B_T[0, 1].item() == approx(0.8 * math.log(0.2))


def test_gmpo_geometric_mean_with_sign_aware_clip():
    # ε = 0.4. Sequence 0, A = +1, Δ = [0.5, -0.5]: only the upper side clips -> Δ* = [0.4, -0.5],
    #   ρ = e^(-0.05) = 0.951229, loss -0.951229
    # sequence 1, A = -1, Δ = [-0.5, 0.5]: only the lower side clips -> Δ* = [-0.4, 0.5],
    #   ρ = e^(0.05) = 1.051271, loss +1.051271
    # (third token masked, with a wild Δ and A) ; mean over sequences = 0.050021
    old_logp_B_T = torch.full((2, 3), -1.0)
    logp_B_T = old_logp_B_T + torch.tensor([[0.5, -0.5, 3.0], [-0.5, 0.5, 3.0]])
    adv_B_T = torch.tensor([[1.0, 1.0, 5.0], [-1.0, -1.0, 5.0]])
    mask_B_T = torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss_B_T, metrics = loss_fn("gmpo")(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T)
    assert loss_reduction("gmpo") == "seq-mean-token-mean"
    expected = (-math.exp(-0.05) + math.exp(0.05)) / 2
    assert aggregate(loss_B_T, mask_B_T, "seq-mean-token-mean").item() == approx(expected)
    assert metrics["clip_frac"].item() == approx(0.25)  # token (0, 0)
    assert metrics["clip_frac_lower"].item() == approx(0.25)  # token (1, 0)
    # token weights enter as the per-sequence geometric mean: sqrt(4·1) = 2 doubles sequence 0
    weights_B_T = torch.tensor([[4.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    loss_B_T, _ = loss_fn("gmpo")(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, weights_B_T=weights_B_T)
    expected = (-2 * math.exp(-0.05) + math.exp(0.05)) / 2
    assert aggregate(loss_B_T, mask_B_T, "seq-mean-token-mean").item() == approx(expected)


def test_sapo_gate():
    # r = 1: σ(0)·4/τ = 2/τ -> A = +1 (τ 1): -2 ; A = -1 (τ 1.05): +2/1.05
    # r = e^0.5 = 1.648721, A = +1: -σ(0.648721)·4 = -4/(1 + e^-0.648721) = -4/1.522714 = -2.626889
    old_logp_B_T = torch.full((1, 3), -1.0)
    logp_B_T = (old_logp_B_T + torch.tensor([0.0, 0.0, 0.5])).requires_grad_()
    adv_B_T = torch.tensor([[1.0, -1.0, 1.0]])
    loss_B_T, _ = loss_fn("sapo")(logp_B_T, old_logp_B_T, adv_B_T, torch.ones(1, 3))
    assert_close(loss_B_T, torch.tensor([[-2.0, 2 / 1.05, -2.626889]]))
    assert loss_reduction("sapo") == "seq-mean-token-mean"
    # on-policy (r = 1) the gradient is the policy gradient -A: d/dlogp = -A·(4/τ)·σ'(0)·τ·r = -A
    loss_B_T[:, :2].sum().backward()
    assert_close(logp_B_T.grad[:, :2], torch.tensor([[-1.0, 1.0]]))


def test_gpg_is_the_plain_policy_gradient():
    # L = -A·logp = [-1·-1, 0.5·-2] = [1, -1] ; dL/dlogp = -A = [-1, 0.5]
    logp_B_T = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv_B_T = torch.tensor([[1.0, -0.5]])
    loss_B_T, _ = loss_fn("gpg")(logp_B_T, logp_B_T.detach() - 0.1, adv_B_T, torch.ones(1, 2))
    assert_close(loss_B_T, torch.tensor([[1.0, -1.0]]))
    loss_B_T.sum().backward()
    assert_close(logp_B_T.grad, torch.tensor([[-1.0, 0.5]]))


# Covariance tokens: A = [2, 0, 0, -2], logp = [-1, -2, -2, -3] (mean A 0, mean logp -2)
# cov = (A - 0)(logp + 2) = [2, 0, 0, 2]: tokens 0 and 3 lie in (1, 5)
COV_LOGP = torch.tensor([[-1.0, -2.0, -2.0, -3.0]])
COV_ADV = torch.tensor([[2.0, 0.0, 0.0, -2.0]])


def test_clip_cov_removes_a_high_covariance_token():
    # token 0 has r = 1.5 (clipped: -2·1.2 = -2.4, so not a candidate); the others r = 1: L = -A = [.., 0, 0, 2]
    # max(⌊2e-4·4⌋, 1) = 1 token drawn among the candidates {3}: its loss becomes 0
    old_logp_B_T = COV_LOGP - torch.tensor([[math.log(1.5), 0.0, 0.0, 0.0]])
    logp_B_T = COV_LOGP.clone().requires_grad_()
    loss_B_T, metrics = loss_fn("clip_cov")(logp_B_T, old_logp_B_T, COV_ADV, torch.ones(1, 4))
    assert_close(loss_B_T, torch.tensor([[-2.4, 0.0, 0.0, 0.0]]))
    assert metrics["cov_frac"].item() == approx(0.25)
    loss_B_T.sum().backward()
    assert logp_B_T.grad[0, 3] == 0


def test_clip_cov_draw_is_seeded():
    # both tokens 0 and 3 are candidates when nothing is clipped; one is drawn, the same one for a seed
    draws = [
        loss_fn("clip_cov")(COV_LOGP, COV_LOGP, COV_ADV, torch.ones(1, 4), seed=seed)[0] for seed in (0, 0, 1, 2, 3)
    ]
    for loss_B_T in draws:
        assert loss_B_T.tolist() in ([[0.0, 0.0, 0.0, 2.0]], [[-2.0, 0.0, 0.0, 0.0]])
    assert_close(draws[0], draws[1])
    # cov_ratio 0.5: ⌊0.5·4⌋ = 2 tokens -> both removed
    loss_B_T, _ = loss_fn("clip_cov")(COV_LOGP, COV_LOGP, COV_ADV, torch.ones(1, 4), cov_ratio=0.5)
    assert (loss_B_T == 0).all()


def test_kl_cov_penalises_the_top_covariance_token():
    # A = [3, 0, 0, -1]: A - mean = [2.5, -.5, -.5, -1.5], logp - mean = [1, 0, 0, -1] -> cov [2.5, 0, 0, 1.5]
    # top-1 = token 0, log-ratio 0.1: L0 = -3·e^0.1 + 0.1·|0.1| = -3.305513 ; others -A·r = [0, 0, 1]
    adv_B_T = torch.tensor([[3.0, 0.0, 0.0, -1.0]])
    old_logp_B_T = COV_LOGP - torch.tensor([[0.1, 0.0, 0.0, 0.0]])
    loss_B_T, metrics = loss_fn("kl_cov")(COV_LOGP, old_logp_B_T, adv_B_T, torch.ones(1, 4))
    assert_close(loss_B_T, torch.tensor([[-3 * math.exp(0.1) + 0.01, 0.0, 0.0, 1.0]]))
    assert metrics["cov_frac"].item() == approx(0.25)


# DPPO tokens, old probability 0.5 everywhere: (p, A) = (0.6, +1) (0.7, +1) (0.4, -1) (0.3, -1) (0.1, +1)
DPPO_OLD = torch.log(torch.full((1, 5), 0.5))
DPPO_LOGP = torch.log(torch.tensor([[0.6, 0.7, 0.4, 0.3, 0.1]]))
DPPO_ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])


def test_dppo_tv_trusts_small_probability_moves():
    # δ = 0.15: p - p_old = 0.1 ≤ δ (A > 0) trusted ; 0.2 > δ untrusted ; -0.1 ≥ -δ (A < 0) trusted ;
    # -0.2 untrusted ; -0.4 with A > 0 moves against the advantage: trusted
    # L = -A·min(r, 20)·logp: token 0: -1.2·ln 0.6 ; token 2: 0.8·ln 0.4 ; token 4: -0.2·ln 0.1
    loss_B_T, metrics = loss_fn("dppo_tv")(DPPO_LOGP, DPPO_OLD, DPPO_ADV, torch.ones(1, 5))
    expected = [[-1.2 * math.log(0.6), 0.0, 0.8 * math.log(0.4), 0.0, -0.2 * math.log(0.1)]]
    assert_close(loss_B_T, torch.tensor(expected))
    assert metrics["clip_frac"].item() == approx(0.4)
    # ratio cap C = 1.1: token 0's r = 1.2 -> 1.1
    loss_B_T, metrics = loss_fn("dppo_tv")(DPPO_LOGP, DPPO_OLD, DPPO_ADV, torch.ones(1, 5), clip_c=1.1)
    assert loss_B_T[0, 0].item() == approx(-1.1 * math.log(0.6))
    assert metrics["clip_frac_lower"].item() == approx(0.2)


def test_dppo_kl_uses_the_binary_kl():
    # p_old = 0.5: bkl(0.6) = 0.5·ln(0.5/0.6) + 0.5·ln(0.5/0.4) = 0.020411 ≤ 0.05: trusted
    # bkl(0.7) = 0.087177 > 0.05 (A > 0): untrusted ; bkl(0.4) = 0.020411 (A < 0): trusted ;
    # bkl(0.3) = 0.087177 (A < 0): untrusted ; p 0.1 < p_old with A > 0: trusted
    # the trusted tokens are those of dppo_tv here, so the same L = -A·min(r, 20)·logp
    loss_B_T, metrics = loss_fn("dppo_kl")(DPPO_LOGP, DPPO_OLD, DPPO_ADV, torch.ones(1, 5))
    expected = [[-1.2 * math.log(0.6), 0.0, 0.8 * math.log(0.4), 0.0, -0.2 * math.log(0.1)]]
    assert_close(loss_B_T, torch.tensor(expected))
    assert metrics["clip_frac"].item() == approx(0.4)


def test_dro_quadratic_penalty_on_the_log_ratio():
    # β = 0.5, L = -(logp·A - ½β(logp - old_logp)²), dL/dlogp = -A + β(logp - old_logp)
    # token 0: logp -1, old -1.5, A 2:  Δ = 0.5:  L = -(-2 - 0.25·0.25) = 2.0625;  grad = -2 + 0.25 = -1.75
    # token 1: logp -2, old -1, A -1:   Δ = -1:   L = -(2 - 0.25·1) = -1.75;      grad = 1 - 0.5 = 0.5
    # token 2: masked (its loss is still computed; the reduction drops it)
    logp_B_T = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old_logp_B_T = torch.tensor([[-1.5, -1.0, -3.0]])
    adv_B_T = torch.tensor([[2.0, -1.0, 5.0]])
    mask_B_T = torch.tensor([[1, 1, 0]])
    loss_B_T, metrics = loss_fn("dro")(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, beta=0.5)
    assert_close(loss_B_T[:, :2], torch.tensor([[2.0625, -1.75]]))
    (loss_B_T * mask_B_T).sum().backward()
    assert_close(logp_B_T.grad, torch.tensor([[-1.75, 0.5, 0.0]]))
    assert metrics["approx_kl"].item() == approx(0.25)  # mean(old - logp) = (-0.5 + 1) / 2
    weighted_B_T, _ = loss_fn("dro")(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, beta=0.5,
                                     weights_B_T=torch.tensor([[2.0, 0.5, 1.0]]))
    assert_close(weighted_B_T[:, :2], torch.tensor([[4.125, -0.875]]))


def test_dro_needs_a_positive_beta():
    with pytest.raises(ValueError, match=r"loss 'dro' needs beta \(no default\): pass it in loss_kwargs"):
        get("grpo").replace(name="dro", loss="dro")
    with pytest.raises(TypeError, match="beta"):
        loss_fn("dro")(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK)
    for beta in (0.0, -0.1):
        with pytest.raises(ValueError, match="dro needs beta > 0"):
            loss_fn("dro")(PPO_LOGP, PPO_OLD, PPO_ADV, PPO_MASK, beta=beta)
    algorithm = get("grpo").replace(name="dro", loss="dro", loss_kwargs={"beta": 0.1})
    assert "loss_kwargs={'beta': 0.1}" in repr(algorithm) and "Hyperparameters: beta (required)" in algorithm.describe()
