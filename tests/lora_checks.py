"""LoRA adapters for the samplers' tests: a policy some steps into training, and the HF sampler on its merged
weights (what an engine holding the adapter must sample)."""

import copy

import torch

import rlbench as rl
from rlbench.samplers import HFSampler

LORA = rl.LoRA(rank=4, alpha=8)
"""The adapter of the LoRA tests: rank 4 (vLLM runs it under max_lora_rank 8)."""


def adapted(model, seed: int, scale: float = 0.2):
    """`model` (a copy) with LORA's adapters, lora_B drawn at random (seeded): a policy some steps into training."""
    peft_model = rl.models.lora.wrap(copy.deepcopy(model), LORA)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=generator))
    return peft_model.eval()


def merged_hf_sampler(model, tokenizer, peft_model) -> HFSampler:
    """The HF sampler on a plain copy of `model` holding `peft_model`'s merged weights."""
    plain = copy.deepcopy(model)
    plain.load_state_dict(rl.models.lora.merged_state(peft_model.state_dict(), LORA))
    return HFSampler(plain, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
