"""LoRA adapters (Hu et al. 2021, arXiv:2106.09685) on the policy, through peft.

Each adapted linear layer computes `W x + s · B A x` with rank-r matrices A `[r, in]`, B `[out, r]` and
s = alpha / r; B starts at zero, so the adapted model starts as the base. Only A and B train and sit in the
optimizer. The base weights never change, which is what the rest of rlbench builds on:
- the reference policy is the policy with its adapter switched off (no second copy of the weights);
- a weight sync sends the adapter alone (`adapter_state`), the sampler applies it to its own copy of the base;
- a checkpoint holds the adapter and its optimizer state (the base is the model directory's);
- `export` writes the merged model (`merged_state`) or the adapter in peft's format (`save_adapter`).

Names: the policy's adapter tensors carry peft's live parameter names,
`base_model.model.<module>.lora_A.default.weight`; `module_pairs` groups them by layer, `delta` is what a layer's adapter adds to its weight.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from rlbench.models.vision import VISION_TOWER, has_vision_tower

_ADAPTER = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.default\.weight$")
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRA:
    """A LoRA adapter's shape: `rl.Session(..., lora=rl.LoRA(rank=16, alpha=32))`, or in a recipe
    `[lora]` with the same keys."""

    rank: int = 16
    """r: the adapter matrices' inner dimension."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank."""
    target_modules: str | tuple[str, ...] = "all-linear"
    """Which linear layers get an adapter: "all-linear" (every linear layer but the LM head: q, k, v, o, gate,
    up, down in a Qwen2 / Llama block), or the layers' names, e.g. ("q_proj", "v_proj")."""
    dropout: float = 0.0
    """Dropout on the adapter's input. Only 0: the trainer runs with dropout off so that its log-probs are the
    sampler's distribution (see `rl.policy.Policy`)."""

    def __post_init__(self):
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < math.inf:
            raise ValueError(f"LoRA alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":  # peft: a regex on full names
            raise ValueError(f"LoRA target_modules={self.target_modules!r}: a single layer name goes in a list, "
                             f"target_modules=[{self.target_modules!r}] (or 'all-linear')")
        if not (isinstance(self.target_modules, str) or (
                self.target_modules and all(isinstance(name, str) for name in self.target_modules))):
            raise ValueError(f"LoRA target_modules must be 'all-linear' or a list of layer names, got "
                             f"{self.target_modules!r}")
        if self.dropout != 0:
            raise ValueError(f"LoRA dropout={self.dropout!r}: only 0 is supported (the trainer runs with dropout off, "
                             f"so that its log-probs are the distribution the sampler drew from)")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, value) -> LoRA | None:
        """A LoRA from a LoRA, a dict of its fields (a recipe's `[lora]` table), or None (no adapter); a
        ValueError names an unknown key and the valid ones."""
        if value is None or isinstance(value, LoRA):
            return value
        if isinstance(value, dict):
            valid = [f.name for f in fields(cls)]
            unknown = sorted(set(value) - set(valid))
            if unknown:
                raise ValueError(f"lora: unknown key(s) {unknown}; valid: {', '.join(valid)}")
            return cls(**value)
        raise ValueError(f"lora: expected rl.LoRA(...), a table of its fields or None, got {value!r}")

    def to_dict(self) -> dict:
        record = asdict(self)
        if isinstance(self.target_modules, tuple):
            record["target_modules"] = list(self.target_modules)
        return record

    def peft_config(self):
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=self.dropout,
                          bias="none", task_type="CAUSAL_LM")


def wrap(model: torch.nn.Module, lora: LoRA, seed: int = 0) -> torch.nn.Module:
    """`model` with adapters added in place (a peft model around it): the base weights frozen, the adapters trainable,
    on the language model's layers only (a vision-language model's vision tower gets none: it stays as loaded),
    initialised as peft does, A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform with a = sqrt(5)) and B = 0, so the
    wrapped model computes exactly the base's outputs. A is drawn from `seed` (peft draws from torch's global
    generator, which is put back as it was: building a policy draws nothing from it)."""
    from peft import get_peft_model

    config = lora.peft_config()
    if has_vision_tower(model):  # the language model's layers only: the vision tower stays as loaded, frozen
        config.exclude_modules = rf"(.*\.)?{VISION_TOWER}\..*"
    with torch.random.fork_rng(devices=[]):
        model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name and not p.is_meta:  # (a model on the meta device only has shapes)
                bound = p.shape[1] ** -0.5
                p.copy_(torch.rand(p.shape, generator=generator, dtype=p.dtype) * (2 * bound) - bound)
    return model


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors (the trainable parameters) of an unsharded peft model, by live name; the
    tensors themselves (readers copy)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def module_pairs(adapter: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{module path: (A, B)}` from adapter tensors by live name (e.g. "model.layers.0.self_attn.q_proj"); a ValueError
    names a tensor that is not an adapter's, or a layer without both of its matrices."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapter.items():
        match = _ADAPTER.match(name)
        if match is None:
            raise ValueError(f"not a LoRA adapter tensor: {name!r} (expected "
                             f"base_model.model.<module>.lora_A|lora_B.default.weight)")
        pairs.setdefault(match["module"], {})[match["which"]] = torch.as_tensor(tensor)
    incomplete = sorted(module for module, ab in pairs.items() if len(ab) != 2)
    if incomplete:
        raise ValueError(f"LoRA adapter without both lora_A and lora_B for: {incomplete}")
    return {module: (ab["A"], ab["B"]) for module, ab in pairs.items()}


def delta(A: torch.Tensor, B: torch.Tensor, lora: LoRA) -> torch.Tensor:
    """What an adapter adds to its layer's weight, s · B A `[out, in]` (in fp32)."""
    return lora.scaling * (B.float() @ A.float())


def merged_state(state: dict[str, torch.Tensor], lora: LoRA) -> dict[str, torch.Tensor]:
    """A peft model's full state dict as the plain model's, with every adapter merged into its layer's weight
    (`W + s · B A`): what `export()` writes and what loads into a model without adapters."""
    adapter = {name: tensor for name, tensor in state.items() if _ADAPTER.match(name)}
    pairs = module_pairs(adapter)
    merged = {}
    for name, tensor in state.items():
        if name in adapter:
            continue
        plain = name.removeprefix(_PREFIX).replace(".base_layer.", ".")
        module = plain.rsplit(".", 1)[0]
        if plain.endswith(".weight") and module in pairs:
            tensor = (tensor.float() + delta(*pairs[module], lora)).to(tensor.dtype)
        merged[plain] = tensor
    return merged


def saved_form(adapter: dict[str, torch.Tensor], lora: LoRA, base_model: str | None = None):
    """(peft's `LoraConfig`, the tensors by peft's saved names, on CPU): an adapter as peft writes it, and as an engine
    that loads adapters (vLLM from a folder, SGLang from tensors) takes it."""
    config = lora.peft_config()
    config.base_model_name_or_path = base_model
    # peft resolves "all-linear" to the layers it adapted; the file lists them, as peft's own save does
    config.target_modules = sorted({_ADAPTER.match(name)["module"].rsplit(".", 1)[-1] for name in adapter})
    tensors = {name.replace(".default.weight", ".weight"): tensor.detach().to("cpu").contiguous()
               for name, tensor in adapter.items()}
    return config, tensors


def save_adapter(path: str | os.PathLike, adapter: dict[str, torch.Tensor], lora: LoRA,
                 base_model: str | None = None) -> None:
    """Write adapter tensors (by live name) as a peft adapter folder (`adapter_config.json`,
    `adapter_model.safetensors`): it loads with `peft.PeftModel.from_pretrained(base, path)` and with vLLM's
    `LoRARequest`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config, tensors = saved_form(adapter, lora, base_model)
    config.save_pretrained(str(path))
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})


def adapter_shapes(model_dir: str | os.PathLike, lora: LoRA) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the adapter tensors a policy trains on this model (peft's live names), from the model built on
    the meta device (no memory, no weights read)."""
    from transformers import AutoConfig

    from rlbench.models import causal_lm_class

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = wrap(causal_lm_class(model_dir).from_config(config), lora)
    return {name: tuple(tensor.shape) for name, tensor in adapter_state(model).items()}


def check_fits(adapter: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], lora: LoRA) -> None:
    """ValueError naming what of `adapter` does not fit an engine's adapter of `shapes` (`adapter_shapes`): missing and
    unexpected tensors, wrong shapes."""
    unexpected, missing = sorted(adapter.keys() - shapes.keys()), sorted(shapes.keys() - adapter.keys())
    wrong = sorted(f"{name} {tuple(adapter[name].shape)} (not {shape})"
                   for name, shape in shapes.items() if name in adapter and tuple(adapter[name].shape) != shape)
    if unexpected or missing or wrong:
        raise ValueError(f"adapter does not fit the sampler's {lora}: missing {missing}, unexpected {unexpected}, "
                         f"wrong shapes {wrong}")
