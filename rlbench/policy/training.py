"""What every trainable worker shares: the process group, FSDP2 sharding, AdamW with clipping and a schedule."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from rlbench.algorithms import to_float


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Max gradient norm (0 = no clipping)."""
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 1000


class Optimizer:
    """AdamW over a (sharded) model's parameters, with gradient clipping and an LR schedule."""

    def __init__(self, model: torch.nn.Module, settings: OptimSettings):
        self.model, self.settings = model, settings
        self.parameters = [p for p in model.parameters() if p.requires_grad]  # under LoRA: the adapter's
        # fused: one kernel over all parameters (the default loops over them: ~10x slower on a small model)
        self.adamw = torch.optim.AdamW(self.parameters, lr=settings.lr, betas=tuple(settings.betas),
                                       weight_decay=settings.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.adamw, lr_lambda(settings.lr_schedule, settings.lr_warmup_steps, settings.lr_decay_steps))

    def apply_settings(self) -> None:
        """Make the optimizer follow `settings` after a checkpoint's state was loaded into it (which carries the
        saved lr, betas and weight decay): a restored session's overrides take effect, the schedule goes on
        from the loaded step count with the settings' shape and peak lr. Without overrides nothing changes."""
        s = self.settings
        schedule = lr_lambda(s.lr_schedule, s.lr_warmup_steps, s.lr_decay_steps)
        self.scheduler.base_lrs = [s.lr for _ in self.adamw.param_groups]
        self.scheduler.lr_lambdas = [schedule for _ in self.adamw.param_groups]
        for group in self.adamw.param_groups:
            group.update(initial_lr=s.lr, lr=s.lr * schedule(self.scheduler.last_epoch), betas=tuple(s.betas),
                         weight_decay=s.weight_decay)
        self.scheduler._last_lr = [group["lr"] for group in self.adamw.param_groups]

    def zero_grad(self) -> None:
        self.adamw.zero_grad(set_to_none=True)

    def step(self, *, finite_loss: bool = True) -> dict[str, float]:
        """Clip, step and advance the schedule. A non-finite gradient norm, or `finite_loss=False`, skips
        the step and leaves weights and optimizer state as they were (recorded in the returned metrics)."""
        max_norm = self.settings.grad_clip if self.settings.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm)
        grad_norm = to_float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        finite_grad = math.isfinite(grad_norm)
        if finite_grad and finite_loss:
            self.adamw.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.zero_grad()
        return {"grad_norm": grad_norm, "skipped": float(not (finite_grad and finite_loss)), "lr": lr,
                "nonfinite_loss": float(not finite_loss), "nonfinite_grad": float(not finite_grad)}


def lr_lambda(schedule: str, warmup_steps: int, decay_steps: int):
    """Multiplier of the peak LR after `step` optimizer steps: linear warm-up, then constant / linear / cosine."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min((step - warmup_steps) / max(decay_steps - warmup_steps, 1), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0
    return factor


def use_precision(model: torch.nn.Module, precision: str, device: str) -> None:
    """Prepare a model for `autocast(precision)` ("fp32" or "bf16"): under bf16 on a CPU, eager attention
    (PyTorch's CPU flash-attention backward is ~20x slower in bfloat16 than in fp32; the eager one is fast)."""
    if precision == "bf16" and device == "cpu":
        model.set_attn_implementation("eager")


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Activation checkpointing: each transformer block keeps only its input for the backward, which runs
    its forward again (non-reentrant `torch.utils.checkpoint`). Activation memory drops from every
    block's intermediates to one block's, for about a third more compute; gradients are unchanged.

    Transformers' own `gradient_checkpointing_enable` acts only in training mode, and the trainer's models
    run in eval mode (no dropout, see `Policy`): the blocks' forwards are wrapped here instead."""
    blocks = [module for module in model.modules()
              if type(module).__name__ in (getattr(model, "_no_split_modules", None) or [])]
    if not blocks:
        raise ValueError(f"activation checkpointing: {type(model).__name__} names no transformer block class "
                         f"(_no_split_modules)")
    for block in blocks:
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)


def autocast(precision: str, device: str):
    """The context a forward (and so its backward) runs in: bfloat16 autocast for "bf16" (weights, gradients
    and optimizer state stay fp32), nothing for "fp32"."""
    return torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def shard(model: torch.nn.Module, world_size: int, device: str = "cpu", *, even_alone: bool = False) -> torch.nn.Module:
    """FSDP2 over a one-dimensional mesh of `device` ("cpu": gloo, "cuda": NCCL): each transformer block,
    then the root. At world size 1 the model stays unsharded: one-rank FSDP2 would only add its hooks and
    DTensor dispatch (a fifth of tiny-arith's update time), and its checkpoints load either way; `even_alone`
    shards it all the same, on the code path of N ranks (in a process group of one, which the caller made)."""
    model.to(device)
    if world_size == 1 and not even_alone:
        return model
    mesh = init_device_mesh(device, (world_size,))
    for module in model.modules():
        if type(module).__name__ in (getattr(model, "_no_split_modules", None) or []):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def backward(loss: torch.Tensor, world_size: int) -> None:
    """Backpropagate a rank's share of a loss reduced with the mini-batch's global counts.

    Such shares add up to the mini-batch loss, so rank gradients must be summed; FSDP2 averages them over
    the world size (gloo has no pre-scaled sum), hence the factor.
    """
    (loss * world_size).backward()


def full_state_dict(model: torch.nn.Module, rank: int, world_size: int,
                    frozen: bool = True) -> dict[str, torch.Tensor] | None:
    """The unsharded weights on CPU, on rank 0 (every rank takes part; the others get None); without the
    `frozen` ones (requires_grad off: a LoRA model's base), only the trained ones. At world size 1 (an unsharded
    model, see `shard`) these are the live parameters on CPU, not copies: readers copy."""
    if world_size == 1:  # the state-dict API's traversal is most of a tiny model's sync time
        if not frozen:
            return {name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad}
        return {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=not frozen))
    return None if rank else state if frozen else trained_only(model, state)


def trained_only(model: torch.nn.Module, state: dict) -> dict:
    """The entries of a state dict of `model` that train (requires_grad). torch's `ignore_frozen_params` keeps a
    frozen weight tied to another name (a tied LM head) under that name."""
    trained = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {name: value for name, value in state.items() if name in trained}


def init_process_group(rank: int, world_size: int, init_method: str | None = None, device: str = "cpu") -> None:
    """Join the ranks' process group: gloo (CPU) or NCCL (CUDA), over the rendezvous `init_method`
    (tcp://host:port, chosen by the driver) or MASTER_ADDR / MASTER_PORT from the environment.

    Only at world size > 1, where each rank is a worker process of its own (a Ray actor). One rank needs no
    process group, and makes none: an inline worker lives in the user's process, whose torch.distributed
    state (an in-process vLLM engine's group, a user's own) is not ours to create or tear down.
    """
    if world_size == 1:
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"this process already belongs to a process group of size {dist.get_world_size()}, "
                               f"not {world_size}")
        return
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
