"""TRL's side of benchmarks/vs_trl_agentic.py: GRPOTrainer with `tools=` on the calculator task. Runs in TRL's venv.

Only transformers, datasets and trl are imported (not rlbench; the tool is rlbench's `calc` from
rlbench/models/calculator_data.py, a standard-library module loaded by its path). Reads the tiny-tools model directory and the train
prompts that vs_trl_agentic.py wrote, trains, saves the weights (with the model's own tokenizer files, so that
rlbench's evaluator reads TRL's model exactly as it reads its own), and writes one JSON file: per-step wall time,
generation time and sampled tokens, and per-step curves (mean reward, tool calls per episode, the fraction of calls
that gave a result).

TRL renders a tool-calling conversation from structured messages, so tiny-tools needs, on this side only:
- a chat template that renders an assistant message's `tool_calls` and tool messages. It gives the same tokens as
  the model's own template in rlbench's episodes: `Q:37*48=\\nA:<tool_call>{...}</tool_call>\\nR:1776\\nA:1776<eos>`
  (a turn that calls a tool ends at `</tool_call>`, and the newline before `R:` belongs to the tool message);
- a response template (`tokenizer.response_template`, how transformers parses a completion into tool calls);
- `</tool_call>` among the EOS ids of generation, so that a turn stops at its call as rlbench's does.
Run by vs_trl_agentic.py: benchmarks/.venv-trl/bin/python benchmarks/trl_agentic.py --workdir DIR --seed S --steps N
"""

import argparse
import importlib.util
import json
import shutil
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trl_grpo import StepTimer

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}Q:{{ message['content'] }}{{ '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}A:{{ message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>"
    "{%- endfor -%}"
    "{%- if not message.get('tool_calls') -%}{{ '\\n' }}{%- endif -%}"
    "{%- elif message['role'] == 'tool' -%}{{ '\\n' }}R:{{ message['content'] }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}A:{%- endif -%}")
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "A:",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<eos>\s*", "content": "text"},
    },
}


_spec = importlib.util.spec_from_file_location(
    "calculator_data", Path(__file__).resolve().parents[1] / "rlbench" / "models" / "calculator_data.py")
calculator_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(calculator_data)


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: integers with + - * / ** and brackets, e.g. "(3+4)*5".
    """
    return calculator_data.calc(expression)


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that records each generate-and-score call's time, sampled tokens, reward and tool calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generation_s: list[float] = []
        self.sampled_tokens: list[int] = []
        self.curves: dict[str, list[float]] = {"reward": [], "tool_calls": [], "tool_success": []}

    def _generate_and_score_completions(self, inputs):
        start = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self.generation_s.append(time.perf_counter() - start)
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        self.sampled_tokens.append(int(mask.sum()))
        metrics = self._metrics["train"]  # this call's values are the last (never logged: logging_steps is huge)
        calls = metrics["tools/call_frequency"][-1] if metrics["tools/call_frequency"] else 0.0
        failures = metrics["tools/failure_frequency"][-1] if metrics["tools/failure_frequency"] else 0.0
        self.curves["reward"].append(metrics["reward"][-1])
        self.curves["tool_calls"].append(calls)
        self.curves["tool_success"].append(1.0 - failures if calls else 0.0)
        return out


def reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1 when the episode's last assistant message, stripped, is exactly the product (the calculator's reward)."""
    scores = []
    for messages, right in zip(completions, answer):
        last = [m for m in messages if m["role"] == "assistant"][-1]
        scores.append(1.0 if not last.get("tool_calls") and last["content"].strip() == right else 0.0)
    return scores


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(args.workdir)
    setting = json.loads((work / "setting.json").read_text())
    train = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    model_dir = setting["model_dir"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("</tool_call>")]
    config = GRPOConfig(
        output_dir=str(work / f"trl-seed{args.seed}"), seed=args.seed, max_steps=args.steps, use_cpu=True,
        per_device_train_batch_size=setting["prompts_per_step"] * setting["samples_per_prompt"],
        num_generations=setting["samples_per_prompt"],
        # TRL's budget is the whole episode's: the turns' sampled tokens and the tool results
        max_completion_length=setting["max_new_tokens"] * setting["max_turns"],
        max_tool_calling_iterations=setting["max_turns"] - 1, temperature=setting["temperature"],
        learning_rate=setting["lr"], lr_scheduler_type="constant", max_grad_norm=setting["grad_clip"],
        beta=setting["kl_coef"], num_iterations=1, epsilon=0.2, loss_type="grpo", gradient_checkpointing=False,
        save_strategy="no", report_to="none", logging_steps=10**9, disable_tqdm=True)
    timer = StepTimer()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
                               train_dataset=Dataset.from_list(train), tools=[calc], callbacks=[timer])
    trainer.train()
    out = work / f"trl-seed{args.seed}-model"
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # as it was
    model.save_pretrained(out)
    for path in Path(model_dir).iterdir():  # the model's own tokenizer and generation files, unchanged
        if path.is_file() and not (out / path.name).exists():
            shutil.copy(path, out / path.name)
    (work / f"trl-seed{args.seed}.json").write_text(json.dumps(dict(
        step_s=timer.step_s, generation_s=trainer.generation_s, sampled_tokens=trainer.sampled_tokens,
        curves=trainer.curves, model_dir=str(out))))


if __name__ == "__main__":
    main()
