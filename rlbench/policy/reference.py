"""Frozen models that score the policy's samples: the reference policy (the model as loaded), for KL penalties, and
an on-policy distillation teacher."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rlbench import models
from rlbench.batch import Batch
from rlbench.policy import checkpoint
from rlbench.policy.forward import batch_logp, chunk_tokens_for
from rlbench.policy.training import autocast, init_process_group, shard


class Reference:
    """A frozen model, sharded with FSDP2 (and split `tensor_parallel` ways as the policy is) over ranks of its own or
    the policy's: the initial policy (the reference), or a distillation teacher (`vocab`: the policy's vocabulary size,
    which the teacher's top-k stays within)."""

    def __init__(self, model_dir: str, *, rank: int = 0, world_size: int = 1, tensor_parallel: int = 1,
                 init_method: str | None = None, temperature: float = 1.0, micro_batch_tokens: int = 4096, device: str = "cpu",
                 attention: str = "auto", vocab: int | None = None, precision: str = "fp32",
                 logit_chunk_tokens: int | None = None):
        init_process_group(rank, world_size, init_method, device)
        model = models.from_pretrained(AutoModelForCausalLM, model_dir).requires_grad_(False)
        self.model = shard(model, world_size, device, tensor_parallel=tensor_parallel).eval()
        self.rank, self.world_size, self.device, self.precision = rank, world_size, device, precision
        self.temperature, self.micro_batch_tokens, self.attention = temperature, micro_batch_tokens, attention
        self.vocab = vocab
        self.chunk_tokens = chunk_tokens_for(logit_chunk_tokens, micro_batch_tokens, model.config.get_text_config().vocab_size)

    def log_probs(self, batch: Batch, topk: int = 0) -> torch.Tensor:
        """Log-probs `[B, T]` of the batch's responses; with `topk` = k, `[B, T, 1 + 2k]`: also this model's k most
        likely tokens' log-probs and ids per position (`batch_logp`)."""
        with autocast(self.precision, self.device):  # the policy's forward precision (`Config.precision`)
            return batch_logp(self.model, batch, temperature=self.temperature, micro_batch_tokens=self.micro_batch_tokens,
                              world_size=self.world_size, device=self.device, attention=self.attention, topk=topk,
                              vocab=self.vocab, chunk_tokens=self.chunk_tokens)

    def save_checkpoint(self, path: str) -> None:
        checkpoint.save(path, self.model, rank=self.rank)

    def load_checkpoint(self, path: str) -> None:
        checkpoint.load(path, self.model, rank=self.rank)
