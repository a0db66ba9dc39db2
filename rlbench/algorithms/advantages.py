"""Advantage estimators, registered by name (docs/algorithms.md lists them).

Every estimator has the signature `f(rewards_B_T, mask_B_T, *, <data keywords it uses>, **hparams) ->
(advantages_B_T, returns_B_T)`; it declares only the data it reads (`registry.ADVANTAGE_DATA`: `group_ids`,
`values_B_T`, `baselines_B`, `old_logp_B_T`, `reward_components_B_K`, `sum_pi2_B_T` and `is_weights_B_T`
that `otb.py` reads, and the per-turn data of agentic tasks that `turns.py` reads) and receives only those.
Rewards are token-level: an outcome score sits on the last valid token, so `s_i = rewards_B_T.sum(-1)`.
`group_ids` (`[B]`, any integers) marks the samples of one prompt. Outputs are 0 on invalid tokens; outcome
estimators return the advantages as returns (verl's convention).

The mask may have holes (a multi-turn episode's loss mask is 0 on tool output between sampled turns). A hole
is not a step: every estimator gives on a holed row what it gives on the compacted row (the valid tokens
only, contiguous), scattered back, with 0 on the holes; except `otb`, which aligns raw positions across a
group as verl's does (`tir_otb` is its form for holed masks). Rewards must sit on valid tokens (`outcome_rewards`
and `kl_in_reward` put them there).
"""

from __future__ import annotations

import torch

from .core import group_index, masked_whiten
from .registry import register_advantage


def group_mean_std(scores_B: torch.Tensor, group_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample's group mean, unbiased group std and group size; a group of one has mean 0, std 1 (verl)."""
    g_B, n_G = group_index(group_ids, scores_B.device)
    n_G = n_G.to(scores_B.dtype)
    mean_G = _group_sum(scores_B, g_B, len(n_G)) / n_G
    var_G = _group_sum((scores_B - mean_G[g_B]) ** 2, g_B, len(n_G)) / (n_G - 1).clamp(min=1)
    alone_G = n_G == 1
    return mean_G.masked_fill(alone_G, 0.0)[g_B], var_G.sqrt().masked_fill(alone_G, 1.0)[g_B], n_G[g_B]


def _group_sum(x_B: torch.Tensor, g_B: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=x_B.dtype, device=x_B.device).index_add_(0, g_B, x_B)


def _per_token(adv_B: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    return adv_B.unsqueeze(-1) * mask_B_T.to(adv_B.dtype)


def _grpo_scores(scores_B: torch.Tensor, group_ids, norm_by_std: bool, epsilon: float) -> torch.Tensor:
    mean_B, std_B, _ = group_mean_std(scores_B, group_ids)
    return (scores_B - mean_B) / (std_B + epsilon) if norm_by_std else scores_B - mean_B


def _returns_to_go(rewards_B_T: torch.Tensor, mask_B_T: torch.Tensor, gamma: float) -> torch.Tensor:
    """`G_t = r_t + γ G_{t+1}` over valid tokens; a masked token carries the running return and stores 0."""
    valid_B_T = mask_B_T.bool()
    running_B = torch.zeros_like(rewards_B_T[:, 0])
    returns_B_T = torch.zeros_like(rewards_B_T)
    for t in reversed(range(rewards_B_T.shape[1])):
        running_B = torch.where(valid_B_T[:, t], rewards_B_T[:, t] + gamma * running_B, running_B)
        returns_B_T[:, t] = running_B * valid_B_T[:, t]
    return returns_B_T


@register_advantage("grpo", verl="grpo")
def grpo(rewards_B_T, mask_B_T, *, group_ids, norm_by_std: bool = True, epsilon: float = 1e-6):
    """GRPO: the score normalised within its prompt group.

        A_i = (s_i - mean_g) / (std_g + ε)      std unbiased; a group of one: mean 0, std 1
        A_i = s_i - mean_g                       with norm_by_std=False (Dr.GRPO, arXiv:2503.20783)

    Differs from REINFORCE by the group mean as baseline and the group std as scale.
    Shao et al., DeepSeekMath, arXiv:2402.03300.
    """
    adv_B_T = _per_token(_grpo_scores(rewards_B_T.sum(-1), group_ids, norm_by_std, epsilon), mask_B_T)
    return adv_B_T, adv_B_T


@register_advantage("rloo", verl="rloo")
def rloo(rewards_B_T, mask_B_T, *, group_ids):
    """RLOO: leave-one-out group baseline.

        A_i = s_i - mean_{j≠i in g} s_j = n/(n-1)·(s_i - mean_g)      a group of one: A_i = s_i

    Differs from GRPO by excluding the sample from its own baseline (unbiased) and not scaling by std.
    Ahmadian et al., Back to Basics, arXiv:2402.14740.
    """
    scores_B = rewards_B_T.sum(-1)
    mean_B, _, n_B = group_mean_std(scores_B, group_ids)
    adv_B_T = _per_token((scores_B - mean_B) * n_B / (n_B - 1).clamp(min=1), mask_B_T)
    return adv_B_T, adv_B_T


@register_advantage("reinforce_plus_plus_baseline", verl="reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(rewards_B_T, mask_B_T, *, group_ids):
    """REINFORCE++ with group baseline: group-mean baseline, then whitening over the whole batch.

        a_i = s_i - mean_g;   A = masked_whiten(a_i·m, m)·m

    Differs from GRPO by normalising with the batch std instead of the group std.
    Hu et al., REINFORCE++, arXiv:2501.03262.
    """
    scores_B = rewards_B_T.sum(-1)
    mean_B, _, _ = group_mean_std(scores_B, group_ids)
    adv_B_T = _per_token(scores_B - mean_B, mask_B_T)
    adv_B_T = masked_whiten(adv_B_T, mask_B_T) * mask_B_T
    return adv_B_T, adv_B_T


@register_advantage("reinforce_plus_plus", verl="reinforce_plus_plus")
def reinforce_plus_plus(rewards_B_T, mask_B_T, *, gamma: float = 1.0):
    """REINFORCE++: discounted token returns, whitened over the batch (no critic, no group).

        G_t = r_t + γ G_{t+1} (masked tokens carry G and store 0);   A = masked_whiten(G, m)·m

    Differs from REINFORCE by the batch whitening; usually with the KL in the reward. Returns `G`.
    Hu et al., REINFORCE++, arXiv:2501.03262.
    """
    returns_B_T = _returns_to_go(rewards_B_T, mask_B_T, gamma)
    return masked_whiten(returns_B_T, mask_B_T) * mask_B_T, returns_B_T


@register_advantage("remax", verl="remax")
def remax(rewards_B_T, mask_B_T, *, baselines_B=None):
    """ReMax: reward-to-go minus the reward of a greedy rollout of the same prompt.

        A_t = G_t - b_i on valid tokens,   G_t = Σ_{t'≥t} r_t',   b_i = score of the greedy response

    Differs from REINFORCE by the greedy baseline (`Algorithm.needs_greedy_baseline`). Returns `G`.
    Li et al., ReMax, arXiv:2310.10505.
    """
    if baselines_B is None:
        raise ValueError("remax needs baselines_B: the score of a greedy rollout per sample (needs_greedy_baseline)")
    returns_B_T = _returns_to_go(rewards_B_T, mask_B_T, 1.0)
    return (returns_B_T - baselines_B.unsqueeze(-1)) * mask_B_T, returns_B_T


@register_advantage("gpg", verl="gpg")
def gpg(rewards_B_T, mask_B_T, *, group_ids):
    """GPG: group-mean baseline, rescaled by the share of samples with a non-zero score.

        A_i = α·(s_i - mean_g),   α = B / max(#{i: s_i ≠ 0}, 1)

    Differs from GRPO (without std) by α, which undoes the dilution by zero-signal samples.
    Chu et al., GPG, arXiv:2504.02546.
    """
    scores_B = rewards_B_T.sum(-1)
    mean_B, _, _ = group_mean_std(scores_B, group_ids)
    alpha = len(scores_B) / max(int(torch.count_nonzero(scores_B)), 1)
    adv_B_T = _per_token(alpha * (scores_B - mean_B), mask_B_T)
    return adv_B_T, adv_B_T


@register_advantage("opo", verl="opo")
def opo(rewards_B_T, mask_B_T, *, group_ids):
    """OPO: the optimal baseline, a length-weighted group mean.

        A_i = s_i - Σ_j |y_j| s_j / Σ_j |y_j|,   |y| = Σ_t m      a group of one: A_i = s_i

    Differs from GRPO (without std) by weighting the group mean with response lengths.
    On-Policy RL with Optimal Reward Baseline, arXiv:2505.23585.
    """
    scores_B = rewards_B_T.sum(-1)
    lengths_B = mask_B_T.to(scores_B.dtype).sum(-1)
    g_B, n_G = group_index(group_ids, scores_B.device)
    total_length_G = _group_sum(lengths_B, g_B, len(n_G))
    baseline_G = _group_sum(lengths_B * scores_B, g_B, len(n_G)) / total_length_G.clamp(min=1)
    adv_B_T = _per_token(scores_B - baseline_G.masked_fill(n_G == 1, 0.0)[g_B], mask_B_T)
    return adv_B_T, adv_B_T


@register_advantage("grpo_passk", verl="grpo_passk")
def grpo_passk(rewards_B_T, mask_B_T, *, group_ids, norm_by_std: bool = True, epsilon: float = 1e-6):
    """Pass@k GRPO: only the best sample of each group is reinforced, by its margin over the runner-up.

        A_best = (s_max - s_second) / (std_g + ε)   (no division with norm_by_std=False);  others 0

    Differs from GRPO by optimising the best of the group (pass@k) instead of the mean. Groups need ≥ 2
    samples. Pass@k objective, arXiv:2503.19595.
    """
    scores_B = rewards_B_T.sum(-1)
    _, std_B, n_B = group_mean_std(scores_B, group_ids)
    if (n_B < 2).any():
        raise ValueError("grpo_passk needs at least 2 samples per group")
    g_B, n_G = group_index(group_ids, scores_B.device)
    adv_B = torch.zeros_like(scores_B)
    for g in range(len(n_G)):
        members = (g_B == g).nonzero().squeeze(-1)
        top2, position = scores_B[members].topk(2)
        margin = top2[0] - top2[1]
        adv_B[members[position[0]]] = margin / (std_B[members[0]] + epsilon) if norm_by_std else margin
    adv_B_T = _per_token(adv_B, mask_B_T)
    return adv_B_T, adv_B_T


@register_advantage("gae", verl="gae")
def gae(rewards_B_T, mask_B_T, *, values_B_T=None, gamma: float = 1.0, lam: float = 1.0):
    """GAE with a learned critic, whitened over the batch.

        δ_t = r_t + γ V_{t+1} - V_t,   Â_t = δ_t + γλ Â_{t+1}   (t+1 = the next valid token: holes are skipped)
        returns = Â + V,   A = masked_whiten(Â, m)

    Differs from Monte-Carlo returns by bootstrapping from `values_B_T` (`Algorithm.needs_critic`).
    Schulman et al., High-Dimensional Continuous Control Using GAE, arXiv:1506.02438.
    """
    if values_B_T is None:
        raise ValueError("gae needs values_B_T from a critic (needs_critic=True)")
    valid_B_T = mask_B_T.bool()
    next_value_B = torch.zeros_like(values_B_T[:, 0])
    last_adv_B = torch.zeros_like(values_B_T[:, 0])
    adv_B_T = torch.zeros_like(values_B_T)
    for t in reversed(range(values_B_T.shape[1])):
        delta_B = rewards_B_T[:, t] + gamma * next_value_B - values_B_T[:, t]
        last_adv_B = torch.where(valid_B_T[:, t], delta_B + gamma * lam * last_adv_B, last_adv_B)
        next_value_B = torch.where(valid_B_T[:, t], values_B_T[:, t], next_value_B)
        adv_B_T[:, t] = last_adv_B
    returns_B_T = (adv_B_T + values_B_T) * mask_B_T
    return masked_whiten(adv_B_T, mask_B_T) * mask_B_T, returns_B_T


@register_advantage("gdpo", verl="gdpo")
def gdpo(
    rewards_B_T, mask_B_T, *, group_ids, reward_components_B_K=None, component_weights=None, norm_by_std: bool = True, epsilon: float = 1e-6,
):
    """GDPO: GRPO-normalise each reward component separately, sum with weights, whiten over the batch.

        A = masked_whiten(Σ_k w_k·grpo(s_{·,k}), m)·m

    Differs from GRPO on a summed reward by keeping a dominant component from drowning the others.
    `reward_components_B_K` holds the per-component scores (default: the summed score, K = 1);
    `component_weights` the K weights (default 1). Group reward-Decoupled normalisation, arXiv:2601.05242.
    """
    scores_B_K = rewards_B_T.sum(-1, keepdim=True) if reward_components_B_K is None else reward_components_B_K
    weights_K = [1.0] * scores_B_K.shape[1] if component_weights is None else list(component_weights)
    if len(weights_K) != scores_B_K.shape[1]:
        raise ValueError(f"{len(weights_K)} component_weights for {scores_B_K.shape[1]} reward components")
    adv_B = sum(w * _grpo_scores(scores_B_K[:, k], group_ids, norm_by_std, epsilon) for k, w in enumerate(weights_K))
    adv_B_T = masked_whiten(_per_token(adv_B, mask_B_T), mask_B_T) * mask_B_T
    return adv_B_T, adv_B_T
