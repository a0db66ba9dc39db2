"""The critic of PPO: the policy's backbone with a scalar value head, trained on GAE returns."""

from __future__ import annotations

import torch
from transformers import AutoModelForTokenClassification

from rlbench import algorithms as alg
from rlbench import models
from rlbench.batch import Batch
from rlbench.policy import checkpoint
from rlbench.policy.forward import batch_outputs, packs, rank_micro_batches, response_outputs
from rlbench.policy.fsdp import loss_mask
from rlbench.policy.training import OptimSettings, Optimizer, backward, init_process_group, shard


class Critic:
    """V(state before each response token), one value per token; FSDP2 like the policy.

    Built from the policy's checkpoint as a token-classification model with one label: the backbone
    starts from the policy's weights, the value head from a seeded random init.
    """

    def __init__(self, model_dir: str, optim: OptimSettings, *, rank: int = 0, world_size: int = 1,
                 init_method: str | None = None, micro_batch_tokens: int = 4096, clip_range: float = 0.5,
                 seed: int = 0, device: str = "cpu", attention: str = "auto"):
        init_process_group(rank, world_size, init_method, device)
        self.rank, self.world_size, self.device = rank, world_size, device
        with torch.random.fork_rng(devices=[]):  # the value head's init, seeded, without touching the caller's RNG
            torch.manual_seed(seed)
            model = models.from_pretrained(AutoModelForTokenClassification, model_dir, num_labels=1)
        self.model = shard(model, world_size, device).eval()  # dropout off, as the policy's
        self.optimizer = Optimizer(self.model, optim)
        self.micro_batch_tokens, self.clip_range, self.attention = micro_batch_tokens, clip_range, attention

    def save_checkpoint(self, path: str) -> None:
        checkpoint.save(path, self.model, self.optimizer, rank=self.rank)

    def load_checkpoint(self, path: str) -> None:
        checkpoint.load(path, self.model, self.optimizer, rank=self.rank)

    def values(self, batch: Batch) -> torch.Tensor:
        """Values `[B, T]` of the batch's response positions (0 on padding)."""
        return batch_outputs(lambda micro: response_outputs(self.model, micro, self.attention)[..., 0], batch,
                             micro_batch_tokens=self.micro_batch_tokens, world_size=self.world_size, device=self.device,
                             packs=packs(self.model, self.attention))

    def train_mini_batch(self, mini: Batch, *, mode: str, num_tokens: int, num_seqs: int,
                         norm_length: int) -> dict[str, float]:
        """One optimizer step of the clipped value loss on `returns`, reduced with the mini-batch's counts."""
        self.optimizer.zero_grad()
        sums: dict[str, float] = {}
        layout = packs(self.model, self.attention)
        for micro in rank_micro_batches(mini, self.micro_batch_tokens, self.world_size, layout):
            micro = micro.trimmed().to(self.device)
            mask_B_T = loss_mask(micro)
            loss, metrics = alg.value_loss(response_outputs(self.model, micro, self.attention)[..., 0], micro["values"],
                                           micro["returns"], mask_B_T, clip_range=self.clip_range, mode=mode,
                                           num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
            backward(loss, self.world_size)
            share = float(mask_B_T.sum()) / max(num_tokens, 1)
            sums["vf_loss"] = sums.get("vf_loss", 0.0) + alg.to_float(metrics["vf_loss"])
            sums["vf_clip_frac"] = sums.get("vf_clip_frac", 0.0) + share * alg.to_float(metrics["vf_clip_frac"])
        step = self.optimizer.step()
        return sums | {"vf_grad_norm": step["grad_norm"]}
