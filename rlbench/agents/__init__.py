"""Agentic RL: multi-turn episodes with tool calls, kept as the exact tokens the sampler saw.

    class Calculator(rl.Env):                  # an environment: one instance per episode
        def reset(self, prompt, answer): ...   # the example's fields as keywords -> the first user turn
        @rl.tool
        def calc(self, expression: str) -> str: \"\"\"A tool (type hints + docstring).\"\"\" ...
        def reward(self, episode) -> float: ...

    task = rl.tasks.AgentTask(train, test, env=Calculator, max_turns=4)
    task = rl.tasks.AgentTask(train, test, env={"calc": Calculator, "lookup": Lookup}, route="env")  # per example
    s = rl.Session(model="tiny-tools", task=task)          # or task="calculator"
    ep = s.episode(task.test[0]); ep.step(); ep.pending_tool_calls; ep.step(); ep.show(); ep.to_pandas()
    batch = s.rollout()                                     # every episode of the step, turn by turn, batched
    rl.agents.check_template(tokenizer, messages)          # is the chat template append-only?

The pieces: `env` (the contract: `Env`, `Game`, which methods are tools, several environments routed by a field of
the example), `tools` (`@rl.tool`: a callable with its JSON schema, sync or async; it returns text, or for a vision-language model
a picture or texts and pictures), `parsers` (tool-call formats: Hermes / Qwen, Llama 3, gpt-oss built in), `render` (append-only rendering and the
template check), `envs` (the environment worker: a turn's calls at once, each with its time limit, async ones on its
event loop, the task's tool concurrency limit), `episode` (an episode's record, its Batch row, and the handle
that steps one by hand), `runner` (the episode runner: episodes turn by turn, batched or by hand), `code` (`python_tool`: Python code
run in the sandbox of `rlbench.rewards`).
"""

from rlbench.agents.code import python_tool
from rlbench.agents.env import Env, Game, tools_of
from rlbench.agents.envs import EnvPool
from rlbench.agents.episode import ENDS, Episode, Turn, to_batch
from rlbench.agents.parsers import PARSERS, GptOssParser, HermesParser, Llama3Parser, Parser, ToolCall, get_parser
from rlbench.agents.render import KINDS, Renderer, TemplateReport, check_template
from rlbench.agents.runner import EpisodeHandle, EpisodeRunner
from rlbench.agents.tools import Tool, tool

__all__ = ["ENDS", "Env", "EnvPool", "Episode", "EpisodeHandle", "EpisodeRunner", "Game", "GptOssParser",
           "HermesParser", "KINDS", "Llama3Parser", "PARSERS", "Parser", "Renderer", "TemplateReport", "Tool", "ToolCall",
           "Turn", "check_template", "get_parser", "python_tool", "to_batch", "tool", "tools_of"]
