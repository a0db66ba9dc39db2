"""Samplers: the Sampler protocol and the transformers decode loop."""

from rlbench.samplers.base import Sampler, SamplingParams
from rlbench.samplers.hf import HFSampler, sample_next

__all__ = ["HFSampler", "Sampler", "SamplingParams", "sample_next"]
