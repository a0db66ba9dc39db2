"""Reward functions and the runner that scores a batch of completions."""

from rlbench.rewards.runner import RewardError, Scores, score_all

__all__ = ["RewardError", "Scores", "score_all"]
