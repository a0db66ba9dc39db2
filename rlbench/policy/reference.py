"""The frozen reference policy (the model as loaded), for KL penalties."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rlbench import models
from rlbench.batch import Batch
from rlbench.policy.forward import batch_logp


class Reference:
    def __init__(self, model_dir: str, *, temperature: float = 1.0, micro_batch_tokens: int = 4096):
        self.model = models.from_pretrained(AutoModelForCausalLM, model_dir)
        self.model.eval().requires_grad_(False)
        self.temperature, self.micro_batch_tokens = temperature, micro_batch_tokens

    def log_probs(self, batch: Batch) -> torch.Tensor:
        return batch_logp(self.model, batch, temperature=self.temperature, micro_batch_tokens=self.micro_batch_tokens)
