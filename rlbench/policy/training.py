"""What every trainable worker shares: the process group, FSDP2 sharding (with tensor parallel inside each transformer
block when asked), AdamW with clipping and a schedule."""

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
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
        grad_norm = to_float(clip_grad_norm(self.parameters, max_norm))
        finite_grad = math.isfinite(grad_norm)
        if finite_grad and finite_loss:
            self.adamw.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.zero_grad()
        return {"grad_norm": grad_norm, "skipped": float(not (finite_grad and finite_loss)), "lr": lr,
                "nonfinite_loss": float(not finite_loss), "nonfinite_grad": float(not finite_grad)}


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global 2-norm is at most `max_norm`; the norm before, as a plain tensor.

    Under tensor parallel the parameters are DTensors on two meshes (a block's projections on (dp, tp), the
    embeddings and norms on dp alone), which torch's `clip_grad_norm_` cannot reduce together: each mesh's norm is
    reduced over its own ranks, and the global norm is the root of their squares' sum."""
    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if len(by_mesh) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in by_mesh.values()]
    norm = torch.linalg.vector_norm(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


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


def shard(model: torch.nn.Module, world_size: int, device: str = "cpu", *, tensor_parallel: int = 1,
          even_alone: bool = False) -> torch.nn.Module:
    """FSDP2 over a one-dimensional mesh of `device` ("cpu": gloo, "cuda": NCCL): each transformer block,
    then the root. At world size 1 the model stays unsharded: one-rank FSDP2 would only add its hooks and
    DTensor dispatch (a fifth of tiny-arith's update time), and its checkpoints load either way; `even_alone`
    shards it all the same, on the code path of N ranks (in a process group of one, which the caller made).

    `tensor_parallel` > 1: a two-dimensional mesh, world_size / tensor_parallel data-parallel groups of
    `tensor_parallel` consecutive ranks. Within a group each decoder block's projections are split
    (`split_blocks`); FSDP2 then shards every parameter over the data-parallel dimension."""
    model.to(device)
    if world_size == 1 and not even_alone:
        return model
    if tensor_parallel > 1:
        mesh_2d = init_device_mesh(device, (world_size // tensor_parallel, tensor_parallel), mesh_dim_names=("dp", "tp"))
        split_blocks(model, mesh_2d["tp"])
        mesh = mesh_2d["dp"]
    else:
        mesh = init_device_mesh(device, (world_size,))
    for module in model.modules():
        if type(module).__name__ in (getattr(model, "_no_split_modules", None) or []):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


TENSOR_PARALLEL_PLAN = {"self_attn.q_proj": ColwiseParallel, "self_attn.k_proj": ColwiseParallel,
                        "self_attn.v_proj": ColwiseParallel, "self_attn.o_proj": RowwiseParallel,
                        "mlp.gate_proj": ColwiseParallel, "mlp.up_proj": ColwiseParallel, "mlp.down_proj": RowwiseParallel}
"""Megatron's split of a Qwen2 / Llama decoder block: the query, key, value, gate and up projections by output rows
(each rank its own attention heads and MLP columns, no communication), the attention output and down projections by
input columns (one all-reduce each, forward and backward). The embeddings, norms and output head are whole on every
rank of a tensor-parallel group."""


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a causal LM's decoder (`_no_split_modules` with a `self_attn`)."""
    names = getattr(model, "_no_split_modules", None) or []
    return [m for m in model.modules() if type(m).__name__ in names and hasattr(m, "self_attn")]


def check_tensor_parallel(model: torch.nn.Module, size: int) -> None:
    """ValueError naming what keeps `model` from a `size`-way `TENSOR_PARALLEL_PLAN`: heads or MLP width not
    divisible, or blocks that are not dense Qwen2 / Llama-family blocks (a mixture of experts)."""
    name = type(model).__name__
    blocks = decoder_blocks(model)
    if not blocks or not all(_is_linear(block, path) for block in blocks for path in TENSOR_PARALLEL_PLAN):
        raise ValueError(f"tensor_parallel={size}: {name}'s decoder blocks are not dense Qwen2 / Llama-family blocks "
                         f"(linear {', '.join(TENSOR_PARALLEL_PLAN)}; a mixture of experts has no dense MLP): use FSDP "
                         f"alone (tensor_parallel=1)")
    config = model.config.get_text_config()
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    uneven = [f"{key}={value}" for key, value in sizes.items() if value % size]
    if uneven:
        raise ValueError(f"tensor_parallel={size} does not divide {name}'s {', '.join(uneven)}: each rank takes an "
                         f"equal share of the heads and the MLP width")


def _is_linear(module: torch.nn.Module, path: str) -> bool:
    try:
        return isinstance(module.get_submodule(path), torch.nn.Linear)
    except AttributeError:
        return False


def split_blocks(model: torch.nn.Module, mesh) -> None:
    """Tensor parallel over the one-dimensional `mesh`: `TENSOR_PARALLEL_PLAN` in every decoder block. Each rank's
    attention then runs on its own heads: transformers' attention reshapes its projections by head size, so the
    local projections give the local heads."""
    check_tensor_parallel(model, mesh.size())
    for block in decoder_blocks(model):
        parallelize_module(block, mesh, {path: style() for path, style in TENSOR_PARALLEL_PLAN.items()})


def backward(loss: torch.Tensor, data_parallel: int) -> None:
    """Backpropagate a rank's share of a loss reduced with the mini-batch's global counts.

    Such shares add up to the mini-batch loss, so the gradients of the `data_parallel` groups (ranks, without
    tensor parallel) must be summed; FSDP2 averages them over the groups (gloo has no pre-scaled sum), hence the factor.
    """
    (loss * data_parallel).backward()


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
