"""TRL's side of benchmarks/vs_trl.py: GRPOTrainer on the tiny arithmetic task. Runs in TRL's own venv.

Only transformers, datasets and trl are imported (not rlbench). Reads the model directory and the
train / held-out prompts that vs_trl.py wrote, trains, and writes one JSON file: per-step wall time,
generation time and generated tokens, and greedy held-out accuracy before and after training.
Run by vs_trl.py: benchmarks/.venv-trl/bin/python benchmarks/trl_grpo.py --workdir DIR --seed S --steps N
"""

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that records the time and generated tokens of each generate-and-score call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generation_s: list[float] = []
        self.generated_tokens: list[int] = []

    def _generate_and_score_completions(self, inputs):
        start = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self.generation_s.append(time.perf_counter() - start)
        self.generated_tokens.append(int(out["completion_mask"].sum()))
        return out


class StepTimer(TrainerCallback):
    def __init__(self):
        self.step_s: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_s.append(time.perf_counter() - self.start)


def reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1 for exactly the answer, else 0 (the arithmetic task's reward; a completion cut at the token
    limit is 8 characters long and can never equal a sum of two two-digit numbers)."""
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


@torch.no_grad()
def greedy_accuracy(model, tokenizer, examples: list[dict], max_new_tokens: int) -> float:
    """Held-out accuracy of greedy completions: the answer, then EOS."""
    model.eval()
    batch = tokenizer([e["prompt"] for e in examples], return_tensors="pt", padding=True, padding_side="left",
                      add_special_tokens=False)
    out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)[:, batch["input_ids"].shape[1]:]
    correct = 0
    for ids, example in zip(out.tolist(), examples):
        if tokenizer.eos_token_id in ids:
            text = tokenizer.decode(ids[: ids.index(tokenizer.eos_token_id)])
            correct += text == example["answer"]
    model.train()
    return correct / len(examples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(args.workdir)
    setting = json.loads((work / "setting.json").read_text())
    train = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (work / "test.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(setting["model_dir"], local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(setting["model_dir"], local_files_only=True, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(work / f"trl-seed{args.seed}"), seed=args.seed, max_steps=args.steps, use_cpu=True,
        bf16=setting["precision"] == "bf16", per_device_train_batch_size=setting["prompts_per_step"] * setting["samples_per_prompt"],
        num_generations=setting["samples_per_prompt"], max_completion_length=setting["max_new_tokens"],
        temperature=setting["temperature"], learning_rate=setting["lr"], lr_scheduler_type="constant",
        max_grad_norm=setting["grad_clip"], beta=0.0, num_iterations=1, epsilon=0.2, loss_type="grpo",
        gradient_checkpointing=False, save_strategy="no", report_to="none", logging_steps=10**9,
        disable_tqdm=True)
    timer = StepTimer()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
                               train_dataset=Dataset.from_list(train), callbacks=[timer])
    before = greedy_accuracy(model, tokenizer, test, setting["max_new_tokens"])
    trainer.train()
    after = greedy_accuracy(model, tokenizer, test, setting["max_new_tokens"])
    (work / f"trl-seed{args.seed}.json").write_text(json.dumps(dict(
        step_s=timer.step_s, generation_s=trainer.generation_s, generated_tokens=trainer.generated_tokens,
        greedy_before=before, greedy_after=after)))


if __name__ == "__main__":
    main()
