"""The built-in "calculator" task's data and environment: 2-digit products, with a `calc` tool to call.

    train, test = calculator_split()
    test[0]   # {"prompt": [{"role": "user", "content": "10*31="}], "answer": "310", "a": 10, "b": 31}
    task = AgentTask(train, test, env=Calculator, max_turns=3)

The problems, the tool and the episode format are `rlbench.models.calculator_data`, which the tiny-tools
model was warm-started on: it calls the tool on about half the held-out problems.
"""

from __future__ import annotations

from typing import final

from rlbench.agents.env import Env
from rlbench.agents.tools import tool
from rlbench.models import calculator_data as data


def calculator_split() -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    """(train, test) examples: all 90 x 90 products of operands in 10..99; the same 200 are held out in every run."""
    train_pairs, heldout_pairs = data.calculator_pairs()
    return tuple(data.example(a, b) for a, b in train_pairs), tuple(data.example(a, b) for a, b in heldout_pairs)


@final
class Calculator(Env):
    """One episode of a calculator problem. Its tool is `calc`; the reward is 1.0 for exactly the product.

    Reward {"score": s, "acc": s}: s is 1.0 when the last assistant message, stripped, is the answer, else 0.0.
    """

    def reset(self, prompt: list[dict], answer: str, **fields) -> list[dict]:
        """Start an episode of the example (its fields as keywords): its prompt messages."""
        self.answer = answer
        return list(prompt)

    @tool
    def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: integers with + - * / ** and brackets, e.g. "(3+4)*5".
        """
        return data.calc(expression)

    def reward(self, episode) -> dict[str, float]:
        """{"score", "acc"}: 1.0 when the episode's final text, stripped, is the answer, else 0.0."""
        right = float(episode.final_text.strip() == self.answer)
        return {"score": right, "acc": right}
