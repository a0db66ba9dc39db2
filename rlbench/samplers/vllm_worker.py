"""The two pieces of the vLLM sampler that run inside vLLM's engine.

vLLM builds them itself from the names the sampler passes (`logits_processors=[...]`,
`worker_extension_cls="..."`), so this module imports vLLM; rlbench imports it only to build a
`VLLMSampler`.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.platforms import current_platform
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor


class TemperatureScaledLogprobs(LogitsProcessor):
    """Turns every sampled row's logits into its log-softmax, after temperature, before top-k / top-p.

    A shift per row: the distribution, its argmax and what top-k / top-p keep are unchanged. With the
    engine's `logprobs_mode="processed_logits"`, the value vLLM reports for a sampled token is then
    `log softmax(logits / T)[token]`: the full temperature-scaled log-prob that the policy recomputes.
    (`processed_logprobs` would renormalise over the tokens top-k / top-p kept; `raw_logprobs` ignores T.)
    vLLM applies argmax-invariant processors to sampled rows only, so greedy requests are sent as
    temperature 1 with top-k 1.
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(dim=-1)


class WeightLoader:
    """Mixed into vLLM's worker class: replace the model's weights while the engine runs."""

    def rlbench_load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a full state dict with checkpoint (Hugging Face) names.

        `reload_weights` rebuilds each layer from checkpoint-format tensors and repeats the loader's
        post-processing (plain `model.load_weights` fails after start-up on CPU, where linear weights are
        repacked). On CPU a tied LM head keeps a packed copy of the embedding that no checkpoint name
        reaches: repack every layer that kept its weight next to a packed copy.
        """
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        if current_platform.is_cpu():
            for module in self.model_runner.model.modules():
                if hasattr(module, "cpu_linear") and module.weight.numel() > 0:
                    dispatch_cpu_unquantized_gemm(module, remove_weight=False)
