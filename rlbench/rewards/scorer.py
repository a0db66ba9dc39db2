"""The reward worker of a session: a task's reward over a batch of completions."""

from __future__ import annotations

import torch

from rlbench.rewards.runner import score_all


class TaskScorer:
    """A task's reward over completions, with the task's rule for truncated ones (`Task.truncated_reward`)."""

    def __init__(self, task, on_error: str, **runner):
        self.task, self.on_error, self.runner = task, on_error, runner

    def score(self, completions: list[str], examples: list[dict], finished_B: torch.Tensor):
        """(score [B], components {name: [B]}, errors) of completions under the task's reward."""
        scores = score_all(self.task.reward, completions, examples, on_error=self.on_error, **self.runner)
        score_B = torch.tensor(scores.score, dtype=torch.float32)
        components = {k: torch.tensor(v, dtype=torch.float32) for k, v in scores.components.items()}
        if self.task.truncated_reward is not None:  # completions cut at max_new_tokens
            score_B = score_B.masked_fill(~finished_B, self.task.truncated_reward)
            components = {k: v.masked_fill(~finished_B, 0.0) for k, v in components.items()}
        return score_B, components, scores.error
