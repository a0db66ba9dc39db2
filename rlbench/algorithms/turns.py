"""Turn-aware advantage estimators for agentic episodes (multi-turn, tool calls), registered by name.

An episode is one row. `mask_B_T` is its loss mask: 1 on the tokens the policy sampled, 0 on tool output,
template tokens and padding, so it has holes. The per-turn data come from the agentic task
(`registry.ADVANTAGE_DATA`):

    turn_B_T          [B, T] long    assistant-turn index of each token (a tool output carries the index of
                                     the turn whose call produced it), -1 on padding
    turn_rewards_B_N  [B, N] float   the environment's reward for each turn, 0 past an episode's turns
    turns_B           [B]    long    number of assistant turns of each episode
    turn_state_B_N    [B, N] long    id of the environment state seen at the start of each turn, -1 past them

Each estimator computes one advantage per (episode, turn), `A_B_N`, and gives it to the sampled tokens of
that turn; holes and padding get 0. `r_{i,k}`, the reward of turn k, is the environment's reward for the
turn plus the token rewards of the turn's sampled tokens: the outcome score sits on the last sampled token,
so it belongs to the last turn, and a KL-in-reward penalty to the turn that paid it. docs/turn_credit.md
compares the three estimators and says why the natural per-turn baseline is biased.
"""

from __future__ import annotations

import torch

from .advantages import _grpo_scores, group_mean_std
from .core import group_index
from .registry import register_advantage

NORMS = ("std", "none")


def _turns_valid(name: str, mask_B_T, turn_B_T, turn_rewards_B_N, turns_B, **more) -> torch.Tensor:
    """Check the per-turn data; return `valid_B_N`, True where episode b has a turn n (n < turns_B[b])."""
    data = dict(turn_B_T=turn_B_T, turn_rewards_B_N=turn_rewards_B_N, turns_B=turns_B, **more)
    missing = [key for key, value in data.items() if value is None]
    if missing:
        raise ValueError(f"{name} needs {', '.join(missing)}: per-turn data that only an agentic (multi-turn) task "
                         f"provides; on a single-turn task use a trajectory-level estimator (grpo, rloo)")
    num_turns = turn_rewards_B_N.shape[1]
    turns_B = turns_B.to(turn_B_T.device)
    if len(turns_B) and int(turns_B.max()) > num_turns:
        raise ValueError(f"{name}: turns_B goes up to {int(turns_B.max())} but turn_rewards_B_N has {num_turns} turns")
    outside_B_T = (turn_B_T < 0) | (turn_B_T >= turns_B[:, None])
    if (mask_B_T.bool() & outside_B_T).any():
        raise ValueError(f"{name}: a sampled token's turn index (turn_B_T) is outside [0, turns_B)")
    return torch.arange(num_turns, device=turns_B.device) < turns_B[:, None]


def _turn_rewards(rewards_B_T, mask_B_T, turn_B_T, turn_rewards_B_N) -> torch.Tensor:
    """`r_{i,k}`: the environment's reward for turn k plus the token rewards of turn k's sampled tokens."""
    token_B_T = rewards_B_T * mask_B_T.to(rewards_B_T.dtype)
    index_B_T = turn_B_T.clamp(0, turn_rewards_B_N.shape[1] - 1)  # padding and holes add 0
    return turn_rewards_B_N.to(rewards_B_T.dtype).scatter_add(1, index_B_T, token_B_T)


def _returns_over_turns(r_B_N: torch.Tensor, gamma: float) -> torch.Tensor:
    """`G_{i,k} = r_{i,k} + γ G_{i,k+1}` (turn rewards are 0 past an episode's turns)."""
    returns_B_N = torch.zeros_like(r_B_N)
    running_B = torch.zeros_like(r_B_N[:, 0])
    for k in reversed(range(r_B_N.shape[1])):
        running_B = r_B_N[:, k] + gamma * running_B
        returns_B_N[:, k] = running_B
    return returns_B_N


def _relative(x_B_N, key_B_N, group_ids, valid_B_N, baseline: str, epsilon: float = 1e-6) -> torch.Tensor:
    """Each existing (episode, turn) entry of `x` against the entries of its prompt group with the same key
    (a turn index, or an anchor state); an entry alone in its set gets 0, and so does a missing turn.

        "std"   (x - mean) / (std + ε)     "mean"   x - mean     "loo"   x - mean of the others = n/(n-1)·(x - mean)
    """
    rows_M, cols_M = valid_B_N.nonzero(as_tuple=True)
    relative_B_N = torch.zeros_like(x_B_N)
    if len(rows_M) == 0:
        return relative_B_N
    g_B, _ = group_index(group_ids, x_B_N.device)
    pairs_M_2 = torch.stack([g_B[rows_M], key_B_N[rows_M, cols_M].long().to(g_B.device)], -1)
    _, set_M = torch.unique(pairs_M_2, dim=0, return_inverse=True)
    x_M = x_B_N[rows_M, cols_M]
    mean_M, std_M, n_M = group_mean_std(x_M, set_M)
    if baseline == "std":
        relative_M = (x_M - mean_M) / (std_M + epsilon)
    elif baseline == "mean":
        relative_M = x_M - mean_M
    else:
        relative_M = (x_M - mean_M) * n_M / (n_M - 1).clamp(min=1)
    relative_B_N[rows_M, cols_M] = relative_M * (n_M > 1)
    return relative_B_N


def _to_tokens(adv_B_N: torch.Tensor, turn_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """Turn k's value on the sampled tokens of turn k; 0 on holes and padding."""
    index_B_T = turn_B_T.clamp(0, adv_B_N.shape[1] - 1)
    return adv_B_N.gather(1, index_B_T) * mask_B_T.to(adv_B_N.dtype)


def _turn_index(valid_B_N: torch.Tensor) -> torch.Tensor:
    return torch.arange(valid_B_N.shape[1], device=valid_B_N.device).expand(valid_B_N.shape)


@register_advantage("mt_grpo")
def mt_grpo(
    rewards_B_T, mask_B_T, *, group_ids, turn_B_T=None, turn_rewards_B_N=None, turns_B=None,
    turn_coef: float = 1.0, norm_by_std: bool = True, epsilon: float = 1e-6,
):
    """MT-GRPO: GRPO's outcome advantage plus λ times a GRPO advantage of each turn's own reward.

        A_{i,k}   = Â^O_i + λ·Â^T_{i,k}                              on the sampled tokens of turn k
        Â^O_i     = (s_i - mean_g s) / (std_g s + ε)                 GRPO over the outcome scores s_i
        Â^T_{i,k} = (R_{i,k} - mean R_{·,k}) / (std R_{·,k} + ε)     over the episodes of group g that have a turn k

    `R_{i,k}` is the environment's reward for turn k (`turn_rewards_B_N`), λ = `turn_coef`; without std
    (`norm_by_std=False`) both terms are mean-centred only. A turn that only one episode of its group reached
    gets Â^T = 0; a group of one gets GRPO's convention for Â^O. Differs from GRPO by the turn term, which
    credits each turn for its own reward. The paper has two turns (tool call, answer): the tool turn gets
    Â^O + λ·Â^T, the answer turn Â^O, its reward being the outcome (λ on the turn term as in the authors' code,
    `advantage_est="aae"`); here K turns, each turn's reward normalised at its turn index. With variable turn
    counts this per-turn-index baseline is biased (verl RFC #7244; `turn_rloo` is the unbiased one).
    Zeng et al., Reinforcing Multi-Turn Reasoning in LLM Agents via Turn-Level Credit Assignment, arXiv:2505.11821.
    """
    valid_B_N = _turns_valid("mt_grpo", mask_B_T, turn_B_T, turn_rewards_B_N, turns_B)
    outcome_B = _grpo_scores(rewards_B_T.sum(-1), group_ids, norm_by_std, epsilon)
    baseline = "std" if norm_by_std else "mean"
    turn_B_N = _relative(turn_rewards_B_N.to(outcome_B.dtype), _turn_index(valid_B_N), group_ids, valid_B_N,
                         baseline, epsilon)
    adv_B_T = _to_tokens(outcome_B[:, None] + turn_coef * turn_B_N, turn_B_T, mask_B_T)
    return adv_B_T, adv_B_T


@register_advantage("gigpo")
def gigpo(
    rewards_B_T, mask_B_T, *, group_ids, turn_B_T=None, turn_rewards_B_N=None, turns_B=None, turn_state_B_N=None,
    step_coef: float = 1.0, gamma: float = 0.95, norm: str = "std", epsilon: float = 1e-6,
):
    """GiGPO: an episode-level group advantage plus a step-level one among the steps taken from the same state.

        A_{i,k}   = A^E_i + ω·A^S_{i,k}                              on the sampled tokens of turn k
        A^E_i     = (R_i - mean_g R) / F,        R_i = Σ_k r_{i,k}   the episode's return
        A^S_{i,k} = (G_{i,k} - mean G) / F       over the steps of group g whose anchor state is s_{i,k}
        G_{i,k}   = Σ_{k'≥k} γ^{k'-k} r_{i,k'}                       the step's discounted return
        F         = std + ε (norm="std", unbiased std) or 1 (norm="none")

    `r_{i,k}` is the turn's reward (environment reward plus its token rewards, the outcome on the last turn),
    `s_{i,k}` = `turn_state_B_N`. Anchor groups form within a prompt group, across turn indices and
    episodes (a state revisited in one episode joins the same group); a step alone in its anchor group gets
    A^S = 0, an episode alone in its prompt group GRPO's convention. Paper settings: ω = `step_coef` = 1,
    γ = 0.95. Differs from GRPO by the step-level term, which compares the actions taken from one state.
    Feng et al., Group-in-Group Policy Optimization for LLM Agent Training, arXiv:2505.10978.
    """
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; valid: {', '.join(NORMS)}")
    valid_B_N = _turns_valid("gigpo", mask_B_T, turn_B_T, turn_rewards_B_N, turns_B, turn_state_B_N=turn_state_B_N)
    r_B_N = _turn_rewards(rewards_B_T, mask_B_T, turn_B_T, turn_rewards_B_N) * valid_B_N
    episode_B = _grpo_scores(r_B_N.sum(-1), group_ids, norm == "std", epsilon)
    step_B_N = _relative(_returns_over_turns(r_B_N, gamma), turn_state_B_N, group_ids, valid_B_N,
                         "std" if norm == "std" else "mean", epsilon)
    adv_B_T = _to_tokens(episode_B[:, None] + step_coef * step_B_N, turn_B_T, mask_B_T)
    return adv_B_T, adv_B_T


@register_advantage("turn_rloo")
def turn_rloo(rewards_B_T, mask_B_T, *, group_ids, turn_B_T=None, turn_rewards_B_N=None, turns_B=None):
    """Per-turn leave-one-out: a turn's return-to-go minus that of the other episodes of its group at that turn.

        A_{i,k} = G_{i,k} - mean_{j≠i in g, K_j>k} G_{j,k},     G_{i,k} = Σ_{k'≥k} r_{i,k'}   (outcome included)
        A_{i,k} = 0 when no other episode of the group has a turn k

    `r_{i,k}` is the turn's reward (environment reward plus its token rewards, the outcome on the last turn),
    `K_j` = `turns_B`. The baseline is built from other episodes only, so it depends neither on episode i's
    actions nor on when it stops: the policy-gradient estimate is unbiased. A group mean that includes the
    episode's own return, a division by the group std, or per-turn-index normalised rewards summed over the
    remaining turns (one baseline term per turn the episode itself takes: a hidden -E[r_intermediate] on every
    "take another turn") are not (verl RFC #7244, github.com/verl-project/verl/issues/7244;
    docs/turn_credit.md). Differs from RLOO (arXiv:2402.14740) by a leave-one-out baseline per turn, on
    returns-to-go, over the episodes that reached the turn. Returns `G`.
    """
    valid_B_N = _turns_valid("turn_rloo", mask_B_T, turn_B_T, turn_rewards_B_N, turns_B)
    r_B_N = _turn_rewards(rewards_B_T, mask_B_T, turn_B_T, turn_rewards_B_N) * valid_B_N
    returns_B_N = _returns_over_turns(r_B_N, 1.0)
    adv_B_N = _relative(returns_B_N, _turn_index(valid_B_N), group_ids, valid_B_N, "loo")
    return _to_tokens(adv_B_N, turn_B_T, mask_B_T), _to_tokens(returns_B_N, turn_B_T, mask_B_T)
