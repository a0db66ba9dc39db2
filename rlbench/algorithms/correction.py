"""Rollout correction: the sampler and the trainer disagree (other kernels, dtypes, stale weights).

``log ρ_t = old_logp_t - sampler_logp_t`` is the log-ratio of the trainer's probability of a sampled token
to the sampler's (ALGORITHMS.md §6). Its statistic is taken per token, per sequence (``Σ_t log ρ_t``) or as
the per-sequence geometric mean (``mean_t log ρ_t``), and turned into detached importance weights that
multiply the per-token policy loss, or into a rejection mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .core import kl, masked_mean

LEVELS = ("token", "sequence", "geometric")
MODES = ("tis", "mask", "reject")


def log_ratio(
    old_logp_B_T: torch.Tensor, sampler_logp_B_T: torch.Tensor, mask_B_T: torch.Tensor, level: str
) -> torch.Tensor:
    """``clamp(log ρ, ±20)`` at ``level``, broadcast to every token of its sequence (0 on invalid tokens)."""
    mask_B_T = mask_B_T.to(old_logp_B_T.dtype)
    log_rho_B_T = (old_logp_B_T - sampler_logp_B_T) * mask_B_T
    if level == "sequence":
        log_rho_B_T = log_rho_B_T.sum(-1, keepdim=True) * mask_B_T
    elif level == "geometric":
        log_rho_B_T = masked_mean(log_rho_B_T, mask_B_T, dim=-1).unsqueeze(-1) * mask_B_T
    return torch.clamp(log_rho_B_T, -20, 20)


def mismatch_metrics(
    old_logp_B_T: torch.Tensor, sampler_logp_B_T: torch.Tensor, mask_B_T: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the sampler is from the trainer on the sampled tokens; a broken weight sync shows here first.

    ``sampler_mismatch_mean`` / ``_max`` = mean / max |Δlogp|; ``sampler_kl`` = k1 and ``sampler_kl_k3`` = k3
    estimates of KL(sampler ‖ trainer); ``sampler_ratio_max`` / ``_min`` = extreme token ratios ``ρ_t``
    (Δlogp clamped at ±20). The one place these are computed (the session logs them once per step).
    """
    old_logp_B_T, sampler_logp_B_T = old_logp_B_T.detach(), sampler_logp_B_T.detach()
    valid_B_T = mask_B_T.bool()
    log_rho_B_T = torch.clamp(old_logp_B_T - sampler_logp_B_T, -20, 20)
    abs_B_T = log_rho_B_T.abs().masked_fill(~valid_B_T, 0.0)
    return {
        "sampler_mismatch_mean": masked_mean(abs_B_T, mask_B_T),
        "sampler_mismatch_max": abs_B_T.max() if abs_B_T.numel() else abs_B_T.new_zeros(()),
        "sampler_kl": masked_mean(kl(sampler_logp_B_T, old_logp_B_T, "k1"), mask_B_T),
        "sampler_kl_k3": masked_mean(kl(sampler_logp_B_T, old_logp_B_T, "k3"), mask_B_T),
        "sampler_ratio_max": log_rho_B_T.masked_fill(~valid_B_T, -torch.inf).max().exp(),
        "sampler_ratio_min": log_rho_B_T.masked_fill(~valid_B_T, torch.inf).min().exp(),
    }


@dataclass(frozen=True)
class RolloutCorrection:
    """Importance weights or rejection for sampler/trainer mismatch (ALGORITHMS.md §6).

        w = exp(clamp(log ρ, ±20)) at ``level``
        tis     weights = min(w, high)                       truncated IS (Yao et al. 2025, "Your efficient
                                                             RL framework secretly brings you off-policy RL")
        mask    weights = w·1[low ≤ w ≤ high]                IcePop (Ring-1T report, 2025) / masked IS
        reject  mask    = mask·1[low ≤ w ≤ high], weights 1  rejection: dropped tokens also leave the token
                                                             counts of the reduction (mask mode keeps them)

    Call it with ``(old_logp_B_T, sampler_logp_B_T, mask_B_T)``; it returns detached ``weights_B_T`` (pass
    them to the loss as ``weights_B_T``), the mask to train on, and metrics: the mean weight, and
    ``outside_frac``, the fraction of valid tokens truncated (tis) or zeroed / dropped (the mismatch itself is
    ``mismatch_metrics``).
    """

    level: str = "token"
    """"token" (per-token ratio), "sequence" (product over the sequence) or "geometric" (its geometric mean)."""
    mode: str = "tis"
    """"tis" truncates weights at ``high``; "mask" zeroes weights outside [low, high]; "reject" drops them."""
    low: float | None = None
    """Lower bound of the band for "mask" and "reject"; None means ``1/high``."""
    high: float = 2.0
    """TIS cap, and upper bound of the band."""

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"unknown correction level {self.level!r}; valid: {', '.join(LEVELS)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown correction mode {self.mode!r}; valid: {', '.join(MODES)}")
        if not 0 < self.lower <= self.high:
            raise ValueError(f"need 0 < low <= high, got low={self.lower}, high={self.high}")

    @property
    def lower(self) -> float:
        """The lower bound of the band actually used."""
        return 1.0 / self.high if self.low is None else self.low

    def __call__(
        self, old_logp_B_T: torch.Tensor, sampler_logp_B_T: torch.Tensor, mask_B_T: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        with torch.no_grad():
            w_B_T = log_ratio(old_logp_B_T, sampler_logp_B_T, mask_B_T, self.level).exp()
            inside_B_T = ((w_B_T >= self.lower) & (w_B_T <= self.high)).to(w_B_T.dtype)
            outside_B_T = (w_B_T > self.high).to(w_B_T.dtype) if self.mode == "tis" else 1 - inside_B_T
            new_mask_B_T = mask_B_T * inside_B_T if self.mode == "reject" else mask_B_T
            if self.mode == "tis":
                weights_B_T = w_B_T.clamp(max=self.high)
            elif self.mode == "mask":
                weights_B_T = w_B_T * inside_B_T
            else:
                weights_B_T = torch.ones_like(w_B_T)
            weights_B_T = weights_B_T * new_mask_B_T.to(w_B_T.dtype)
            metrics = {"correction/weight_mean": masked_mean(weights_B_T, new_mask_B_T),
                       "correction/outside_frac": masked_mean(outside_B_T, mask_B_T)}
        return weights_B_T, new_mask_B_T, metrics
