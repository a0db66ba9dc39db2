"""Rollout correction: the sampler and the trainer disagree (other kernels, dtypes, stale weights).

`log ρ_t = old_logp_t - sampler_logp_t` is the log-ratio of the trainer's probability of a sampled token
to the sampler's. Its statistic is taken per token, per sequence (`Σ_t log ρ_t`) or as the per-sequence
geometric mean (`mean_t log ρ_t`), and turned into detached importance weights that multiply the per-token
policy loss, or into a rejection mask. `Rejection` rules add verl 0.9.1's rejection on divergence statistics
(k1, k2, k3 per token, or a sequence's sum, mean or max of them). docs/algorithms.md lists the named corrections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .core import kl, masked_mean

LEVELS = ("token", "sequence", "geometric")
MODES = ("tis", "mask", "reject")
STATS = ("k1", "k2", "k3")
REJECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")

_DIVERGENCES = {
    "k1": lambda log_rho: -log_rho,
    "k2": lambda log_rho: 0.5 * log_rho.square(),
    "k3": lambda log_rho: log_rho.exp() - 1 - log_rho,
}


def log_ratio(
    old_logp_B_T: torch.Tensor, sampler_logp_B_T: torch.Tensor, mask_B_T: torch.Tensor, level: str
) -> torch.Tensor:
    """`clamp(log ρ, ±20)` at `level`, broadcast to every token of its sequence (0 on invalid tokens)."""
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

    `sampler_mismatch_mean` / `_max` = mean / max |Δlogp|; `sampler_kl` = k1 and `sampler_kl_k3` = k3
    estimates of KL(sampler ‖ trainer); `sampler_ratio_max` / `_min` = extreme token ratios `ρ_t`
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


def _check_band(low: float | None, high: float) -> None:
    if not high > 0 or not 0 < (1.0 / high if low is None else low) <= high:
        raise ValueError(f"need 0 < low <= high, got low={low}, high={high}")


@dataclass(frozen=True)
class Rejection:
    """A rejection rule on a divergence statistic of `log ρ` (verl 0.9.1 `rollout_rs`, docs/algo/rollout_corr.md).

        per token, log ρ clamped at ±20:   k1 = -log ρ      k2 = ½(log ρ)²      k3 = ρ - 1 - log ρ
        level   token: each token's k      seq_sum: Σ_t k      seq_mean: Σ_t k / n_valid      seq_max: max_t k
        keep    k1: log low <= statistic <= log high      k2, k3: statistic <= high

    `low` / `high` of k1 are ratios, as verl's `"0.5_2.0"`: `Rejection("k1", "seq_sum", high=2.0)` keeps
    the sequences whose ratio `Π_t ρ_t` lies in [1/2, 2]. A sequence-level rule keeps or drops every token of
    its sequence; seq_max exists for k2 and k3 only (k1 is signed: use a band on its sum or mean).
    """

    stat: str
    """"k1", "k2" or "k3"."""
    level: str
    """"token", "seq_sum", "seq_mean" or "seq_max" (k2, k3)."""
    high: float
    """Upper bound: k1's ratio U (the band [log L, log U] on k1), k2's or k3's bound on the statistic."""
    low: float | None = None
    """k1's ratio L (None means `1/high`); k2 and k3 take no lower bound."""

    def __post_init__(self):
        if self.stat not in STATS:
            raise ValueError(f"unknown rejection statistic {self.stat!r}; valid: {', '.join(STATS)}")
        if self.level not in REJECTION_LEVELS:
            raise ValueError(f"unknown rejection level {self.level!r}; valid: {', '.join(REJECTION_LEVELS)}")
        if self.stat == "k1" and self.level == "seq_max":
            raise ValueError("rejection level 'seq_max' takes k2 or k3; k1 is signed: valid levels for k1: "
                             "token, seq_sum, seq_mean")
        if self.stat == "k1":
            _check_band(self.low, self.high)
        elif self.low is not None or not self.high > 0:
            raise ValueError(f"{self.stat} takes only an upper bound high > 0, got low={self.low}, high={self.high}")

    def keep(self, log_rho_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
        """1 where this rule keeps a token, 0 where it drops it; `log_rho_B_T` is the clamped token log-ratio."""
        mask_B_T = mask_B_T.to(log_rho_B_T.dtype)
        k_B_T = _DIVERGENCES[self.stat](log_rho_B_T) * mask_B_T
        if self.level == "seq_sum":
            k_B_T = k_B_T.sum(-1, keepdim=True)  # [B, 1]
        elif self.level == "seq_mean":
            k_B_T = masked_mean(k_B_T, mask_B_T, dim=-1).unsqueeze(-1)
        elif self.level == "seq_max":
            k_B_T = k_B_T.amax(-1, keepdim=True)  # k2, k3 >= 0: the 0 of an invalid token never wins
        if self.stat == "k1":
            low = 1.0 / self.high if self.low is None else self.low
            inside_B_T = (k_B_T >= math.log(low)) & (k_B_T <= math.log(self.high))
        else:
            inside_B_T = k_B_T <= self.high
        return inside_B_T.to(mask_B_T.dtype).expand_as(mask_B_T)


@dataclass(frozen=True)
class RolloutCorrection:
    """Importance weights or rejection for sampler/trainer mismatch.

        w = exp(clamp(log ρ, ±20)) at `level`
        mode tis       weights = min(w, high)                  truncated IS (Yao et al. 2025, "Your efficient
                                                               RL framework secretly brings you off-policy RL")
        mode mask      weights = w·1[low ≤ w ≤ high]           IcePop (Ring-1T report, 2025) / masked IS
        mode reject    mask = mask·1[low ≤ w ≤ high]           rejection: dropped tokens also leave the token
                       weights 1                               counts of the reduction (mask mode keeps them)
        mode None      weights 1                               no IS: only the `reject` rules act
        normalize      weights /= their batch mean             verl's rollout_is_batch_normalize
        reject=rules   mask = mask·Π_rules keep                `Rejection` rules, ANDed (verl's rollout_rs)

    Call it with `(old_logp_B_T, sampler_logp_B_T, mask_B_T)`; it returns detached `weights_B_T` (pass
    them to the loss as `weights_B_T`), the mask to train on (the session also computes advantages on it),
    and metrics: the mean weight; `outside_frac`, the fraction of valid tokens truncated (tis) or zeroed /
    dropped by the band (mask, reject); `rejected_frac`, the fraction of valid tokens that leave the mask
    (the "reject" band and the rules together). The mismatch itself is `mismatch_metrics`. Named
    corrections (`names("correction")`: "token_tis", "mis", ...) are accepted wherever one is.
    """

    level: str = "token"
    """"token" (per-token ratio), "sequence" (product over the sequence) or "geometric" (its geometric mean)."""
    mode: str | None = "tis"
    """"tis" truncates weights at `high`; "mask" zeroes weights outside [low, high]; "reject" drops them;
    None computes no weights (only the `reject` rules act)."""
    low: float | None = None
    """Lower bound of the band for "mask" and "reject"; None means `1/high`."""
    high: float = 2.0
    """TIS cap, and upper bound of the band."""
    reject: tuple[Rejection, ...] = ()
    """Rejection rules (a `Rejection` or several): a token is trained on only if every rule keeps it."""
    normalize: bool = False
    """Divide the weights by their mean over the batch's valid tokens (at token level) or over its
    sequences' weights (sequence, geometric), after truncation or masking; rejected tokens count in the mean,
    as in verl 0.9.1 (its IS weights are computed on the response mask, before rejection)."""

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"unknown correction level {self.level!r}; valid: {', '.join(LEVELS)}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"unknown correction mode {self.mode!r}; valid: {', '.join(MODES)}, None")
        _check_band(self.low, self.high)
        rules = (self.reject,) if isinstance(self.reject, Rejection) else tuple(self.reject)
        if not all(isinstance(rule, Rejection) for rule in rules):
            raise TypeError(f"reject takes Rejection rules, got {self.reject!r}")
        object.__setattr__(self, "reject", rules)
        if self.normalize and self.mode not in ("tis", "mask"):
            raise ValueError(f"normalize needs importance weights: mode 'tis' or 'mask', got {self.mode!r}")

    @property
    def lower(self) -> float:
        """The lower bound of the band actually used."""
        return 1.0 / self.high if self.low is None else self.low

    def __call__(
        self, old_logp_B_T: torch.Tensor, sampler_logp_B_T: torch.Tensor, mask_B_T: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        with torch.no_grad():
            valid_B_T = mask_B_T.to(old_logp_B_T.dtype)
            w_B_T = log_ratio(old_logp_B_T, sampler_logp_B_T, mask_B_T, self.level).exp()
            inside_B_T = ((w_B_T >= self.lower) & (w_B_T <= self.high)).to(w_B_T.dtype)
            if self.mode == "tis":
                weights_B_T, outside_B_T = w_B_T.clamp(max=self.high), (w_B_T > self.high).to(w_B_T.dtype)
            elif self.mode == "mask":
                weights_B_T, outside_B_T = w_B_T * inside_B_T, 1 - inside_B_T
            else:
                weights_B_T = torch.ones_like(w_B_T)
                outside_B_T = 1 - inside_B_T if self.mode == "reject" else torch.zeros_like(w_B_T)
            weights_B_T = weights_B_T * valid_B_T
            if self.normalize:
                weights_B_T = self._normalized(weights_B_T, valid_B_T)
            keeps = [inside_B_T] if self.mode == "reject" else []
            if self.reject:
                log_rho_B_T = log_ratio(old_logp_B_T, sampler_logp_B_T, mask_B_T, "token")
                keeps += [rule.keep(log_rho_B_T, valid_B_T) for rule in self.reject]
            new_mask_B_T = mask_B_T * torch.stack(keeps).prod(0) if keeps else mask_B_T
            weights_B_T = weights_B_T * new_mask_B_T.to(w_B_T.dtype)
            metrics = {"correction/weight_mean": masked_mean(weights_B_T, new_mask_B_T),
                       "correction/outside_frac": masked_mean(outside_B_T, mask_B_T),
                       "correction/rejected_frac": masked_mean(1 - new_mask_B_T.to(w_B_T.dtype), mask_B_T)}
        return weights_B_T, new_mask_B_T, metrics

    def _normalized(self, weights_B_T: torch.Tensor, valid_B_T: torch.Tensor) -> torch.Tensor:
        """`weights / mean`: the masked token mean at token level, else the mean of the per-sequence weights
        over the sequences with a valid token; unchanged when the mean is ~0 (verl 0.9.1)."""
        if self.level == "token":
            mean = masked_mean(weights_B_T, valid_B_T)
        else:
            seq_weights_B = masked_mean(weights_B_T, valid_B_T, dim=-1)  # one weight per sequence
            mean = masked_mean(seq_weights_B, valid_B_T.sum(-1) > 0)
        return torch.where(mean > 1e-8, weights_B_T / mean, weights_B_T)
