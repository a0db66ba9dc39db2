"""Training engine: the FSDP2 policy and the frozen reference model."""

from rlbench.policy.forward import batch_logp, micro_batches, response_logits, response_outputs, token_logp
from rlbench.policy.critic import Critic
from rlbench.policy.fsdp import Policy
from rlbench.policy.reference import Reference

__all__ = ["Critic", "Policy", "Reference", "batch_logp", "micro_batches", "response_logits", "response_outputs", "token_logp"]
