"""A game tiny-arith can play for the agentic tests: three sums in one context, each answer an action."""

import shutil
from pathlib import Path

import rlbench as rl


class Sums:
    """Three sums; each answer (digits, then EOS) is an action, the next sum comes back as the observation; a
    right answer's turn reward is 1. `slow`: seconds the step of the first sum (a == slow_a) takes."""

    slow, slow_a = 0.0, None

    def reset(self, a, b, **_):
        self.a, self.sums, self.i = a, [(a, b), (b, 7), (a, 3)], 0
        return f"{a}+{b}="

    def step(self, action: str):
        if self.a == self.slow_a and self.i == 0:
            import time

            time.sleep(self.slow)
        right = action.strip() == str(sum(self.sums[self.i]))
        self.i += 1
        done = self.i == len(self.sums)
        return ("" if done else "{}+{}=".format(*self.sums[self.i])), float(right), done


def sums_model(tiny_dir: str, folder: Path) -> str:
    """tiny-arith with a chat template that renders a turn as its content alone (as tiny-arith saw its prompts)."""
    path = folder / "model"
    shutil.copytree(tiny_dir, path)
    tokenizer = rl.models.load_tokenizer(path)
    tokenizer.chat_template = "{%- for m in messages -%}{{ m.content }}{%- endfor -%}"
    tokenizer.save_pretrained(path)
    return str(path)


def sums_task(env=Sums) -> rl.tasks.AgentTask:
    return rl.tasks.AgentTask(rl.tasks.get("arithmetic").train, rl.tasks.get("arithmetic").test, env=env, max_turns=3)
