"""The frozen reference policy (the model as loaded), for KL penalties."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rlbench import models
from rlbench.batch import Batch
from rlbench.policy import checkpoint
from rlbench.policy.forward import batch_logp
from rlbench.policy.training import init_process_group, shard


class Reference:
    """The initial policy, frozen; sharded with FSDP2 over the same ranks as the policy."""

    def __init__(self, model_dir: str, *, rank: int = 0, world_size: int = 1, init_method: str | None = None,
                 temperature: float = 1.0, micro_batch_tokens: int = 4096, device: str = "cpu",
                 attention: str = "auto"):
        init_process_group(rank, world_size, init_method, device)
        model = models.from_pretrained(AutoModelForCausalLM, model_dir).requires_grad_(False)
        self.model = shard(model, world_size, device).eval()
        self.rank, self.world_size, self.device = rank, world_size, device
        self.temperature, self.micro_batch_tokens, self.attention = temperature, micro_batch_tokens, attention

    def log_probs(self, batch: Batch) -> torch.Tensor:
        return batch_logp(self.model, batch, temperature=self.temperature, micro_batch_tokens=self.micro_batch_tokens,
                          world_size=self.world_size, device=self.device, attention=self.attention)

    def save_checkpoint(self, path: str) -> None:
        checkpoint.save(path, self.model, rank=self.rank)

    def load_checkpoint(self, path: str) -> None:
        checkpoint.load(path, self.model, rank=self.rank)
