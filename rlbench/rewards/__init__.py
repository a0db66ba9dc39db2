"""Reward functions, the runner that scores a batch of completions, and sandboxed code execution.

A reward is a plain function `(completion, example) -> float | dict` (a dict has "score" and other
named floats, e.g. "acc"); a `batched` one takes the lists of completions and examples at once.

    rewards.gsm8k_reward("... #### 1,000", {"reward_model": {"ground_truth": "1000"}})   # {"score": 1.0, "acc": 1.0}
    rewards.score_all(reward, completions, examples, timeout_s=5, workers=4)          # Scores, failures recorded

Graders: `gsm8k_reward` (strict "####" / flexible), `math_reward` (math-verify), `dapo_math_reward`,
`countdown_reward`, `code_reward` (tests run in the sandbox: `run_python`, `sandbox_info`), `format_reward`; shaping: `weighted`,
`with_length_penalty`, `with_overlong_penalty`; learned: `RewardModel`, `LLMJudge`.
`by_data_source` picks the grader of a verl-format example from its "data_source", as verl does.
"""

from __future__ import annotations

from collections.abc import Callable

from rlbench.rewards.answers import (dapo_math_reward, extract_gsm8k, geo3k_reward, gsm8k_reward, math_equal,
                                     math_reward)
from rlbench.rewards.code import code_reward, extract_code
from rlbench.rewards.countdown import check_countdown, countdown_reward
from rlbench.rewards.judge import LLMJudge
from rlbench.rewards.reward_model import RewardModel
from rlbench.rewards.runner import RewardError, Scores, batched, run_each, score_all
from rlbench.rewards.sandbox import Limits, Run, SandboxError, run_python, sandbox_info
from rlbench.rewards.scorer import TaskScorer
from rlbench.rewards.shaping import format_reward, weighted, with_length_penalty, with_overlong_penalty

__all__ = [
    "DATA_SOURCES", "LLMJudge", "Limits", "RewardError", "RewardModel", "Run", "SandboxError", "Scores", "TaskScorer",
    "batched",
    "by_data_source",
    "check_countdown", "code_reward", "countdown_reward", "dapo_math_reward", "extract_code", "extract_gsm8k",
    "format_reward", "geo3k_reward", "gsm8k_reward", "math_equal", "math_reward", "reward_for", "run_each", "run_python",
    "sandbox_info", "score_all", "weighted", "with_length_penalty", "with_overlong_penalty",
]

DATA_SOURCES: dict[str, Callable[[str, dict], float | dict]] = {
    "openai/gsm8k": gsm8k_reward,
    "lighteval/MATH": math_reward,
    "DigitalLearningGmbH/MATH-lighteval": math_reward,
    "HuggingFaceH4/MATH-500": math_reward,
    "zwhe99/DeepMath-103K": math_reward,
    "math_dapo": dapo_math_reward,
    "BytedTsinghua-SIA/DAPO-Math-17k": dapo_math_reward,
    "countdown": countdown_reward,
    "code": code_reward,
    "hiyouga/geometry3k": geo3k_reward,
}
"""verl's `data_source` names -> the grader of their examples (add your own entries)."""


def reward_for(data_source: str) -> Callable[[str, dict], float | dict]:
    """The grader registered for `data_source`; KeyError naming the known ones otherwise."""
    if data_source not in DATA_SOURCES:
        raise KeyError(f"no built-in reward for data_source {data_source!r}; known: {', '.join(DATA_SOURCES)} "
                       "(pass reward=..., or add it to rlbench.rewards.DATA_SOURCES)")
    return DATA_SOURCES[data_source]


def by_data_source(completion: str, example: dict) -> float | dict:
    """verl's default reward: the grader of `example["data_source"]`."""
    return reward_for(example["data_source"])(completion, example)
