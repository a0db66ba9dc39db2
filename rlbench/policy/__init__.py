"""Training engine: the FSDP2 policy and the frozen reference model."""

from rlbench.policy.forward import batch_logp, batch_outputs, micro_batches, response_logits, response_outputs
from rlbench.policy.critic import Critic
from rlbench.policy.fsdp import Policy
from rlbench.policy.reference import Reference

__all__ = ["Critic", "Policy", "Reference", "batch_logp", "batch_outputs", "micro_batches", "response_logits",
           "response_outputs"]
