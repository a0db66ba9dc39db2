"""The two pieces of the vLLM sampler that run inside vLLM's engine.

vLLM builds them itself from the names the sampler passes (`logits_processors=[...]`,
`worker_extension_cls="..."`), so this module imports vLLM; rlbench imports it only to build a
`VLLMSampler`.
"""

from __future__ import annotations

import contextlib

import torch
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from rlbench.models.vision import NEVER_LOGIT, never_sampled_ids


class TemperatureScaledLogprobs(LogitsProcessor):
    """Turns every sampled row's logits into its log-softmax, after temperature, before top-k / top-p.

    A shift per row: the distribution, its argmax and what top-k / top-p keep are unchanged. With the
    engine's `logprobs_mode="processed_logits"`, the value vLLM reports for a sampled token is then
    `log softmax(logits / T)[token]`: the full temperature-scaled log-prob that the policy recomputes.
    (`processed_logprobs` would renormalise over the tokens top-k / top-p kept; `raw_logprobs` ignores T.)
    vLLM applies argmax-invariant processors to sampled rows only, so greedy requests are sent as
    temperature 1 with top-k 1. For a vision-language model it also sets the tokens the policy never draws (its
    image markup, `rlbench.models.vision.never_sampled`) to `NEVER_LOGIT` first, as the HF sampler and the
    trainer do.
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        never = never_sampled_ids(vllm_config.model_config.hf_config)
        self.never = torch.tensor(never, dtype=torch.long, device=device) if never else None

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.never is not None:
            logits = logits.index_fill(-1, self.never, NEVER_LOGIT)
        return logits.log_softmax(dim=-1)


class WeightLoader:
    """Mixed into vLLM's worker class: replace the model's weights while the engine runs."""

    def rlbench_load_weights(self, weights: dict[str, torch.Tensor], packing_threads: int | None = None) -> None:
        """Load a full state dict with checkpoint (Hugging Face) names.

        `reload_weights` rebuilds each layer from checkpoint-format tensors and repeats the loader's
        post-processing (plain `model.load_weights` fails after start-up on CPU, where linear weights are
        repacked for oneDNN). Two things on CPU make a reload differ from a fresh start unless handled here:
        - The packed layout oneDNN picks depends on the torch thread count at packing time (on AVX2, a
          192-wide layer is packed in 16-wide blocks under 2 threads, 64-wide under 1), but vLLM keeps one
          oneDNN kernel per weight shape for the whole process, made for the layout of the first weight of
          that shape: a weight packed under another count is read in the wrong layout. So packing runs with
          `packing_threads` threads, the count of every packing in this process (None: as they are).
        - A tied LM head shares the embedding's weight but keeps its own packed copy, which no checkpoint
          name reaches: repack each layer whose weight is that of a repacked layer.
        """
        model = self.model_runner.model
        gemms = {module: module.cpu_linear for module in model.modules() if hasattr(module, "cpu_linear")}
        with _torch_threads(packing_threads):
            self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
            repacked = {id(module.weight) for module, gemm in gemms.items() if module.cpu_linear is not gemm}
            for module, gemm in gemms.items():
                if module.cpu_linear is gemm and id(module.weight) in repacked:
                    dispatch_cpu_unquantized_gemm(module, remove_weight=False)


    def rlbench_image_embeds(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The model's vision tower on pictures' pixels and grids (`rlbench.models.vision.Vision.encode`'s, the
        processor's normalised values: the engine is started with `mm_device_do_normalize=False`): one row of
        embeddings per merged patch, on CPU. (The grids go as a list, the type the towers' signatures name.)"""
        visual = self.model_runner.model.visual
        with torch.inference_mode():
            return visual(pixel_values.to(visual.dtype), grid_thw=grid_thw.tolist()).cpu()


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """Run with `threads` torch threads (None: as they are), then restore the count."""
    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
