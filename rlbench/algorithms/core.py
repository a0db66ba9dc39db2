"""Shared tensor math: masked statistics, token log-probs and ratios, outcome rewards, the loss reduction,
KL estimators, entropy, the critic loss; a metric's value as a Python float.

Notation (docs/algorithms.md): `B` responses, `T` response tokens, `mask_B_T` is 1 on tokens the policy
generated. Every function here is pure and works on any device and float dtype.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

REDUCTIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+")


def token_logp(logits_B_T_V: torch.Tensor, ids_B_T: torch.Tensor) -> torch.Tensor:
    """`log softmax(logits)[id]` per token, without materialising the whole log-softmax (the one
    definition the sampler and the trainer share: their log-probs then agree by construction)."""
    return logits_B_T_V.gather(-1, ids_B_T[..., None]).squeeze(-1) - logits_B_T_V.logsumexp(-1)


def token_logp_and_sum_pi2(logits_B_T_V: torch.Tensor, ids_B_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logp` and `Σ_v π_v² = exp(logsumexp(2z) - 2·logsumexp(z))` per token (OTB's input), from one
    `logsumexp(z)`; the probabilities `[B, T, V]` are never materialised (only `2z`, once)."""
    lse_B_T = logits_B_T_V.logsumexp(-1)
    logp_B_T = logits_B_T_V.gather(-1, ids_B_T[..., None]).squeeze(-1) - lse_B_T
    return logp_B_T, torch.exp((2 * logits_B_T_V).logsumexp(-1) - 2 * lse_B_T)


def ratio(logp_B_T: torch.Tensor, old_logp_B_T: torch.Tensor, max_log_ratio: float = 20.0) -> torch.Tensor:
    """The importance ratio `r = exp(clamp(logp - old_logp, ±max_log_ratio))` (the clamp keeps it finite)."""
    return torch.exp(torch.clamp(logp_B_T - old_logp_B_T, -max_log_ratio, max_log_ratio))


def outcome_rewards(reward_B: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """Token-level rewards `[B, T]`: each sample's score on its last valid token, 0 elsewhere.

    The last valid token is the last position where the mask is 1: with a multi-turn loss mask, which has
    holes (tool output between sampled turns), it is not `Σ m - 1`. A row without valid token gets nothing.
    """
    rewards_B_T = torch.zeros(mask_B_T.shape, dtype=torch.float32, device=mask_B_T.device)
    positions_B_T = torch.arange(mask_B_T.shape[-1], device=mask_B_T.device).expand(mask_B_T.shape)
    last_B = positions_B_T.masked_fill(~mask_B_T.bool(), -1).amax(-1).clamp(min=0)
    rewards_B_T[torch.arange(len(reward_B)), last_B] = reward_B.float()
    return rewards_B_T * mask_B_T


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """`Σ x·m / (Σ m + 1e-8)` over `dim` (over everything when `dim` is None), verl's `masked_mean`."""
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim=dim) / (mask.sum(dim=dim) + 1e-8)


def to_float(x: torch.Tensor) -> float:
    """A one-element tensor as a Python float; a float32 one (or narrower) as the shortest decimal that rounds back
    to it in float32: 0.36, not 0.36000001430511475 (float32's value nearest 0.36, written out in float64). What
    the metrics dicts hold; a float64 tensor's value is kept as it is."""
    value = float(x.item())
    if x.dtype == torch.float64 or not x.is_floating_point() or not math.isfinite(value):
        return value
    for digits in range(1, 9):
        short = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", short))[0] == value:
            return short
    return float(f"{value:.9g}")  # 9 significant digits always round-trip in float32


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased masked variance `masked_mean((x - mean)², m) · N/(N-1)` with `N = Σ m`.

    Like verl, fewer than two valid elements is an error (the unbiased variance does not exist).
    """
    n = mask.to(x.dtype).sum()
    if n < 2:
        raise ValueError(f"masked_var needs at least 2 valid elements, got {int(n)}")
    centered = x - masked_mean(x, mask)
    return masked_mean(centered**2, mask) * n / (n - 1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`(x - masked_mean) · rsqrt(masked_var + 1e-8)`, statistics over the whole batch."""
    return (x - masked_mean(x, mask)) * torch.rsqrt(masked_var(x, mask) + 1e-8)


def group_index(group_ids_B, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense group index `g_B` in `[0, G)` for arbitrary integer ids, and the group sizes `n_G`."""
    _, g_B = torch.unique(torch.as_tensor(group_ids_B, device=device), return_inverse=True)
    return g_B, torch.bincount(g_B)


def _count(n, like: torch.Tensor) -> torch.Tensor:
    """A token or sequence count as a tensor, at least 1 (an empty batch reduces to 0, not NaN)."""
    return torch.as_tensor(n, dtype=like.dtype, device=like.device).clamp(min=1)


def aggregate(
    loss_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens=None,
    num_seqs=None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

        token-mean               Σ L·m / N                              (DAPO, arXiv:2503.14476; the default)
        token-sum                Σ L·m
        seq-mean-token-sum       Σ_i (Σ_t L·m) / B
        seq-mean-token-mean      Σ_i (Σ_t L·m / (Σ_t m + 1e-8)) / B     (original GRPO, GSPO)
        seq-mean-token-sum-norm  Σ L·m / (B·T_norm)                     (Dr.GRPO, arXiv:2503.20783)

    The modes are verl 0.9.1's `loss_agg_mode` values, under the same names.

    `num_tokens` (N) and `num_seqs` (B) are the counts of the whole mini-batch across ranks; the trainer
    passes them when it splits the mini-batch into micro-batches, so that the summed micro-batch losses equal
    the mini-batch loss whatever the split. They default to this tensor's own counts (`mask.sum()`, rows).
    `norm_length` is `T_norm` (default `mask.shape[-1]`: pass a constant when micro-batches are padded
    to different lengths).
    """
    mask_B_T = mask_B_T.to(loss_B_T.dtype)
    token_sum_B = (loss_B_T * mask_B_T).sum(-1)
    seqs = _count(loss_B_T.shape[0] if num_seqs is None else num_seqs, loss_B_T)
    if mode == "token-mean":
        return token_sum_B.sum() / _count(mask_B_T.sum() if num_tokens is None else num_tokens, loss_B_T)
    if mode == "token-sum":
        return token_sum_B.sum()
    if mode == "seq-mean-token-sum":
        return token_sum_B.sum() / seqs
    if mode == "seq-mean-token-mean":
        return (token_sum_B / (mask_B_T.sum(-1) + 1e-8)).sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        return token_sum_B.sum() / (seqs * (mask_B_T.shape[-1] if norm_length is None else norm_length))
    raise ValueError(f"unknown reduction mode {mode!r}; valid: {', '.join(REDUCTIONS)}")


def _k3(diff: torch.Tensor) -> torch.Tensor:
    kappa = torch.clamp(-diff, -20, 20)  # ref_logp - logp
    return torch.clamp(torch.exp(kappa) - kappa - 1, -10, 10)


_KL_ESTIMATORS = {"k1": lambda d: d, "abs": torch.abs, "k2": lambda d: 0.5 * d.square(), "k3": _k3}


def kl(logp_B_T: torch.Tensor, ref_logp_B_T: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference, `k = logp - ref_logp`.

        k1    k                                                  (unbiased, signed)
        abs   |k|
        k2    ½k²
        k3    clamp(e^κ - κ - 1, -10, 10),  κ = clamp(-k, -20, 20)    (GRPO's choice, arXiv:2402.03300)

    A `+` suffix (`"k3+"`) is straight-through: the value of the base estimator, the gradient of k2
    (the unbiased gradient of KL). Schulman, "Approximating KL divergence" (2020). verl 0.9.1 takes the same
    names, `+` included, for the KL in the loss (`actor.kl_loss_type`, with `use_kl_loss` and `kl_loss_coef`:
    `Algorithm.kl_estimator` and `kl_coef`) and in the reward (`algorithm.kl_penalty`); it also calls k1 `kl`,
    k2 `mse` and k3 `low_var_kl`.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_KINDS)}")
    diff_B_T = logp_B_T - ref_logp_B_T
    value_B_T = _KL_ESTIMATORS[kind.removesuffix("+")](diff_B_T)
    if not kind.endswith("+"):
        return value_B_T
    k2_B_T = 0.5 * diff_B_T.square()
    return k2_B_T - k2_B_T.detach() + value_B_T.detach()


def kl_in_reward(
    rewards_B_T: torch.Tensor,
    logp_B_T: torch.Tensor,
    ref_logp_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    coef: float,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL in the reward, PPO's way: `r_t ← r_t - β·kl_t` on valid tokens.

    `logp_B_T` are the log-probs of the policy that produced the batch. Returns the penalised rewards and
    the batch KL `mean_i masked_mean_t(kl)` (detached), the value `AdaptiveKL.update` expects. Set by
    `Algorithm.reward_kl_coef` (β) and `reward_kl_estimator`: verl 0.9.1's `algorithm.use_kl_in_reward`,
    `kl_ctrl.kl_coef` and `kl_penalty`.
    """
    kl_B_T = kl(logp_B_T, ref_logp_B_T, kind) * mask_B_T.to(logp_B_T.dtype)
    batch_kl = masked_mean(kl_B_T, mask_B_T, dim=-1).mean()
    return rewards_B_T - coef * kl_B_T, batch_kl.detach()


@dataclass
class AdaptiveKL:
    """The KL-in-reward coefficient β, fixed (`target=None`) or adaptive (Ziegler et al., arXiv:1909.08593).

        β ← β·(1 + clip(KL/target - 1, -0.2, 0.2)·n/horizon)

    `n` is the number of responses the KL was measured on. Set by `Algorithm.reward_kl_target` and
    `reward_kl_horizon`: verl 0.9.1's `algorithm.kl_ctrl` (`type: adaptive`, `target_kl`, `horizon`).
    """

    coef: float
    """Current β."""
    target: float | None = 0.1
    """Target KL; None keeps β fixed."""
    horizon: float = 10000
    """Responses over which β may change by at most 20%."""

    def update(self, kl_value: float, n_steps: int) -> float:
        """Move β toward the target KL and return it."""
        if self.target is not None:
            error = min(max(float(kl_value) / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * n_steps / self.horizon
        return self.coef


def entropy_from_logits(logits_B_T_V: torch.Tensor) -> torch.Tensor:
    """Token entropy `H = logsumexp(z) - Σ softmax(z)·z` from logits `z` over the vocabulary."""
    probs_B_T_V = torch.softmax(logits_B_T_V, dim=-1)
    return torch.logsumexp(logits_B_T_V, dim=-1) - (probs_B_T_V * logits_B_T_V).sum(-1)


def value_loss(
    values_B_T: torch.Tensor,
    old_values_B_T: torch.Tensor,
    returns_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    clip_range: float = 0.5,
    mode: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss `½·agg(max((v - R)², (clip(v, v_old - c, v_old + c) - R)²))` (PPO, arXiv:1707.06347).

    Metrics: `vf_clip_frac`, the fraction of valid tokens where the clipped term is the larger.
    """
    clipped_B_T = torch.clamp(values_B_T, old_values_B_T - clip_range, old_values_B_T + clip_range)
    unclipped_loss_B_T = (values_B_T - returns_B_T) ** 2
    clipped_loss_B_T = (clipped_B_T - returns_B_T) ** 2
    loss_B_T = torch.maximum(unclipped_loss_B_T, clipped_loss_B_T)
    loss = 0.5 * aggregate(
        loss_B_T, mask_B_T, mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length
    )
    clip_frac = masked_mean((clipped_loss_B_T > unclipped_loss_B_T).to(loss_B_T.dtype), mask_B_T)
    return loss, {"vf_loss": loss.detach(), "vf_clip_frac": clip_frac.detach()}


REVERSE_KL_KINDS = ("k1", "k3")
"""Estimators of the per-token reverse KL the distillation advantage takes (`kl`'s k1 and k3)."""


def reverse_kl_advantages(old_logp_B_T: torch.Tensor, teacher_logp_B_T: torch.Tensor, mask_B_T: torch.Tensor,
                          estimator: str = "k1") -> torch.Tensor:
    """`-k(logπ_student, logπ_teacher)` per sampled token, 0 on invalid tokens.

        k1 = logπ_s - logπ_t        k3 = e^κ - κ - 1,  κ = logπ_t - logπ_s

    Both estimate KL(π_s || π_t) on tokens drawn from π_s; k1 is unbiased and signed, k3 non-negative (see `kl`).
    """
    if estimator not in REVERSE_KL_KINDS:
        raise ValueError(f"unknown reverse-KL estimator {estimator!r}; valid: {', '.join(REVERSE_KL_KINDS)}")
    return -kl(old_logp_B_T, teacher_logp_B_T, estimator) * mask_B_T


def teacher_topk(logits_B_T_V: torch.Tensor, k: int, vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's `k` most likely tokens per position: `(log-probs [B, T, k], ids [B, T, k])`, the
    log-probs normalised over the whole vocabulary. `vocab` limits the candidates to the first ids (a teacher
    whose embedding has more padding rows than the student's); `k` at least the vocabulary: the full
    distribution."""
    candidates_B_T_V = logits_B_T_V if vocab is None else logits_B_T_V[..., :vocab]
    values_B_T_K, ids_B_T_K = candidates_B_T_V.topk(min(k, candidates_B_T_V.shape[-1]), dim=-1)
    return values_B_T_K - logits_B_T_V.logsumexp(-1, keepdim=True), ids_B_T_K


def forward_kl_topk(student_topk_logp_B_T_K: torch.Tensor, teacher_topk_logp_B_T_K: torch.Tensor):
    """Forward KL to the teacher over its top-k tokens (verl's `forward_kl_topk`; GKD's supervised term):

        D_t = Σ_{v ∈ topk_t} p_t(v)·(log p_t(v) - log q_s(v)),   p the teacher, q the student, both normalised over
        the whole vocabulary (not renormalised on the top-k; with k = V it is the exact KL(p || q)). With k < V its
        minimum is not q = p but q = p renormalised on the top-k: the term also pulls mass off the teacher's tail.

    Returns `(D_B_T, teacher_mass_B_T, student_mass_B_T)`: the term, and the probability each puts on the top-k."""
    p_B_T_K = teacher_topk_logp_B_T_K.exp()
    divergence_B_T = (p_B_T_K * (teacher_topk_logp_B_T_K - student_topk_logp_B_T_K)).sum(-1)
    return divergence_B_T, p_B_T_K.sum(-1), student_topk_logp_B_T_K.exp().sum(-1)
