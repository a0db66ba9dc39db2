"""Optimal Token Baseline: a per-group, per-position baseline weighted by realized energy.

verl 0.9.1 docs/algo/otb.md; Li et al., Optimal Token Baseline, arXiv:2602.07078. Both estimators read
`sum_pi2_B_T` (`Σ_v π_v²` per token, from the policy's old-log-prob forward) and `old_logp_B_T`, and the
rollout-IS weights `is_weights_B_T` when the algorithm has a rollout correction.
"""

from __future__ import annotations

import torch

from .advantages import _group_sum, _returns_to_go
from .core import group_index
from .registry import register_advantage


def _energy(mask_B_T, old_logp_B_T, sum_pi2_B_T, is_weights_B_T, name: str) -> torch.Tensor:
    """Per-token `w_t = (1 - 2π_t + Σ_v π_v²)·ρ̄_t²` (ρ̄ = 1 without IS weights), 0 on invalid tokens."""
    if sum_pi2_B_T is None or old_logp_B_T is None:
        raise ValueError(f"{name} needs sum_pi2_B_T (Σ_v π_v² per token, from the policy's old-log-prob forward: "
                         f"Policy.log_probs(batch, sum_pi2=True); a session computes it when Algorithm.needs_sum_pi2) and "
                         f"old_logp_B_T")
    w_B_T = 1 - 2 * old_logp_B_T.exp() + sum_pi2_B_T
    if is_weights_B_T is not None:
        w_B_T = w_B_T * is_weights_B_T**2
    return w_B_T * mask_B_T


def _optimal_baseline(returns_B_T, energy_B_T, mask_B_T, group_ids, zero_tail: bool, epsilon: float,
                      count_empty: bool):
    """`B_t = Σ_i G_{i,t} W_{i,t} m_{i,t} / (Σ_i W_{i,t} m_{i,t} + ε)` per group and position, `W = cumsum(w)`;
    0 for a group of one (trajectories without a valid token count unless not `count_empty`, as verl's TIR-OTB),
    and past the second-longest length for a uniquely longest trajectory (`zero_tail`)."""
    valid_B_T = mask_B_T.to(returns_B_T.dtype)
    weight_B_T = energy_B_T.cumsum(-1) * valid_B_T  # W_t: the realized energy up to and including t
    g_B, n_G = group_index(group_ids, returns_B_T.device)
    if not count_empty:
        n_G = _group_sum((valid_B_T.sum(-1) > 0).to(returns_B_T.dtype), g_B, len(n_G))
    numerator_G_T = torch.zeros(len(n_G), returns_B_T.shape[1], dtype=returns_B_T.dtype,
                                device=returns_B_T.device).index_add_(0, g_B, returns_B_T * weight_B_T)
    denominator_G_T = torch.zeros_like(numerator_G_T).index_add_(0, g_B, weight_B_T)
    baseline_B_T = (numerator_G_T / (denominator_G_T + epsilon))[g_B] * (n_G[g_B] > 1).unsqueeze(-1)
    if zero_tail:
        lengths_B = valid_B_T.sum(-1)
        for g in torch.nonzero(n_G > 1).squeeze(-1).tolist():
            members_N = torch.nonzero(g_B == g).squeeze(-1)
            top2 = lengths_B[members_N].topk(2).values
            if top2[0] > top2[1]:  # one trajectory is uniquely the longest: alone past the runner-up's length
                baseline_B_T[members_N[lengths_B[members_N].argmax()], int(top2[1]):] = 0.0
    return baseline_B_T


@register_advantage("otb", verl="optimal_token_baseline")
def otb(rewards_B_T, mask_B_T, *, group_ids, old_logp_B_T=None, sum_pi2_B_T=None, is_weights_B_T=None,
        zero_tail: bool = True, epsilon: float = 1e-8):
    """OTB: reward-to-go minus a per-token baseline, the group's returns weighted by their realized energy.

        G_t = Σ_{t'≥t} r_t' (γ = 1);   w_t = (1 - 2π_t + Σ_v π_v²)·ρ̄_t²,  π_t = exp(old_logp_t),  ρ̄ the rollout-IS
        weight (1 without correction);   W_t = Σ_{j≤t} w_j m_j
        B_t = Σ_i G_{i,t} W_{i,t} m_{i,t} / (Σ_i W_{i,t} m_{i,t} + ε)  over the group;   A = (G - B)·m

    A group of one has B = 0; with `zero_tail`, a uniquely longest trajectory has B = 0 past the second-longest
    length. Positions are aligned by index, as in verl: on a mask with holes (multi-turn) use `tir_otb`.
    Differs from GRPO's one group mean per response by a baseline per token, which down-weights the returns of
    trajectories whose tokens were near-deterministic. Returns `G`. verl 0.9.1 `optimal_token_baseline`
    (docs/algo/otb.md); Optimal Token Baseline, arXiv:2602.07078.
    """
    returns_B_T = _returns_to_go(rewards_B_T, mask_B_T, 1.0)
    energy_B_T = _energy(mask_B_T, old_logp_B_T, sum_pi2_B_T, is_weights_B_T, "otb")
    baseline_B_T = _optimal_baseline(returns_B_T, energy_B_T, mask_B_T, group_ids, zero_tail, epsilon, True)
    return (returns_B_T - baseline_B_T) * mask_B_T, returns_B_T


def _compaction(mask_B_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The permutation that moves each row's valid tokens to its front, in order (`x.gather(-1, order_B_T)`),
    and the mask of the compacted rows."""
    valid_B_T = mask_B_T.bool()
    order_B_T = torch.sort((~valid_B_T).to(torch.int8), dim=-1, stable=True).indices
    lengths_B = valid_B_T.sum(-1, keepdim=True)
    return order_B_T, (torch.arange(mask_B_T.shape[1], device=mask_B_T.device) < lengths_B).to(mask_B_T.dtype)


@register_advantage("tir_otb", verl="tir_optimal_token_baseline")
def tir_otb(rewards_B_T, mask_B_T, *, group_ids, old_logp_B_T=None, sum_pi2_B_T=None, is_weights_B_T=None,
            zero_tail: bool = True, epsilon: float = 1e-8):
    """TIR-OTB: OTB on each trajectory's compacted valid tokens (multi-turn: tool output between turns).

        the k-th valid token of every trajectory of a group is aligned with the others' k-th; then `otb`'s
        G, w, W, B = Σ_i G_{i,k} W_{i,k} / (Σ_i W_{i,k} + ε), A = G - B, scattered back (0 on the holes)

    Equal to `otb` on contiguous masks. Differs from `otb` by skipping the holes of the mask instead of
    aligning raw positions. verl 0.9.1 `tir_optimal_token_baseline` (docs/algo/otb.md); arXiv:2602.07078.
    """
    energy_B_T = _energy(mask_B_T, old_logp_B_T, sum_pi2_B_T, is_weights_B_T, "tir_otb")
    returns_B_T = _returns_to_go(rewards_B_T, mask_B_T, 1.0)
    order_B_T, compact_mask_B_T = _compaction(mask_B_T)
    returns_K = returns_B_T.gather(-1, order_B_T) * compact_mask_B_T  # [B, T]: valid tokens first
    energy_K = energy_B_T.gather(-1, order_B_T) * compact_mask_B_T
    baseline_K = _optimal_baseline(returns_K, energy_K, compact_mask_B_T, group_ids, zero_tail, epsilon, False)
    baseline_B_T = torch.zeros_like(baseline_K).scatter_(-1, order_B_T, baseline_K)  # back to raw positions
    return (returns_B_T - baseline_B_T) * mask_B_T, returns_B_T
