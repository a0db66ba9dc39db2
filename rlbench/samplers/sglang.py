"""The Sampler protocol on SGLang's offline engine (`sglang.Engine`): on a GPU, or on a CPU with its torch-native
attention (`make sglang-cpu` builds an environment for that; the README's "SGLang" section says what it holds).

The engine is SGLang's own: this process keeps its tokenizer-less front end, a scheduler process of its own runs
the model. That process is started with `spawn`, which re-imports the caller's `__main__`: a script needs an
`if __name__ == "__main__":` guard (pytest, notebooks and Ray actors need nothing). What SGLang changes in the
process that starts it is put back or contained: its start sets multiprocessing's start method to `spawn` (put back
once it has started), reads SGLANG_USE_CPU_ENGINE on a CPU (set while it starts) and sets some twenty environment
variables of its own (its processes inherit them; this process's environment is put back after); a scheduler that
fails to start sends SIGQUIT, on which SGLang's own handler would kill this process (a notebook's kernel, pytest):
here the start raises instead. While the engine runs, its event loop handles SIGTERM and SIGQUIT in this process (in
the main thread; SGLang's handlers, which end the process tree when a scheduler dies); `close()` removes them and
puts back the handlers there were, and ends the engine's own processes by their ids (SGLang's `shutdown` would
end every child of this process: a Ray instance or a reward worker this process started among them). On Ray the
sampler is a worker process of its own, where none of this reaches the session.

Log-probs: SGLang reports each sampled token's log-prob under the temperature-scaled distribution, before top-k /
top-p truncation (greedy: at temperature 1), what `HFSampler` reports and the policy recomputes. Seeds: each sample
is a request of its own with a seed of its own (`sampling_seed`), which SGLang honours under its deterministic
inference mode alone; on a GPU that mode is on, so a prompt's draws do not depend on the other prompts of the call.
On a CPU it is not available (SGLang has it for GPU attention backends only): draws there come from the scheduler's
generator and are not reproducible call by call.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import multiprocessing
import os
import signal
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from rlbench.batch import Batch
from rlbench.models.lora import LoRA, adapter_shapes, check_fits, saved_form
from rlbench.samplers.base import SamplingParams, checkpoint_names, completions, fit_checkpoint, max_positions, special_ids

CPU_KV_TOKENS = 16384
"""Tokens of KV cache of a CPU engine (all sequences together) when none is given."""
GPU_MEMORY_FRACTION = 0.5
"""Share of GPU memory a GPU engine takes for weights and KV cache (SGLang's mem_fraction_static)."""
MAX_MODEL_LEN = 4096
"""Longest prompt + completion when none is given (capped at the model's own limit)."""


def available() -> tuple[bool, str]:
    """(whether an SGLangSampler can run here, why), without importing SGLang (which takes seconds)."""
    if importlib.util.find_spec("sglang") is None:
        return False, ("SGLang is not installed in this environment (`make sglang-cpu` builds .venv-sglang with it on "
                       "a CPU; on a GPU: pip install sglang)")
    if importlib.util.find_spec("sgl_kernel") is None:
        return False, ("SGLang is installed without its kernel package (sgl_kernel, from sglang-kernel), which it "
                       "imports at start-up: CUDA builds on PyPI; on a CPU it is built from SGLang's sources")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return True, f"sglang {importlib.metadata.version('sglang')} on {device}"


class SGLangSampler:
    """A Sampler backed by an SGLang engine over a local Hugging Face model directory.

    - `dtype`: of the engine's weights; "float32" matches the policy's own forward.
    - `max_model_len`: longest prompt + completion (None: `MAX_MODEL_LEN`, capped at the model's limit).
    - `kv_tokens` (CPU): the KV cache's size in tokens (None: `CPU_KV_TOKENS`); on a GPU `gpu_memory_fraction` of
      its memory holds weights and cache (None: `GPU_MEMORY_FRACTION`).
    - `sleep_mode` (GPU): allow `sleep()` / `wake_up()` (SGLang's memory saver), so that a colocated policy gets the
      memory back.
    - `lora`: the policy trains this LoRA adapter; `load_weights` then takes the adapter alone (peft's live names),
      which SGLang loads from the tensors (`load_lora_adapter_from_tensors`) under a fresh name that every later
      `generate` names; the previous one is unloaded. Before the first, it samples the base model (what a fresh
      adapter, B = 0, computes).
    """

    def __init__(self, model_dir: str | os.PathLike, *, eos_token_id: int, pad_token_id: int,
                 stop_token_ids: Sequence[int] = (), dtype: str = "float32", max_model_len: int | None = None,
                 kv_tokens: int | None = None, gpu_memory_fraction: float | None = None, sleep_mode: bool = False,
                 lora: LoRA | None = None):
        usable, why = available()
        if not usable:
            raise RuntimeError(f"SGLangSampler cannot run here: {why}")
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if lora is not None and self.device == "cpu":
            raise ValueError("LoRA with the SGLang sampler needs a GPU: SGLang's adapter manager pins host memory, "
                             "which takes CUDA (use the HF sampler on a CPU)")
        self.pad_token_id = pad_token_id
        self.stop_token_ids = sorted({eos_token_id, *stop_token_ids})
        self.weight_names = checkpoint_names(Path(model_dir))
        self.model_dir, self.lora = str(model_dir), lora
        self.adapter_shapes = adapter_shapes(model_dir, lora) if lora is not None else None
        """Name -> shape of every tensor `load_weights` takes under LoRA (peft's live names)."""
        self.adapter: tuple[str, dict[str, torch.Tensor]] | None = None  # (its name in the engine, its tensors)
        self.sleep_mode, self.asleep = sleep_mode and self.device == "cuda", False
        limit = max_positions(Path(model_dir))
        on_cpu = self.device == "cpu"
        memory = (dict(max_total_tokens=kv_tokens or CPU_KV_TOKENS, attention_backend="torch_native",
                       sampling_backend="pytorch", disable_cuda_graph=True) if on_cpu
                  else dict(mem_fraction_static=gpu_memory_fraction or GPU_MEMORY_FRACTION))
        adapters = dict(enable_lora=True, max_lora_rank=lora.rank, max_loaded_loras=2, max_loras_per_batch=1,
                        lora_target_modules=sorted({name.split(".lora_")[0].rsplit(".", 1)[-1]
                                                    for name in self.adapter_shapes}),
                        **(dict(lora_backend="torch_native") if on_cpu else {})) if lora is not None else {}
        main = threading.current_thread() is threading.main_thread()  # (signal handlers are set there alone)
        self._handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGQUIT)} if main else {}
        try:
            with _engine_start(on_cpu):
                import sglang

                self.engine = sglang.Engine(
                    model_path=str(model_dir), device=self.device, dtype=dtype, skip_tokenizer_init=True,
                    random_seed=0, context_length=max_model_len or min(MAX_MODEL_LEN, limit or MAX_MODEL_LEN),
                    enable_deterministic_inference=not on_cpu,  # per-request seeds (`sampling_seed`; see the docstring)
                    enable_memory_saver=self.sleep_mode, log_level="error", custom_sigquit_handler=_scheduler_failed,
                    **memory, **adapters)
        except BaseException:
            for signum, handler in self._handlers.items():
                signal.signal(signum, handler)
            raise
        self._processes = list(self.engine.get_all_child_pids())

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, **settings) -> SGLangSampler:
        """A sampler over a local model directory, with the EOS and pad ids of its tokenizer."""
        return cls(model_dir, **special_ids(model_dir), **settings)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> Batch:
        self._check_open()
        self.wake_up()
        stops = sorted({*self.stop_token_ids, *params.stop_token_ids})
        seeds = list(params.seeds) if params.seeds is not None else torch.randint(
            2**62, (len(prompt_ids),), generator=torch.Generator().manual_seed(params.seed)).tolist()
        requests = [dict(temperature=0.0 if params.greedy else params.temperature,
                         top_p=1.0 if params.greedy else params.top_p,
                         top_k=-1 if params.greedy or not params.top_k else params.top_k,
                         max_new_tokens=params.max_new_tokens, stop_token_ids=stops,
                         sampling_seed=(seed + i) % 2**63)
                    for seed in seeds for i in range(params.n)]  # prompt-major: a prompt's n samples in a row
        inputs = [[int(t) for t in p] for p in prompt_ids for _ in range(params.n)]
        adapter = dict(lora_path=[self.adapter[0]] * len(inputs)) if self.adapter is not None else {}
        outputs = self.engine.generate(input_ids=inputs, sampling_params=requests, return_logprob=True,
                                       **adapter) if inputs else []
        return completions([o["output_ids"] for o in outputs],
                           [[logp for logp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outputs],
                           [o["meta_info"]["finish_reason"]["type"] == "stop" for o in outputs], self.pad_token_id)

    def load_weights(self, state_dict: dict[str, torch.Tensor | np.ndarray]) -> None:
        """Replace the engine's weights with a full state dict (tensors, or numpy arrays such as read-only views from
        Ray's object store), in place (`update_weights_from_tensor`): the engine keeps running, its prefix cache is
        emptied. Weights that do not fit the model, or that SGLang refuses, are a ValueError naming them. Under LoRA:
        the adapter's tensors alone, by peft's live names (`rlbench.models.lora.adapter_state`)."""
        self._check_open()
        self.wake_up()
        if self.lora is not None:
            return self._load_adapter(state_dict)
        # to the scheduler process through shared memory, which torch moves a tensor's storage into: a read-only
        # array (Ray's object store) is copied first
        named = [(name, torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value.contiguous())
                 for name, value in fit_checkpoint(state_dict, self.weight_names).items()]
        self.engine.begin_weight_update()
        try:
            done, message = self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=True)
        finally:
            self.engine.end_weight_update()
        if not done:
            raise ValueError(f"SGLang did not take the weights: {message}")

    def _load_adapter(self, adapter: dict[str, torch.Tensor | np.ndarray]) -> None:
        """Load the adapter under a fresh name, then unload the previous one."""
        tensors = {name: torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value.detach().cpu()
                   for name, value in adapter.items()}
        check_fits(tensors, self.adapter_shapes, self.lora)
        config, saved = saved_form(tensors, self.lora, self.model_dir)
        version = int(self.adapter[0].rsplit("-v", 1)[1]) + 1 if self.adapter else 1
        name = f"rlbench-v{version}"
        result = self.engine.load_lora_adapter_from_tensors(name, saved, config.to_dict())
        if not getattr(result, "success", False):
            raise ValueError(f"SGLang did not take the adapter: {getattr(result, 'error_message', result)}")
        previous, self.adapter = self.adapter, (name, tensors)
        if previous is not None:
            self.engine.unload_lora_adapter(previous[0])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Under LoRA, the adapter it samples with, by live name; without LoRA, or before the first adapter arrived,
        AttributeError: the engine's weights cannot be handed over."""
        if self.adapter is None:
            raise AttributeError("an SGLangSampler hands over its weights only under LoRA, once an adapter is loaded")
        return dict(self.adapter[1])

    def sleep(self, level: int = 1) -> None:
        """GPU (built with `sleep_mode=True`): free the KV cache and the weights' memory (SGLang keeps the weights in
        CPU memory), so that a policy on the same GPU can use it. `generate` and `load_weights` wake the engine. On a
        CPU: nothing."""
        self._check_open()
        if self.sleep_mode and not self.asleep:
            self.engine.release_memory_occupation()
            self.asleep = True

    def wake_up(self) -> None:
        """Undo `sleep`."""
        self._check_open()
        if self.asleep:
            self.engine.resume_memory_occupation()
            self.asleep = False

    def close(self) -> None:
        """End the engine's processes (by their ids) and put back the signal handling it changed (see the module
        docstring). Idempotent."""
        if getattr(self, "engine", None) is None:
            return
        _end(self._processes)
        for signum, handler in self._handlers.items():
            self.engine.loop.remove_signal_handler(signum)
            signal.signal(signum, handler)
        self.engine = None

    def _check_open(self) -> None:
        if self.engine is None:
            raise RuntimeError("this SGLangSampler is closed")


@contextlib.contextmanager
def _engine_start(on_cpu: bool):
    """SGLang's engine start, with SGLANG_USE_CPU_ENGINE=1 on a CPU (SGLang reads it at import and in the scheduler
    process it spawns); then the process's environment (SGLang's import and start set some twenty variables, which
    its processes have inherited), torch thread count, global RNG states and multiprocessing start method as they
    were before."""
    saved_env = dict(os.environ)
    saved = (torch.get_num_threads(), torch.random.get_rng_state(), np.random.get_state(),
             multiprocessing.get_start_method(allow_none=True))
    if on_cpu:
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    try:
        yield
    finally:
        threads, torch_rng, numpy_rng, start_method = saved
        multiprocessing.set_start_method(start_method, force=True)
        torch.set_num_threads(threads)
        torch.random.set_rng_state(torch_rng)
        np.random.set_state(numpy_rng)
        for name in set(os.environ) - set(saved_env):
            del os.environ[name]
        os.environ.update(saved_env)


def _scheduler_failed(signum, frame) -> None:
    """SIGQUIT from an engine's process that failed while the engine started: nothing here (the start then raises
    with the scheduler's exit code), where SGLang's own handler would kill this process."""


def _end(pids: list[int]) -> None:
    """Kill the engine's processes and theirs, and wait for them."""
    import psutil

    processes = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            parent = psutil.Process(pid)
            processes += [*parent.children(recursive=True), parent]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=30)
