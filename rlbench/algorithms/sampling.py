"""Sampling-side pieces of DAPO: dynamic sampling's group filter, overlong shaping.

Yu et al., DAPO, arXiv:2503.14476.
"""

from __future__ import annotations

import torch

from .core import group_index


def filter_groups(scores_B: torch.Tensor, group_ids_B) -> torch.Tensor:
    """Keep mask `[B]` of the samples whose prompt group carries signal: scores not all equal.

    A group whose scores all equal has zero advantage under a group baseline, so DAPO drops it and samples
    more prompts. A group of one is kept (as verl: its GRPO advantage is its score, not 0).
    """
    g_B, n_G = group_index(group_ids_B, scores_B.device)
    empty_G = torch.zeros(len(n_G), dtype=scores_B.dtype, device=scores_B.device)
    max_G = empty_G.scatter_reduce(0, g_B, scores_B, "amax", include_self=False)
    min_G = empty_G.scatter_reduce(0, g_B, scores_B, "amin", include_self=False)
    return ((max_G > min_G) | (n_G == 1))[g_B]


def overlong_penalty(lengths_B: torch.Tensor, max_len: int, buffer_len: float, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the score of each response.

        penalty = min(-(len - (L_max - L_buf)) / L_buf · factor, 0)

    0 up to `L_max - L_buf` tokens, then linear down to `-factor` at `L_max`. `buffer_len` is in
    tokens, or a fraction of `max_len` when below 1 (DAPO: 4096 of 20480 = 0.2).
    """
    buffer = buffer_len * max_len if buffer_len < 1 else buffer_len
    if not 0 < buffer <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer {buffer} for max_len {max_len}")
    exceed_B = torch.as_tensor(lengths_B, dtype=torch.float32) - (max_len - buffer)
    return torch.clamp(-exceed_B / buffer * factor, max=0.0)


def longest_turns(mask_B_T: torch.Tensor, turn_B_T: torch.Tensor) -> torch.Tensor:
    """Per episode, the sampled tokens (`mask_B_T`) of its longest turn (`turn_B_T`: the turn of each token, -1 on
    padding): what DAPO's overlong shaping measures in a multi-turn episode, where each turn, not the episode, is
    capped at max_new_tokens."""
    B = mask_B_T.shape[0]
    turns = int(turn_B_T.max().clamp(min=0)) + 1
    counts_B_N = torch.zeros(B, turns, dtype=torch.float32, device=mask_B_T.device)
    counts_B_N.scatter_add_(1, turn_B_T.long().clamp(min=0), mask_B_T.float())
    return counts_B_N.amax(1)
