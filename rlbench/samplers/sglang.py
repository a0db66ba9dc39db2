"""The Sampler protocol on SGLang's offline engine (`sglang.Engine`): on a GPU, or on a CPU with its torch-native
attention (`make sglang-cpu` builds an environment for that; the README's "SGLang" section says what it holds).

The engine is SGLang's own: this process keeps its tokenizer-less front end, a scheduler process of its own runs
the model. That process is started with `spawn`, which re-imports the caller's `__main__`: a script needs an
`if __name__ == "__main__":` guard (pytest, notebooks and Ray actors need nothing). Starting the engine changes
what SGLang changes in its process (a SIGQUIT handler that ends the process when the scheduler dies, for as long as
the engine lives); on a CPU it reads SGLANG_USE_CPU_ENGINE, set while the engine starts and put back after.
`close()` ends the engine's own processes by their ids (SGLang's `shutdown` would end every child of this
process: a Ray instance or a reward worker this process started among them).

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
import os
import signal
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from rlbench.batch import Batch
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
    """

    def __init__(self, model_dir: str | os.PathLike, *, eos_token_id: int, pad_token_id: int,
                 stop_token_ids: Sequence[int] = (), dtype: str = "float32", max_model_len: int | None = None,
                 kv_tokens: int | None = None, gpu_memory_fraction: float | None = None, sleep_mode: bool = False):
        usable, why = available()
        if not usable:
            raise RuntimeError(f"SGLangSampler cannot run here: {why}")
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.pad_token_id = pad_token_id
        self.stop_token_ids = sorted({eos_token_id, *stop_token_ids})
        self.weight_names = checkpoint_names(Path(model_dir))
        self.sleep_mode, self.asleep = sleep_mode and self.device == "cuda", False
        limit = max_positions(Path(model_dir))
        on_cpu = self.device == "cpu"
        memory = (dict(max_total_tokens=kv_tokens or CPU_KV_TOKENS, attention_backend="torch_native",
                       sampling_backend="pytorch", disable_cuda_graph=True) if on_cpu
                  else dict(mem_fraction_static=gpu_memory_fraction or GPU_MEMORY_FRACTION))
        self._sigquit = signal.getsignal(signal.SIGQUIT)  # SGLang's own replaces it (see the module docstring)
        with _engine_start(on_cpu):
            import sglang

            self.engine = sglang.Engine(
                model_path=str(model_dir), device=self.device, dtype=dtype, skip_tokenizer_init=True, random_seed=0,
                context_length=max_model_len or min(MAX_MODEL_LEN, limit or MAX_MODEL_LEN),
                enable_deterministic_inference=not on_cpu,  # per-request seeds (`sampling_seed`; see the docstring)
                enable_memory_saver=self.sleep_mode, log_level="error", **memory)
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
        outputs = self.engine.generate(input_ids=inputs, sampling_params=requests, return_logprob=True) if inputs else []
        return completions([o["output_ids"] for o in outputs],
                           [[logp for logp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outputs],
                           [o["meta_info"]["finish_reason"]["type"] == "stop" for o in outputs], self.pad_token_id)

    def load_weights(self, state_dict: dict[str, torch.Tensor | np.ndarray]) -> None:
        """Replace the engine's weights with a full state dict (tensors, or numpy arrays such as read-only views from
        Ray's object store), in place (`update_weights_from_tensor`): the engine keeps running, its prefix cache is
        emptied. Weights that do not fit the model, or that SGLang refuses, are a ValueError naming them."""
        self._check_open()
        self.wake_up()
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
        """End the engine's processes (by their ids, see the module docstring) and put back the SIGQUIT handler it
        replaced. Idempotent."""
        if getattr(self, "engine", None) is None:
            return
        _end(self._processes)
        self.engine = None
        if threading.current_thread() is threading.main_thread():  # (signal handlers are set there alone)
            signal.signal(signal.SIGQUIT, self._sigquit)

    def _check_open(self) -> None:
        if self.engine is None:
            raise RuntimeError("this SGLangSampler is closed")


@contextlib.contextmanager
def _engine_start(on_cpu: bool):
    """SGLang's engine start, with SGLANG_USE_CPU_ENGINE=1 on a CPU (SGLang reads it at import and in the scheduler
    process it spawns) and the process's torch thread count and global RNG states as they were before."""
    saved_env = os.environ.get("SGLANG_USE_CPU_ENGINE")
    saved = (torch.get_num_threads(), torch.random.get_rng_state(), np.random.get_state())
    if on_cpu:
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    try:
        yield
    finally:
        threads, torch_rng, numpy_rng = saved
        torch.set_num_threads(threads)
        torch.random.set_rng_state(torch_rng)
        np.random.set_state(numpy_rng)
        if saved_env is None:
            os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
        else:
            os.environ["SGLANG_USE_CPU_ENGINE"] = saved_env


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
