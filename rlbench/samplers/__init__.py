"""Samplers: the Sampler protocol, the transformers decode loop, the vLLM and SGLang engines, partial rollouts (an async
run's rollout worker), a paced one (the sampler-bound regime at toy size), a scripted replay for tests."""

from rlbench.samplers.base import Sampler, SamplingParams
from rlbench.samplers.hf import HFSampler, sample_next
from rlbench.samplers.paced import Paced
from rlbench.samplers.partial import PartialRollouts
from rlbench.samplers.scripted import ScriptedSampler
from rlbench.samplers.sglang import SGLangSampler
from rlbench.samplers.vllm import VLLMSampler

__all__ = ["HFSampler", "Paced", "PartialRollouts", "Sampler", "SamplingParams", "SGLangSampler", "ScriptedSampler", "VLLMSampler", "sample_next"]
