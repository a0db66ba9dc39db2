"""The trainable policy: a transformers causal LM sharded with FSDP2.

One `Policy` object is one rank. At world size 1 (inline) it is the same code on the unsharded model
(`training.shard`), so going multi-rank changes where the object lives, not what it computes. Loss reductions take the
token and sequence counts of the whole mini-batch (across micro-batches and ranks) from the caller:
the gradient of an optimizer step does not depend on how the mini-batch was cut.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from rlbench import algorithms as alg
from rlbench import models
from rlbench.batch import Batch
from rlbench.policy import checkpoint
from rlbench.policy.forward import batch_logp, rank_micro_batches, response_logits, token_logp
from rlbench.policy.training import (OptimSettings, Optimizer, autocast, backward, full_state_dict, init_process_group,
                                     shard, use_precision)

SUMMED_TERMS = frozenset({"loss", "pg_loss", "kl_loss", "entropy"})
"""Terms `Algorithm.actor_loss` reduces with the mini-batch's counts: they add up over micro-batches.
Every other metric is a per-micro-batch mean, averaged with token weights."""
MAX_TERMS = frozenset({"sampler_mismatch_max"})
"""Metrics that are maxima: the largest over micro-batches and ranks."""


class Policy:
    def __init__(self, model_dir: str, optim: OptimSettings, *, rank: int = 0, world_size: int = 1,
                 init_method: str | None = None, temperature: float = 1.0, micro_batch_tokens: int = 4096,
                 seed: int = 0, device: str = "cpu", precision: str = "fp32"):
        init_process_group(rank, world_size, init_method, device)
        torch.manual_seed(seed)
        self.rank, self.world_size = rank, world_size
        self.temperature, self.micro_batch_tokens, self.device = temperature, micro_batch_tokens, device
        self.precision = precision
        model = models.from_pretrained(AutoModelForCausalLM, model_dir)
        use_precision(model, precision, device)
        self.model = shard(model, world_size, device).train()
        self.optimizer = Optimizer(self.model, optim)
        self.before_backward: Callable[[], None] | None = None  # see `set_before_backward`

    def set_before_backward(self, fn: Callable[[], None] | None) -> None:
        """Call `fn` before each backward pass (None: nothing). An inline session starts its overlapped rollout
        there: the backward runs without holding Python's GIL."""
        self.before_backward = fn

    def log_probs(self, batch: Batch) -> torch.Tensor:
        """Log-probs `[B, T]` of the batch's responses under the current weights (no gradient)."""
        with autocast(self.precision, self.device):
            return batch_logp(self.model, batch, temperature=self.temperature,
                              micro_batch_tokens=self.micro_batch_tokens, device=self.device)

    def train_mini_batch(self, mini: Batch, algorithm: alg.Algorithm, *, num_tokens: int, num_seqs: int,
                         norm_length: int) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch: `forward_backward`, then `optim_step`."""
        self.optimizer.zero_grad()
        metrics = self.forward_backward(mini, algorithm, num_tokens=num_tokens, num_seqs=num_seqs,
                                        norm_length=norm_length)
        return metrics | self.optim_step(finite_loss=math.isfinite(metrics["loss"]))

    def forward_backward(self, batch: Batch, algorithm: alg.Algorithm, *, num_tokens: int, num_seqs: int,
                         norm_length: int) -> dict[str, float]:
        """Accumulate the gradient of the algorithm's loss over `batch`, micro-batch by micro-batch.

        `num_tokens` / `num_seqs` are the loss-token and sequence counts of the whole mini-batch over
        all ranks; each micro-batch's loss is reduced with them, so the summed micro-batch gradients are
        exactly the mini-batch gradient. Returns the loss terms (summed) and metrics (token-weighted).
        """
        sums: dict[str, float] = {}
        for micro in rank_micro_batches(batch, self.micro_batch_tokens):
            micro = micro.trimmed().to(self.device)
            terms = self._micro_loss(micro, algorithm, num_tokens=num_tokens, num_seqs=num_seqs,
                                     norm_length=norm_length)
            if self.before_backward is not None:
                self.before_backward()
            backward(terms["loss"])
            share = float(loss_mask(micro).sum()) / max(num_tokens, 1)
            for name, value in terms.items():
                if name in MAX_TERMS:
                    sums[name] = max(sums.get(name, 0.0), float(value))
                else:
                    weight = 1.0 if name in SUMMED_TERMS else share
                    sums[name] = sums.get(name, 0.0) + weight * float(value.detach())
        return sums

    def optim_step(self, *, finite_loss: bool = True) -> dict[str, float]:
        """Clip, step and advance the LR schedule; a non-finite gradient norm, or a non-finite loss on any
        rank (`finite_loss` of this rank), skips the step on every rank (recorded)."""
        finite = torch.tensor([float(finite_loss)], device=self.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return self.optimizer.step(finite_loss=bool(finite.item()))

    def _micro_loss(self, micro: Batch, algorithm: alg.Algorithm, **counts) -> dict[str, torch.Tensor]:
        with autocast(self.precision, self.device):
            logits_B_T_V = response_logits(self.model, micro, self.temperature)
        entropy_B_T = alg.entropy_from_logits(logits_B_T_V)
        logp_B_T = token_logp(logits_B_T_V, micro["response_ids"])
        if "old_logp" in micro:
            old_logp_B_T, mismatch = micro["old_logp"], {}
        else:  # Config.on_policy_old_logp: these weights sampled the batch, old_logp is this forward's
            old_logp_B_T = logp_B_T.detach()
            mismatch = sampler_mismatch(old_logp_B_T, micro["sampler_logp"], micro["response_mask"])
        loss, metrics = algorithm.actor_loss(
            logp_B_T, old_logp_B_T, micro["advantages"],
            loss_mask(micro), ref_logp_B_T=micro.tensors.get("ref_logp"),
            entropy_B_T=entropy_B_T if algorithm.entropy_coef else entropy_B_T.detach(),
            weights_B_T=micro.tensors.get("correction_weights"), **counts)
        return metrics | mismatch | {"loss": loss}

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full, unsharded weights on CPU on rank 0 (every rank takes part; the others get None)."""
        return full_state_dict(self.model)

    def save_checkpoint(self, path: str) -> None:
        """Write this rank's shards of the weights and optimizer state, its scheduler and RNG under `path`."""
        checkpoint.save(path, self.model, self.optimizer)

    def load_checkpoint(self, path: str) -> None:
        """Load a `save_checkpoint` folder (written by any number of ranks)."""
        checkpoint.load(path, self.model, self.optimizer)

    def export(self, path: str) -> None:
        """The current weights as a Hugging Face model folder at `path` (written by rank 0)."""
        checkpoint.export(path, self.model)

    def state_arrays(self) -> dict[str, "numpy.ndarray"] | None:  # noqa: F821
        """`state_dict()` as numpy arrays (views, no copy): what crosses Ray's object store zero-copy."""
        state = self.state_dict()
        return None if state is None else {k: v.numpy() for k, v in state.items()}


OPTIMIZER_KEYS = frozenset({"grad_norm", "skipped", "lr", "vf_grad_norm", "nonfinite_loss", "nonfinite_grad"})
"""Metrics every rank reports identically (one optimizer step over the whole model)."""


def merge_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from every rank's `train_mini_batch`: loss terms and token-weighted metrics were
    computed with the global counts, so they add up across ranks; optimizer values are rank 0's."""
    merged = {k: (max if k in MAX_TERMS else sum)(m[k] for m in per_rank) for k in per_rank[0] if k not in OPTIMIZER_KEYS}
    return merged | {k: per_rank[0][k] for k in OPTIMIZER_KEYS if k in per_rank[0]}


def sampler_mismatch(logp_B_T: torch.Tensor, sampler_logp_B_T: torch.Tensor,
                     mask_B_T: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean and max over valid tokens of |trainer log-prob - sampler log-prob|: how a broken weight sync shows."""
    delta_B_T = (sampler_logp_B_T - logp_B_T).abs() * mask_B_T
    return {"sampler_mismatch_mean": delta_B_T.sum() / mask_B_T.sum().clamp(min=1),
            "sampler_mismatch_max": delta_B_T.max()}


def loss_mask(batch: Batch) -> torch.Tensor:
    """Tokens the loss counts: `loss_mask` when rollout correction rejected some, else every response token."""
    return batch.tensors.get("loss_mask", batch["response_mask"]).float()
