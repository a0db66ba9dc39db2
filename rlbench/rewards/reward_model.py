"""A learned reward: a Hugging Face sequence-classification model from a local directory.

    reward = RewardModel("/models/my-rm")        # AutoModelForSequenceClassification, one label
    task = rl.tasks.from_parquet("train.parquet", reward=reward)

It is a `batched` reward: the runner hands it the whole batch, it scores `batch_size` texts per forward.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlbench.models import from_pretrained
from rlbench.models.chat import render_conversation


class RewardModel:
    """Scores prompt + completion with a sequence-classification model's logit (label `label`).

    The text is `render_conversation(tokenizer, example["prompt"], completion)`: the reward model's own
    chat template when it has one. Texts longer than `max_tokens` keep their last `max_tokens` tokens.
    """

    batched = True

    def __init__(self, path: str | os.PathLike, *, batch_size: int = 16, max_tokens: int = 1024, label: int = 0,
                 device: str | None = None, dtype: torch.dtype = torch.float32):
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "left", "left"
        self.model = from_pretrained(AutoModelForSequenceClassification, path, dtype=dtype).eval()
        if device:
            self.model.to(device)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.max_tokens, self.label = batch_size, max_tokens, label

    @torch.no_grad()
    def __call__(self, completions: Sequence[str], examples: Sequence[dict]) -> list[float]:
        texts = [render_conversation(self.tokenizer, e["prompt"], c) for c, e in zip(completions, examples)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                    truncation=True, max_length=self.max_tokens, add_special_tokens=False)
            logits_B_L = self.model(**inputs.to(self.model.device)).logits
            scores += logits_B_L[:, self.label].float().tolist()
        return scores

    def __repr__(self) -> str:
        return f"RewardModel({self.model.config.name_or_path!r})"
