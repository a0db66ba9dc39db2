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
from rlbench.models import lora as lora_adapters
from rlbench.models.vision import vision_tower
from rlbench.policy import checkpoint
from rlbench.policy.router import RouterStats, recording, routers
from rlbench.policy.forward import (batch_logp, chunk_tokens_for, drawn_logp, packs, rank_micro_batches,
                                   response_logits, response_stats)
from rlbench.policy.training import (
    Optimizer,
    OptimSettings,
    autocast,
    backward,
    checkpoint_blocks,
    full_state_dict,
    init_process_group,
    shard,
    use_precision,
)

SUMMED_TERMS = frozenset({"loss", "pg_loss", "kl_loss", "entropy", "forward_kl"})
"""Terms `Algorithm.actor_loss` reduces with the mini-batch's counts: they add up over micro-batches.
Every other metric is a per-micro-batch mean, averaged with token weights."""
MAX_TERMS = frozenset({"sampler_mismatch_max", "sampler_ratio_max"})
"""Metrics that are maxima: the largest over micro-batches and ranks."""
MIN_TERMS = frozenset({"sampler_ratio_min"})
"""Metrics that are minima: the smallest over micro-batches and ranks."""


class Policy:
    """One rank of the trainable policy. Its methods are what a training loop calls: `log_probs`,
    `forward_backward` (any number of times, gradients accumulate), then `optim_step`.

    `tensor_parallel` > 1: each transformer block split that many ways inside FSDP2 (`training.shard`); the ranks of a
    tensor-parallel group are given the same rows, and the gradient is summed over the `data_parallel` groups.

    The model trains in eval mode: dropout off (a model's config may set some, e.g. GPT-2's 0.1), so that
    `old_logp` is the sampler's distribution and the on-policy ratio is exactly 1; gradients flow as usual.
    """

    def __init__(self, model_dir: str, optim: OptimSettings, *, rank: int = 0, world_size: int = 1,
                 tensor_parallel: int = 1, init_method: str | None = None, temperature: float = 1.0, micro_batch_tokens: int = 4096,
                 device: str = "cpu", precision: str = "fp32", attention: str = "auto",
                 activation_checkpointing: bool = False, lora: lora_adapters.LoRA | None = None, seed: int = 0,
                 logit_chunk_tokens: int | None = None, freeze_vision: bool = False):
        init_process_group(rank, world_size, init_method, device)
        self.rank, self.world_size, self.data_parallel = rank, world_size, world_size // tensor_parallel
        self.temperature, self.micro_batch_tokens, self.device = temperature, micro_batch_tokens, device
        self.precision, self.attention = precision, attention
        self.model_dir, self.lora = model_dir, lora
        model = models.from_pretrained(AutoModelForCausalLM, model_dir)
        self.chunk_tokens = chunk_tokens_for(logit_chunk_tokens, micro_batch_tokens, model.config.get_text_config().vocab_size)
        use_precision(model, precision, device)
        if freeze_vision:  # before sharding: FSDP2 keeps each parameter's requires_grad
            vision_tower(model).requires_grad_(False)
        if lora is not None:  # the base frozen, only the adapter trains (and sits in the optimizer)
            model = lora_adapters.wrap(model, lora, seed)
        if activation_checkpointing:
            checkpoint_blocks(model)
        self.model = shard(model, world_size, device, tensor_parallel=tensor_parallel).eval()  # dropout off: see `Policy`
        self.optimizer = Optimizer(self.model, optim)
        self.finite_loss = True  # no non-finite loss since the last optim_step
        self.router = RouterStats(self.model) if routers(self.model) else None  # a mixture of experts' routing
        self.before_backward: Callable[[], None] | None = None  # see `set_before_backward`

    def set_before_backward(self, fn: Callable[[], None] | None) -> None:
        """Call `fn` before each backward pass (None: nothing). An inline session starts its overlapped rollout
        there: the backward runs without holding Python's GIL."""
        self.before_backward = fn

    def log_probs(self, batch: Batch, sum_pi2: bool = False) -> torch.Tensor:
        """Log-probs `[B, T]` of the batch's responses under the current weights (no gradient); with `sum_pi2`,
        `[B, T, 2]`: and `Σ_v π_v²` per response token from the same forward (what OTB reads)."""
        with autocast(self.precision, self.device):
            return batch_logp(self.model, batch, temperature=self.temperature, micro_batch_tokens=self.micro_batch_tokens,
                              world_size=self.world_size, device=self.device, attention=self.attention, sum_pi2=sum_pi2,
                              chunk_tokens=self.chunk_tokens)

    def reference_log_probs(self, batch: Batch) -> torch.Tensor:
        """Under LoRA, the reference policy's log-probs `[B, T]`: this model with its adapter off, which is
        the model as loaded (no second copy of the weights)."""
        with self.model.disable_adapter():
            return self.log_probs(batch)

    def forward_backward(self, batch: Batch, algorithm: alg.Algorithm, *, num_tokens: int, num_seqs: int,
                         norm_length: int) -> dict[str, float]:
        """Accumulate the gradient of the algorithm's loss over `batch`, micro-batch by micro-batch.

        `num_tokens` / `num_seqs` are the loss-token and sequence counts of the whole mini-batch over
        all ranks; each micro-batch's loss is reduced with them, so the summed micro-batch gradients are
        exactly the mini-batch gradient. Returns the loss terms (summed) and metrics (token-weighted).
        """
        sums: dict[str, float] = {}
        layout = packs(self.model, self.attention)
        for micro in rank_micro_batches(batch, self.micro_batch_tokens, self.world_size, layout):
            micro = micro.trimmed().to(self.device)
            terms = self._micro_loss(micro, algorithm, num_tokens=num_tokens, num_seqs=num_seqs,
                                     norm_length=norm_length)
            self.finite_loss &= math.isfinite(float(terms["loss"].detach()))
            if self.before_backward is not None:
                self.before_backward()
            backward(terms["loss"], self.data_parallel)
            share = float(loss_mask(micro).sum()) / max(num_tokens, 1)
            for name, value in terms.items():
                if name in MAX_TERMS or name in MIN_TERMS:
                    pick = max if name in MAX_TERMS else min
                    sums[name] = pick(sums.get(name, alg.to_float(value)), alg.to_float(value))
                else:
                    weight = 1.0 if name in SUMMED_TERMS else share
                    sums[name] = sums.get(name, 0.0) + weight * alg.to_float(value.detach())
        return sums

    def optim_step(self) -> dict[str, float]:
        """Clip, step and advance the LR schedule over the gradients accumulated since the last step. A
        non-finite gradient norm, or a non-finite loss on any rank since the last step, skips the step on
        every rank (recorded in the returned metrics)."""
        finite = self.finite_loss
        if self.world_size > 1:
            flag = torch.tensor([float(finite)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = bool(flag.item())
        self.finite_loss = True
        return self.optimizer.step(finite_loss=finite)

    def train_step(self, batch: Batch, algorithm: alg.Algorithm, **counts) -> tuple[dict[str, float], dict[str, float]]:
        """`forward_backward` then `optim_step` (one call for a driver that has one mini-batch to step on):
        (the loss terms, the step's metrics). It starts from no gradient: what a call stopped midway (an error, a
        Ctrl-C) left is never added to this step's."""
        self.optimizer.zero_grad()
        return self.forward_backward(batch, algorithm, **counts), self.optim_step()

    def _micro_loss(self, micro: Batch, algorithm: alg.Algorithm, **counts) -> dict[str, torch.Tensor]:
        chunked = self.chunk_tokens and not algorithm.forward_kl_coef  # distillation reads the logits themselves
        router = self.router
        with autocast(self.precision, self.device), recording(router, micro["response_mask"]):
            if chunked:
                logp_B_T, entropy_B_T = response_stats(self.model, micro, temperature=self.temperature,
                                                       chunk_tokens=self.chunk_tokens, attention=self.attention,
                                                       router=router).unbind(-1)
            else:
                logits_B_T_V = response_logits(self.model, micro, self.temperature, self.attention, router)
        routing = router.metrics() if router is not None else {}
        if not chunked:
            entropy_B_T = alg.entropy_from_logits(logits_B_T_V)
            logp_B_T = alg.token_logp(logits_B_T_V, micro["response_ids"])
        logp_B_T = drawn_logp(self.model, logp_B_T, micro["response_ids"])
        if "old_logp" not in micro:  # Config.on_policy_old_logp: these weights sampled the batch, old_logp is this forward's
            old_logp_B_T = logp_B_T.detach()
            mismatch = alg.mismatch_metrics(old_logp_B_T, micro["sampler_logp"], loss_mask(micro))
        elif micro.meta.get("old_logp_is_sampler"):  # bypass, overlap / async uncorrected: PPO's old is the sampler's,
            old_logp_B_T = micro["old_logp"]  # so the batch shows no mismatch; this forward shows it (for every micro-batch)
            mismatch = alg.mismatch_metrics(logp_B_T.detach(), old_logp_B_T, loss_mask(micro))
        else:
            old_logp_B_T, mismatch = micro["old_logp"], {}
        distill = {}
        if algorithm.forward_kl_coef:  # the student's log-probs at the teacher's top-k ids, from these logits
            ids_B_T_K = micro["teacher_topk_ids"]
            distill = {"topk_logp_B_T_K": logits_B_T_V.gather(-1, ids_B_T_K) - logits_B_T_V.logsumexp(-1, keepdim=True),
                       "teacher_topk_logp_B_T_K": micro["teacher_topk_logp"]}
        loss, metrics = algorithm.actor_loss(
            logp_B_T, old_logp_B_T, micro["advantages"],
            loss_mask(micro), ref_logp_B_T=micro.tensors.get("ref_logp"),
            entropy_B_T=entropy_B_T if algorithm.entropy_coef else entropy_B_T.detach(),
            weights_B_T=micro.tensors.get("correction_weights"), **distill, **counts)
        return metrics | mismatch | routing | {"loss": loss}

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """What the sampler needs, unsharded on CPU on rank 0 (every rank takes part; the others get None):
        the full weights, or under LoRA the adapter alone (by peft's names; see `rlbench.models.lora`)."""
        return full_state_dict(self.model, self.rank, self.world_size, frozen=self.lora is None)

    def save_checkpoint(self, path: str) -> None:
        """Write this rank's shards of the trained weights (under LoRA: the adapter) and their optimizer state,
        and its scheduler, under `path`."""
        checkpoint.save(path, self.model, self.optimizer, rank=self.rank, frozen=self.lora is None)

    def load_checkpoint(self, path: str) -> None:
        """Load a `save_checkpoint` folder (written by any number of ranks)."""
        checkpoint.load(path, self.model, self.optimizer, rank=self.rank, frozen=self.lora is None)

    def export(self, path: str, adapter: bool = False) -> None:
        """The current weights as a Hugging Face model folder at `path` (written by rank 0); under LoRA the
        adapter merged into the base, or with `adapter=True` the adapter alone as a peft folder."""
        if self.lora is None:
            if adapter:
                raise ValueError("export(adapter=True) needs a LoRA session (lora=rl.LoRA(...)); this one trains every weight")
            checkpoint.export(path, self.model, rank=self.rank, world_size=self.world_size)
            return
        state = full_state_dict(self.model, self.rank, self.world_size, frozen=not adapter)
        if state is None:
            return
        if adapter:
            lora_adapters.save_adapter(path, state, self.lora, base_model=self.model_dir)
        else:
            checkpoint.export(path, self.model.get_base_model(), state=lora_adapters.merged_state(state, self.lora))

    def state_arrays(self) -> dict[str, "numpy.ndarray"] | None:  # noqa: F821
        """`state_dict()` as numpy arrays (views, no copy): what crosses Ray's object store zero-copy."""
        state = self.state_dict()
        return None if state is None else {k: v.numpy() for k, v in state.items()}


def merge_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from every rank's `forward_backward`: loss terms and token-weighted metrics were
    computed with the global counts, so they add up across ranks; extremes take the extreme."""
    def merge(name: str) -> float:
        values = [m[name] for m in per_rank]
        return max(values) if name in MAX_TERMS else min(values) if name in MIN_TERMS else sum(values)
    return {name: merge(name) for name in per_rank[0]}


def loss_mask(batch: Batch) -> torch.Tensor:
    """Tokens the loss counts: `loss_mask` where the batch has one (an episode's sampled tokens; those rollout
    correction kept), else every response token."""
    return batch.tensors.get("loss_mask", batch["response_mask"]).float()
