"""Saving and loading a worker's training state: sharded weights and optimizer state through
torch.distributed.checkpoint (each rank writes its own shards; a different world size can load them),
plus each rank's scheduler and RNG state, and the export of full weights as a Hugging Face model folder.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from transformers import AutoModelForCausalLM

from rlbench import models
from rlbench.policy.training import Optimizer, full_state_dict


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: Optimizer | None = None) -> None:
    """Write `model`'s (and `optimizer`'s) state under `path`; every rank of the model's group calls it.

    An optimizer that has not stepped yet has no state to save (and asking torch for it would create
    some by a zero step, changing the run): then only its scheduler is kept.
    """
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None and optimizer.adamw.state:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer.adamw)
    dcp.save(state, checkpoint_id=str(path))
    local = {"rng": torch.get_rng_state(), "has_optimizer_state": "optimizer" in state}
    if optimizer is not None:
        local["scheduler"] = optimizer.scheduler.state_dict()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        local["cuda_rng"] = torch.cuda.get_rng_state()
    torch.save(local, Path(path) / f"rank{dist.get_rank()}.pt")


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: Optimizer | None = None) -> None:
    """Load what `save` wrote under `path` into `model` (and `optimizer`), resharded to this world size."""
    path = Path(path)
    local = torch.load(path / f"rank{_saved_rank(path)}.pt", weights_only=True)
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None and local["has_optimizer_state"]:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer.adamw)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if "optimizer" in state:
        set_optimizer_state_dict(model, optimizer.adamw, state["optimizer"])
    if optimizer is not None:
        optimizer.scheduler.load_state_dict(local["scheduler"])
    torch.set_rng_state(local["rng"])
    if "cuda_rng" in local and torch.cuda.is_available():
        torch.cuda.set_rng_state(local["cuda_rng"])


def export(path: str | os.PathLike, model: torch.nn.Module) -> None:
    """Write `model`'s full weights as a Hugging Face model folder (config and safetensors) on rank 0;
    every rank calls it. The folder loads with `AutoModelForCausalLM.from_pretrained` and with vLLM."""
    state = full_state_dict(model)
    if state is None:
        return
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=next(iter(state.values())).dtype)
    plain.load_state_dict(state, assign=True, strict=False)
    plain.tie_weights()
    missing = {name for name, p in plain.named_parameters() if p.is_meta}
    if missing:
        raise RuntimeError(f"export: no weights for {sorted(missing)}")
    with models.quiet_transformers():
        plain.save_pretrained(path)


def _saved_rank(path: Path) -> int:
    """This rank's local state file, or rank 0's when the checkpoint was written by fewer ranks (every
    rank's scheduler is the same; RNG streams then continue from rank 0's)."""
    rank = dist.get_rank()
    return rank if (path / f"rank{rank}.pt").is_file() else 0
