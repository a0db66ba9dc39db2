"""What the agentic tests share: tiny-arith behind a chat template, a tool call's text, and a game tiny-arith can
play (three sums in one context, each answer an action)."""

import json
import shutil
from pathlib import Path

import rlbench as rl


TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""Append-only: every message renders the same whatever follows it."""


def chat_model(tiny_dir: str, folder: Path) -> str:
    """tiny-arith's weights with 512 positions (tool calls are long in characters) and the chat template `TEMPLATE`."""
    path = folder / "model"
    shutil.copytree(tiny_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 512}))
    tokenizer = rl.models.load_tokenizer(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


def call(name: str, **arguments) -> str:
    """A Hermes tool call's text."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class Sums(rl.Game):
    """Three sums; each answer (digits, then EOS) is an action, the next sum comes back as the observation; a
    right answer's turn reward is 1."""

    def reset(self, a, b, **_):
        self.a, self.sums, self.i = a, [(a, b), (b, 7), (a, 3)], 0
        return f"{a}+{b}="

    def step(self, action: str):
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
