"""Tool-integrated math (ToRL / ReTool style): math problems in verl's schema, solved with a sandboxed python tool.

    task = rl.tasks.get("tool_math", train="data/math/train.parquet", test="data/math500/test.parquet")
    s = rl.Session(model="/models/Qwen2.5-Math-1.5B", task=task, max_new_tokens=2048)

Each episode: the system prompt below (the chat template adds the tool's schema, as Qwen2.5's does), the row's
prompt as the first user turn; each assistant turn may call `python` with the Hermes format
(`<tool_call>{"name": "python", "arguments": {"code": "print(2**10)"}}</tool_call>`), whose printed output comes
back as a tool message (`rl.agents.python_tool`: a fresh sandboxed process per call, standard library only).
The episode's reward is the grader of the row's `data_source` (`rlbench.rewards.DATA_SOURCES`: GSM8K's "####",
MATH's \\boxed{} through math-verify, ...) applied to its last assistant turn, as the single-turn task grades a
completion.
"""

from __future__ import annotations

import os

from rlbench.agents.code import python_tool
from rlbench.rewards import by_data_source
from rlbench.tasks.agent import AgentTask
from rlbench.tasks.data import from_jsonl, from_parquet

SYSTEM = ("Solve the problem step by step. You may use the python tool to compute: write a complete program that "
          "prints what you need; each call runs in a fresh process and returns what the program printed. To call "
          "it, write\n<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(2**10)\"}}\n</tool_call>\n"
          "and wait for the result. When you are done, give the final answer in the format the problem asks for.")
"""The default system message (tools are declared by the chat template when it knows how, e.g. Qwen2.5's)."""


def tool_math(train: str, test: str | float | int | None = None, *, max_turns: int = 4, timeout_s: float = 5.0,
              memory_mb: int = 1024, max_output_chars: int = 2000, system: str = SYSTEM,
              max_context_tokens: int | None = None, seed: int = 0, shuffle: bool = True,
              name: str = "tool_math", duplicates: str = "refuse") -> AgentTask:
    """An `AgentTask` over a verl-schema `.parquet` / `.jsonl` file (`test`: another file, or a fraction / number
    of `train`'s rows to hold out, as `rl.tasks.from_parquet` reads them; rows need a `data_source` with a
    built-in grader and a `reward_model.ground_truth`; `duplicates`: repeated prompts, and training prompts the test
    set holds, as `from_parquet` takes them), with the python tool.

    max_turns: assistant turns per episode (a call in the last one is not run); timeout_s, memory_mb,
    max_output_chars: the tool's limits (`rl.agents.python_tool`); max_context_tokens: most tokens of an
    episode, prompt included (None: the model's context).
    """
    reader = from_jsonl if str(train).endswith(".jsonl") else from_parquet
    rows = reader(os.path.expanduser(train), test=os.path.expanduser(test) if isinstance(test, str) else test,
                  seed=seed, shuffle=shuffle, duplicates=duplicates)
    tool = python_tool(timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars)
    # tool_timeout_s=None: the sandbox's own wall-clock limit ends every run, and a call may first wait for a
    # free sandbox slot (python_tool's max_concurrent), which a pool limit would count as the tool's time
    return AgentTask(rows.train, rows.test, tools=[tool], reward=grade, max_turns=max_turns, system=system,
                     tool_timeout_s=None, max_context_tokens=max_context_tokens, name=name)


def grade(episode, example: dict) -> float | dict:
    """The grader of the example's `data_source` on the episode's last assistant turn."""
    return by_data_source(episode.final_text, example)
