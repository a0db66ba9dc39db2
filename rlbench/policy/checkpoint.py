"""Saving and loading a worker's training state: sharded weights and optimizer state through
torch.distributed.checkpoint (each rank writes its own shards; a different world size can load them),
plus each rank's scheduler state, and the export of full weights as a Hugging Face model folder.
A checkpoint that cannot be read or written raises `CheckpointError`, naming the folder and the cause.
"""

from __future__ import annotations

import copy
import errno
import os
import pickle
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from rlbench import models
from rlbench.models.vision import has_vision_tower
from rlbench.policy.training import Optimizer, full_state_dict, trained_only


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be written or read; the message names the folder and the first
    underlying error, which is kept as `__cause__` (torch's own `CheckpointException` derives from
    BaseException, which `except Exception` misses)."""


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: Optimizer | None = None, *,
         rank: int = 0, frozen: bool = True) -> None:
    """Write `model`'s (and `optimizer`'s) state under `path`; every rank of the model's group calls it,
    passing its `rank` (one rank alone has no process group). Without `frozen`, the weights that train only
    (a LoRA model's adapter: its base is the model directory's).

    An optimizer that has not stepped yet has no state to save (and asking torch for it would create
    some by a zero step, changing the run): then only its scheduler is kept. OSError (ENOSPC) before
    writing when the disk has less free than the state's size; CheckpointError when writing fails.
    """
    path = Path(path)
    model_state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=not frozen))
    state = {"model": model_state if frozen else trained_only(model, model_state)}
    if optimizer is not None and optimizer.adamw.state:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer.adamw)
    _check_space(path, _nbytes(state), rank)
    local = {"has_optimizer_state": "optimizer" in state}  # no RNG: training draws nothing at random
    if optimizer is not None:
        local["scheduler"] = optimizer.scheduler.state_dict()
    with _torch_io("write", path):
        dcp.save(state, checkpoint_id=str(path))
        torch.save(local, path / f"rank{rank}.pt")


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: Optimizer | None = None, *,
         rank: int = 0, frozen: bool = True) -> None:
    """Load what `save` wrote under `path` into `model` (and `optimizer`), resharded to this world size;
    CheckpointError when the folder cannot be read. `frozen` as in `save`."""
    path = Path(path)
    options = StateDictOptions(ignore_frozen_params=not frozen, strict=frozen)
    model_state = get_model_state_dict(model, options=options)
    state = {"model": model_state if frozen else trained_only(model, model_state)}
    with _torch_io("read", path):
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    _check_same_tensors(path, saved, state["model"])
    with _torch_io("read", path):
        local = torch.load(path / f"rank{_saved_rank(path, rank)}.pt", weights_only=True)
        if optimizer is not None and local["has_optimizer_state"]:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer.adamw)
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=options)
    if "optimizer" in state:
        set_optimizer_state_dict(model, optimizer.adamw, state["optimizer"])
    if optimizer is not None:
        optimizer.scheduler.load_state_dict(local["scheduler"])
        optimizer.apply_settings()  # the settings it was built with win over the saved ones (restore overrides)


def export(path: str | os.PathLike, model: torch.nn.Module, *, rank: int = 0, world_size: int = 1,
           state: dict[str, torch.Tensor] | None = None) -> None:
    """Write `model`'s full weights (or the gathered `state` given, in the model's names) as a Hugging Face
    model folder (config and safetensors) on rank 0; every rank calls it. The folder loads with
    `AutoModelForCausalLM.from_pretrained` (a vision-language model's: `AutoModelForImageTextToText`) and with vLLM."""
    state = full_state_dict(model, rank, world_size) if state is None else state
    if state is None:
        return
    auto = AutoModelForImageTextToText if has_vision_tower(model) else AutoModelForCausalLM
    with torch.device("meta"):
        plain = auto.from_config(copy.deepcopy(model.config), dtype=next(iter(state.values())).dtype)
    plain.load_state_dict(state, assign=True, strict=False)
    plain.tie_weights()
    missing = {name for name, p in plain.named_parameters() if p.is_meta}
    if missing:
        raise RuntimeError(f"export: no weights for {sorted(missing)}")
    with models.quiet_transformers():
        plain.save_pretrained(path)


def _check_same_tensors(path: Path, metadata: dict, model_state: dict) -> None:
    """CheckpointError when the checkpoint `path` (its dcp `metadata`) holds other tensors than `model_state`
    (another model, or another adapter): torch would load the ones they share and leave the rest as they are."""
    saved = {key.removeprefix("model."): tuple(getattr(entry, "size", ()))
             for key, entry in metadata.items() if key.startswith("model.")}
    here = {key: tuple(value.shape) for key, value in model_state.items()}
    missing, extra = sorted(set(here) - set(saved)), sorted(set(saved) - set(here))
    reshaped = [f"{key} {saved[key]} there, {here[key]} here" for key in sorted(set(saved) & set(here))
                if saved[key] != here[key]]
    found = [f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
             for names, what in ((missing, "tensors of this model are not in it"),
                                 (extra, "of its tensors are not in this model"),
                                 (reshaped, "have another shape"))
             if names]
    if found:
        raise CheckpointError(f"the checkpoint {path} holds another model's weights: {'; '.join(found)}. Restore it "
                              f"with the model (and the LoRA settings) it was saved with: its config.json names them")


def _saved_rank(path: Path, rank: int) -> int:
    """This rank's local state file, or rank 0's when the checkpoint was written by fewer ranks (every
    rank's scheduler is the same; RNG streams then continue from rank 0's)."""
    return rank if (path / f"rank{rank}.pt").is_file() else 0


@contextmanager
def _torch_io(action: str, path: Path):
    """Around torch's reading or writing of the checkpoint `path`: its errors are raised as one CheckpointError,
    and dcp's warning that it assumes a single process is silenced (one rank makes no process group)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"torch\.distributed is .*uninitialized")
            yield
    except (dcp.CheckpointException, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"cannot {action} the checkpoint {path}: {_first_cause(error)}") from error


def _first_cause(error: BaseException) -> str:
    """The type and first sentence of the error, or for dcp's CheckpointException of the lowest rank's error."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        error = error.failures[min(error.failures)][0]
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].split('. ')[0] if lines else ''}"


def _check_space(path: Path, needed: int, rank: int) -> None:
    """OSError (ENOSPC) on every rank when the disk holding `path` has less than `needed` bytes free. Rank 0
    measures and tells the others, so that all ranks agree and none is left waiting inside dcp.save."""
    measured = [(shutil.disk_usage(next(p for p in [path, *path.parents] if p.exists())).free, needed)
                if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(measured, src=0)
    free, needed = measured[0]
    if free < needed:
        raise OSError(errno.ENOSPC, f"not enough disk space to save the checkpoint {path}: {free / 2**20:.1f} MiB "
                                    f"free, the model's state needs about {needed / 2**20:.1f} MiB")


def _nbytes(tree) -> int:
    """The bytes of all tensors in nested dicts and lists (a sharded tensor counts whole: all ranks' shards)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_nbytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(value) for value in tree)
    return 0
