"""Samplers: the Sampler protocol, the transformers decode loop and the vLLM engine."""

from rlbench.samplers.base import Sampler, SamplingParams
from rlbench.samplers.hf import HFSampler, sample_next
from rlbench.samplers.vllm import VLLMSampler

__all__ = ["HFSampler", "Sampler", "SamplingParams", "VLLMSampler", "sample_next"]
