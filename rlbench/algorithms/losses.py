"""Policy losses, registered by name (docs/algorithms.md lists them).

Every loss has the signature `f(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None,
**hparams) -> (loss_B_T, metrics)`: the unreduced per-token loss (`aggregate` reduces it), multiplied by
the detached rollout-correction weights when given, and 0-d detached metrics. `r = exp(clamp(logp -
old_logp, ±20))` is the token ratio, `sg` the stop-gradient. All losses report `approx_kl =
masked_mean(old_logp - logp)`.
"""

from __future__ import annotations

import torch

from .core import masked_mean, ratio
from .registry import register_loss


def _weighted(loss_B_T: torch.Tensor, weights_B_T: torch.Tensor | None) -> torch.Tensor:
    return loss_B_T if weights_B_T is None else loss_B_T * weights_B_T


def _frac(condition_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """Fraction of valid tokens where `condition_B_T` holds (detached)."""
    return masked_mean(condition_B_T.float(), mask_B_T).detach()


def _approx_kl(logp_B_T: torch.Tensor, old_logp_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    return masked_mean(old_logp_B_T - logp_B_T, mask_B_T).detach()


def _clipped_surrogate(ratio_B_T, advantages_B_T, clip_low: float, clip_high: float):
    """`max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high))` and where the clipped term won."""
    unclipped_loss_B_T = -advantages_B_T * ratio_B_T
    clipped_loss_B_T = -advantages_B_T * torch.clamp(ratio_B_T, 1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped_loss_B_T, clipped_loss_B_T), clipped_loss_B_T > unclipped_loss_B_T


def _covariance(advantages_B_T, logp_B_T, mask_B_T) -> torch.Tensor:
    """Per-token `(A - mean A)(logp - mean logp)`, means over valid tokens, no gradient."""
    logp_B_T = logp_B_T.detach()
    return (advantages_B_T - masked_mean(advantages_B_T, mask_B_T)) * (logp_B_T - masked_mean(logp_B_T, mask_B_T))


@register_loss("ppo_clip", verl="vanilla")
def ppo_clip(
    logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None,
    clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
):
    """PPO clipped surrogate, with clip-higher and dual-clip (verl's `vanilla`).

        Lc = max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high));   L = min(Lc, -A·c) where A < 0, else Lc

    Differs from the plain policy gradient by removing the incentive to move r beyond the clip range;
    dual-clip bounds the loss of a negative-advantage token whose ratio exploded (`clip_c` must be > 1).
    Metrics: `clip_frac`, `clip_frac_lower` (dual-clip active), `approx_kl`.
    Schulman et al., PPO, arXiv:1707.06347; dual-clip, arXiv:1912.09729; clip-higher, DAPO arXiv:2503.14476.
    """
    if clip_c <= 1.0:
        raise ValueError(f"clip_c (dual-clip bound) must be > 1, got {clip_c}")
    loss_B_T, clipped_B_T = _clipped_surrogate(ratio(logp_B_T, old_logp_B_T), advantages_B_T, clip_low, clip_high)
    dual_B_T = -advantages_B_T * clip_c
    lower_B_T = (advantages_B_T < 0) & (loss_B_T > dual_B_T)
    loss_B_T = torch.where(lower_B_T, dual_B_T, loss_B_T)
    metrics = {
        "clip_frac": _frac(clipped_B_T, mask_B_T),
        "clip_frac_lower": _frac(lower_B_T, mask_B_T),
        "approx_kl": _approx_kl(logp_B_T, old_logp_B_T, mask_B_T),
    }
    return _weighted(loss_B_T, weights_B_T), metrics


@register_loss("gspo", verl="gspo")
def gspo(
    logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None,
    clip_low: float = 3e-4, clip_high: float = 4e-4,
):
    """GSPO: PPO clipping on the length-normalised sequence ratio.

        ŝ_i = Σ_t (logp - old_logp)·m / max(Σ_t m, 1)
        s_{i,t} = exp(min(sg(ŝ_i) + logp_t - sg(logp_t), 10))     value: sequence ratio, gradient: per token
        L = max(-A·s, -A·clip(s, 1-ε_low, 1+ε_high))

    Differs from PPO by clipping whole sequences (stable for MoE); the paper reduces with
    seq-mean-token-mean and ε_low 3e-4, ε_high 4e-4. Zheng et al., GSPO, arXiv:2507.18071.
    """
    mask_f_B_T = mask_B_T.to(logp_B_T.dtype)
    seq_log_ratio_B = ((logp_B_T - old_logp_B_T) * mask_f_B_T).sum(-1) / mask_f_B_T.sum(-1).clamp(min=1)
    log_ratio_B_T = seq_log_ratio_B.detach().unsqueeze(-1) + logp_B_T - logp_B_T.detach()
    ratio_B_T = torch.exp(torch.clamp(log_ratio_B_T, max=10.0))
    loss_B_T, clipped_B_T = _clipped_surrogate(ratio_B_T, advantages_B_T, clip_low, clip_high)
    metrics = {"clip_frac": _frac(clipped_B_T, mask_B_T), "approx_kl": _approx_kl(logp_B_T, old_logp_B_T, mask_B_T)}
    return _weighted(loss_B_T, weights_B_T), metrics


@register_loss("cispo", verl="cispo")
def cispo(
    logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None,
    clip_low: float | None = None, clip_high: float = 0.2,
):
    """CISPO: clip the importance weight, not the update; every token keeps its gradient.

        L = -sg(clip(r, 1-ε_low, 1+ε_high))·A·logp        (clip_low=None: no lower clip, as the paper)

    Differs from PPO, whose clipping zeroes the gradient of clipped tokens. Metrics: `clip_frac`.
    MiniMax-M1, arXiv:2506.13585.
    """
    ratio_B_T = ratio(logp_B_T, old_logp_B_T)
    lower = None if clip_low is None else 1 - clip_low
    clipped_ratio_B_T = torch.clamp(ratio_B_T, min=lower, max=1 + clip_high)
    loss_B_T = -clipped_ratio_B_T.detach() * advantages_B_T * logp_B_T
    metrics = {
        "clip_frac": _frac(clipped_ratio_B_T != ratio_B_T, mask_B_T),
        "approx_kl": _approx_kl(logp_B_T, old_logp_B_T, mask_B_T),
    }
    return _weighted(loss_B_T, weights_B_T), metrics


@register_loss("gmpo", reduction="seq-mean-token-mean", verl="geo_mean")
def gmpo(
    logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None,
    clip_low: float = 0.4, clip_high: float = 0.4,
):
    """GMPO: the geometric mean of token ratios, clipped sign-aware in log space (verl's `geo_mean`).

        Δ* = sgn(A)·min(sgn(A)·Δ, sgn(A)·clamp(Δ, -ε_low, ε_high)),   Δ = logp - old_logp
        ρ_i = exp(Σ_t Δ*·m / Σ_t m),   Ā_i = masked mean of A;   loss = mean_i(-Ā_i·ρ_i)

    Differs from GRPO's arithmetic mean of token ratios, which outliers dominate. Written as the per-token
    loss `-Ā_i·ρ_i` on every token of sequence i, which `seq-mean-token-mean` (declared) reduces to
    `mean_i(-Ā_i·ρ_i)`; token weights enter as their per-sequence geometric mean (as verl).
    Metrics: `clip_frac` (A > 0), `clip_frac_lower` (A < 0). Geometric-Mean Policy Optimization, arXiv:2507.20673.
    """
    delta_B_T = logp_B_T - old_logp_B_T
    sign_B_T = torch.sign(advantages_B_T)
    clamped_B_T = torch.clamp(delta_B_T, -clip_low, clip_high)
    delta_star_B_T = sign_B_T * torch.minimum(sign_B_T * delta_B_T, sign_B_T * clamped_B_T)
    mask_f_B_T = mask_B_T.to(logp_B_T.dtype)
    length_B = mask_f_B_T.sum(-1) + 1e-8
    ratio_B = torch.exp((delta_star_B_T * mask_f_B_T).sum(-1) / length_B)
    loss_B = -(advantages_B_T * mask_f_B_T).sum(-1) / length_B * ratio_B
    if weights_B_T is not None:
        loss_B = loss_B * torch.exp((torch.log(weights_B_T + 1e-10) * mask_f_B_T).sum(-1) / length_B)
    clipped_B_T = delta_star_B_T != delta_B_T
    metrics = {
        "clip_frac": _frac(clipped_B_T & (advantages_B_T > 0), mask_B_T),
        "clip_frac_lower": _frac(clipped_B_T & (advantages_B_T < 0), mask_B_T),
        "approx_kl": _approx_kl(logp_B_T, old_logp_B_T, mask_B_T),
    }
    return loss_B.unsqueeze(-1).expand_as(logp_B_T), metrics


@register_loss("sapo", reduction="seq-mean-token-mean", verl="sapo")
def sapo(
    logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None,
    tau_pos: float = 1.0, tau_neg: float = 1.05,
):
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip.

        τ = τ_pos if A > 0 else τ_neg;   L = -σ(τ(r - 1))·(4/τ)·A

    Differs from PPO by attenuating off-policy tokens smoothly (gradient ∝ σ'(τ(r-1)), 1 at r = 1);
    always reduced seq-mean-token-mean. Soft Adaptive Policy Optimization, arXiv:2511.20347.
    """
    tau_B_T = torch.where(advantages_B_T > 0, tau_pos, tau_neg).to(logp_B_T.dtype)
    gate_B_T = torch.sigmoid(tau_B_T * (ratio(logp_B_T, old_logp_B_T) - 1)) * (4 / tau_B_T)
    loss_B_T = -gate_B_T * advantages_B_T
    return _weighted(loss_B_T, weights_B_T), {"approx_kl": _approx_kl(logp_B_T, old_logp_B_T, mask_B_T)}


@register_loss("gpg", verl="gpg")
def gpg(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None):
    """GPG: the plain policy gradient, no ratio and no clipping.

        L = -A·logp

    Differs from PPO by dropping the surrogate (one update per batch). Chu et al., GPG, arXiv:2504.02546.
    """
    loss_B_T = -advantages_B_T * logp_B_T
    return _weighted(loss_B_T, weights_B_T), {"approx_kl": _approx_kl(logp_B_T, old_logp_B_T, mask_B_T)}


@register_loss("clip_cov", verl="clip_cov")
def clip_cov(
    logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None,
    clip_low: float = 0.2, clip_high: float = 0.2, cov_ratio: float = 2e-4,
    cov_low: float = 1.0, cov_high: float = 5.0, seed: int = 0,
):
    """Clip-Cov: PPO clipping, plus no gradient for a few high-covariance tokens (keeps entropy up).

        L = max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high)),   r = exp(logp - old_logp) unclamped, no dual-clip
        cov = (A - mean A)(logp - mean logp);  among valid unclipped tokens with cov_low < cov < cov_high,
        max(⌊cov_ratio·N⌋, 1) drawn at random (`seed`) get L = 0

    Differs from PPO by the covariance rule. Metrics: `clip_frac`, `cov_frac` (tokens zeroed).
    Cui et al., The Entropy Mechanism of RL for Reasoning LMs, arXiv:2505.22617.
    """
    ratio_B_T = torch.exp(logp_B_T - old_logp_B_T)
    loss_B_T, clipped_B_T = _clipped_surrogate(ratio_B_T, advantages_B_T, clip_low, clip_high)
    cov_B_T = _covariance(advantages_B_T, logp_B_T, mask_B_T)
    candidates_B_T = mask_B_T.bool() & ~clipped_B_T & (cov_B_T > cov_low) & (cov_B_T < cov_high)
    rows_N, cols_N = candidates_B_T.nonzero(as_tuple=True)
    num_chosen = max(int(cov_ratio * float(mask_B_T.sum())), 1)
    order_N = torch.randperm(len(rows_N), generator=torch.Generator().manual_seed(seed)).to(rows_N.device)
    zeroed_B_T = torch.zeros(candidates_B_T.shape, dtype=torch.bool, device=candidates_B_T.device)
    zeroed_B_T[rows_N[order_N[:num_chosen]], cols_N[order_N[:num_chosen]]] = True
    loss_B_T = loss_B_T.masked_fill(zeroed_B_T, 0.0)
    metrics = {
        "clip_frac": _frac(clipped_B_T, mask_B_T),
        "cov_frac": _frac(zeroed_B_T, mask_B_T),
        "approx_kl": _approx_kl(logp_B_T, old_logp_B_T, mask_B_T),
    }
    return _weighted(loss_B_T, weights_B_T), metrics


@register_loss("kl_cov", verl="kl_cov")
def kl_cov(
    logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None,
    cov_ratio: float = 2e-4, penalty_coef: float = 0.1,
):
    """KL-Cov: the unclipped surrogate, plus a KL penalty on the highest-covariance tokens.

        L = -A·r  (r unclamped);  the top max(⌊cov_ratio·N⌋, 1) valid tokens by
        cov = (A - mean A)(logp - mean logp) get  + penalty_coef·|logp - old_logp|

    Differs from PPO by replacing the clip with a targeted penalty. Metrics: `cov_frac`.
    Cui et al., The Entropy Mechanism of RL for Reasoning LMs, arXiv:2505.22617.
    """
    log_ratio_B_T = logp_B_T - old_logp_B_T
    loss_B_T = -advantages_B_T * torch.exp(log_ratio_B_T)
    valid_B_T = mask_B_T.bool()
    num_chosen = min(max(int(cov_ratio * int(valid_B_T.sum())), 1), int(valid_B_T.sum()))
    cov_B_T = _covariance(advantages_B_T, logp_B_T, mask_B_T).masked_fill(~valid_B_T, -torch.inf)
    penalised_N = torch.zeros(valid_B_T.numel(), dtype=torch.bool, device=valid_B_T.device)
    penalised_N[cov_B_T.flatten().topk(num_chosen).indices] = True
    penalised_B_T = penalised_N.view(valid_B_T.shape)
    loss_B_T = loss_B_T + penalty_coef * penalised_B_T * log_ratio_B_T.abs()
    metrics = {"cov_frac": _frac(penalised_B_T, mask_B_T), "approx_kl": _approx_kl(logp_B_T, old_logp_B_T, mask_B_T)}
    return _weighted(loss_B_T, weights_B_T), metrics


def _dppo(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, weights_B_T, trusted_B_T, clip_c):
    """`L = -A·sg(min(r, C))·logp` on trusted tokens, 0 elsewhere; shared by the DPPO variants."""
    ratio_B_T = ratio(logp_B_T, old_logp_B_T)
    trusted_B_T = trusted_B_T.detach()
    loss_B_T = -advantages_B_T * torch.clamp(ratio_B_T, max=clip_c).detach() * logp_B_T * trusted_B_T
    metrics = {
        "clip_frac": _frac(~trusted_B_T, mask_B_T),
        "clip_frac_lower": _frac((ratio_B_T > clip_c) & trusted_B_T, mask_B_T),
        "approx_kl": _approx_kl(logp_B_T, old_logp_B_T, mask_B_T),
    }
    return _weighted(loss_B_T, weights_B_T), metrics


@register_loss("dppo_tv", verl="dppo_tv")
def dppo_tv(
    logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None,
    threshold_low: float = 0.15, threshold_high: float = 0.15, clip_c: float = 20.0,
):
    """DPPO (binary total variation): trust a token while its probability moved less than a threshold.

        trusted = p - p_old ≤ δ_high if A > 0 else p - p_old ≥ -δ_low;   L = -A·sg(min(r, C))·logp·trusted

    Differs from PPO by bounding the change of probability, not of the ratio (rare tokens may move).
    Metrics: `clip_frac` (untrusted), `clip_frac_lower` (ratio truncated at C). DPPO, arXiv:2602.04879.
    """
    prob_change_B_T = torch.exp(logp_B_T) - torch.exp(old_logp_B_T)
    trusted_B_T = torch.where(advantages_B_T > 0, prob_change_B_T <= threshold_high, prob_change_B_T >= -threshold_low)
    return _dppo(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, weights_B_T, trusted_B_T, clip_c)


@register_loss("dppo_kl", verl="dppo_kl")
def dppo_kl(
    logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None,
    threshold_low: float = 0.05, threshold_high: float = 0.05, clip_c: float = 20.0,
):
    """DPPO (binary KL): trust a token while the binary KL of its probability stays under a threshold.

        bkl = p_old·log(p_old/p) + (1-p_old)·log((1-p_old+1e-8)/(1-p+1e-8))
        trusted = bkl ≤ δ_high or p ≤ p_old if A > 0, else bkl ≤ δ_low or p ≥ p_old
        L = -A·sg(min(r, C))·logp·trusted

    Differs from `dppo_tv` by the divergence. DPPO, arXiv:2602.04879.
    """
    prob_B_T, old_prob_B_T = torch.exp(logp_B_T), torch.exp(old_logp_B_T)
    binary_kl_B_T = old_prob_B_T * (old_logp_B_T - logp_B_T) + (1 - old_prob_B_T) * torch.log(
        (1 - old_prob_B_T + 1e-8) / (1 - prob_B_T + 1e-8)
    )
    trusted_B_T = torch.where(
        advantages_B_T > 0,
        (binary_kl_B_T <= threshold_high) | (prob_B_T <= old_prob_B_T),
        (binary_kl_B_T <= threshold_low) | (prob_B_T >= old_prob_B_T),
    )
    return _dppo(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, weights_B_T, trusted_B_T, clip_c)


@register_loss("dro", verl="dro")
def dro(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, *, weights_B_T=None, beta: float):
    """DRO: the policy gradient with a quadratic penalty on the log-ratio instead of a clip.

        L = -(logp·A - ½β(logp - old_logp)²)         β > 0, required (no default)

    Differs from `gpg` (`L = -A·logp`) by the penalty, which pulls logp back towards old_logp in
    proportion to how far it moved (gradient `-A + β(logp - old_logp)`). verl 0.9.1's `dro` policy loss;
    Richemond et al., Offline Regularised RL for LLM Alignment (Direct Reward Optimisation), arXiv:2405.19107.
    """
    if not beta > 0:
        raise ValueError(f"dro needs beta > 0 (the weight of the quadratic log-ratio penalty), got {beta}")
    loss_B_T = -(logp_B_T * advantages_B_T - 0.5 * beta * (logp_B_T - old_logp_B_T) ** 2)
    return _weighted(loss_B_T, weights_B_T), {"approx_kl": _approx_kl(logp_B_T, old_logp_B_T, mask_B_T)}
