"""The one flat configuration of a Session.

`rl.Session(**kwargs)` builds a `Config`; recipes (`algorithms/*.toml`) hold the same keys. Every batch
size says its unit in its name. `Config.check()` rejects nonsense before any work starts, naming the field.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlbench.models.lora import LoRA


@dataclass
class Config:
    model: str = "tiny-arith"
    """A built-in model name (`rl.models.names()`: tiny-arith, tiny-arith-small, tiny-mix, tiny-tools, tiny-arith-grpo) or
    a local Hugging Face model directory."""
    task: Any = "arithmetic"
    """A built-in task name (`rl.tasks.names()`) or any object following the `rl.tasks.Task` protocol."""
    algorithm: Any = "grpo"
    """A preset name (`rl.algorithms.names()`) or an `rl.algorithms.Algorithm`."""
    sampler: Any = "auto"
    """"hf" (transformers decode loop), "vllm", "sglang" (SGLang's engine; its context length is vllm_max_model_len's),
    "auto" (vLLM on a GPU where installed, else hf; the session's `s.sampler.choice` says which, `s.sampler.why` why),
    or a Sampler object (inline only)."""
    vllm: Any = None
    """The vLLM sampler's knobs together, `rl.VLLM(sleep=True, gpu_memory_utilization=0.5)`: the vllm_* fields
    below, which it sets (a recipe's [vllm] table is the same)."""
    vllm_kv_cache_bytes: int | None = None
    """vLLM sampler: KV cache size in bytes (None: rl.samplers.vllm.CPU_KV_CACHE_BYTES on CPU; on a GPU,
    what vllm_gpu_memory_utilization leaves after weights and activations)."""
    vllm_max_model_len: int | None = None
    """vLLM sampler: longest prompt + completion in tokens (None: max_prompt_tokens + max_new_tokens, or
    without max_prompt_tokens rl.samplers.vllm.MAX_MODEL_LEN capped at the model's limit)."""
    vllm_enforce_eager: bool | None = None
    """vLLM sampler: run without torch.compile / CUDA graphs (None: eager on CPU, graphs on a GPU)."""
    vllm_gpu_memory_utilization: float | None = None
    """vLLM sampler on a GPU, without vllm_kv_cache_bytes: the share of GPU memory it may take
    (None: rl.samplers.vllm.GPU_MEMORY_UTILIZATION)."""
    vllm_sleep: bool = False
    """vLLM sampler on a GPU shared with the policy: sleep during update() (KV cache freed, weights moved
    to CPU memory); loading the new weights wakes it."""
    cluster: Any = "inline"
    """"inline": every worker in this process (breakpoint() works anywhere); "ray": Ray actors on a private
    local Ray instance (or RAY_ADDRESS's cluster); `rl.Ray(address=...)` to join a given cluster."""
    world_size: int = 1
    """Number of ranks (processes) of the policy, sharded with FSDP2 (more than 1 needs Ray)."""
    tensor_parallel: int = 1
    """Ranks that split each transformer block's attention heads and MLP between them (Megatron-style tensor parallel
    on a 2-D device mesh, dense Qwen2 / Llama-family blocks), inside FSDP2: world_size / tensor_parallel data-parallel
    groups of tensor_parallel consecutive ranks, a group's ranks taking the same rows. The reference and a teacher
    split the same way; a critic (PPO) and LoRA are refused. 1: FSDP2 alone."""
    placement: str = "colocated"
    """Reference, teacher and critic ranks: "colocated" in the policy's rank processes, or "separate" worker groups
    (under LoRA the reference is always the policy's ranks with the adapter off)."""
    device: str = "auto"
    """"cpu" (gloo), "cuda" (NCCL; one GPU per policy rank and one for the sampler on Ray), or "auto"
    (cuda when available)."""
    cpus_per_worker: float = 1.0
    """Ray CPUs reserved per worker process (policy rank, sampler, reward scorer)."""
    seed: int = 0
    """Seeds model building, prompt order, sampling and dropout-free training; same seed, same run."""

    prompts_per_step: int = 16
    """Prompts drawn from the task per step."""
    samples_per_prompt: int = 8
    """Completions sampled per prompt (the group size of group-relative estimators)."""
    max_new_tokens: int = 16
    """Longest completion, in tokens; longer ones are cut and marked truncated."""
    temperature: float = 1.0
    """Sampling temperature of rollouts; log-probs of the policy are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass of rollouts (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling of rollouts (0 = off)."""

    lr: float = 1e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Gradient-norm clipping threshold (0 = off). A non-finite norm skips the optimizer step."""
    lr_schedule: str = "constant"
    """"constant", "linear" (to 0 at lr_decay_steps) or "cosine" (to 0 at lr_decay_steps), after warm-up."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    lr_decay_steps: int = 1000
    """Optimizer steps over which "linear" and "cosine" decay to 0."""
    critic_lr: float | None = None
    """Learning rate of the critic, when the algorithm has one (None = lr)."""
    mini_batches_per_step: int = 1
    """Optimizer steps per epoch over one step's batch (verl's train_batch / ppo_mini_batch)."""
    epochs_per_step: int = 1
    """Passes over one step's batch (PPO epochs)."""
    micro_batch_tokens: int = 4096
    """Most tokens in one forward/backward (rows x padded length; in the packed layout, each group's prompt once
    plus its rows' response tokens); gradients accumulate across them."""
    precision: str = "fp32"
    """"fp32", or "bf16": the policy's forwards and backwards under bfloat16 autocast (weights, gradients,
    AdamW state, log-probs and losses stay fp32) and the hf sampler's weights in bfloat16. Several times
    faster matmuls on CPUs with AMX / avx512_bf16 and on GPUs; the sampler then matches the trainer to
    ~1e-2 in log-prob, not 1e-5 (`sampler_mismatch_*` shows it)."""
    attention: str = "auto"
    """How the trainer's forwards (policy, reference, critic) attend over a micro-batch. "packed": each
    group's prompt and shared response prefixes once, under a dense rows x W x W mask (W: at least a group's
    prompt plus all its response tokens): the least compute for short responses, memory and time quadratic
    in W; needs the "eager" or "sdpa" attention implementation (flash attention would ignore the mask and
    is refused). "per_sample": each sample its own row, plain causal attention, no mask tensor: memory
    linear in the sequence length. "auto": "packed" where a cost estimate says it is the cheaper (prompts
    shared by many short responses) and its mask takes at most 64 MiB, else "per_sample"
    (`rlbench.policy.forward.packing_pays`)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the policy's backward instead of keeping them:
    activation memory of one block instead of all, for about a third more update compute. The same
    gradients."""
    logit_chunk_tokens: int | None = None
    """How many tokens the output head (the vocabulary projection), log-softmax and entropy take at a time in the
    policy's and reference's forwards. N: chunks of N tokens, each recomputed in the backward instead of kept, so
    that a micro-batch never holds its `tokens x vocabulary` logits (32k tokens of a 151k vocabulary: over 60 GB
    with their softmax and gradient; 4096-token chunks: 2.5 GB), for one more head matmul in the backward; the
    same numbers up to float rounding. 0: the whole micro-batch at once. None (auto): 4096 where a micro-batch's
    fp32 logits would take more than 1 GiB, else 0."""
    lora: Any = None
    """LoRA adapters on the policy (`rl.LoRA(rank=16, alpha=32, target_modules="all-linear")`, or a recipe's `[lora]`
    table of the same keys; None: every weight trains). Only the adapter trains and sits in the optimizer; the
    reference policy is the policy with the adapter off; weight syncs and checkpoints carry the adapter alone;
    `export()` writes the merged model or, with `adapter=True`, the adapter in peft's format (`rlbench/models/lora.py`)."""
    freeze_vision: bool = False
    """A vision-language policy's vision tower (Qwen2-VL's `visual`: patch embedding, blocks and the merger into the
    language model's space) stays as loaded: no gradient, not in the optimizer; the language model trains. Under
    LoRA the vision tower gets no adapter either way. ValueError for a model without a vision tower."""
    teacher: str | None = None
    """On-policy distillation: a frozen teacher that scores the policy's own samples (`teacher_logp` per token, and
    its top-k distribution when the algorithm has forward_kl_coef; at `temperature`, as the policy's log-probs are):
    a built-in model name or a local Hugging Face model directory whose tokenizer is the policy's (the first
    differing token is named otherwise). Placed like the reference (placement: in the policy's rank processes, or a
    worker group of its own); never trained nor kept in checkpoints. Algorithms "opd" and "grpo_opd" need one
    (`rlbench/algorithms/distill.py`); with any other it adds `teacher_logp` and the `teacher_kl` metric."""
    on_policy_old_logp: bool = False
    """Skip the separate `old_logp` forward of `advantage()`: the update uses its own detached log-probs as
    `old_logp` (the same numbers, since the weights that update are the ones that sampled: ratio exactly 1)
    and reports the sampler mismatch from that forward. Needs one epoch and one mini-batch per step, and an
    algorithm without rollout correction or KL in the reward (they read `old_logp` before the update); the
    batch then has no `old_logp` column."""
    rollout: Any = None
    """How sampling and training take turns: `rl.Sync()` (each step samples, then trains, with the same weights),
    `rl.Overlap()` (the next batch is sampled while this step's update runs), `rl.Async(max_staleness=1, workers=1)`
    (rollout workers sample continuously, taking new weights mid-generation), or a mode of your own (an
    `rl.RolloutMode`: `rlbench/session/sources.py`). None: the mode that `rollout_mode`, `max_staleness` and
    `rollout_workers` name, the flat form of the same settings (which a built-in mode sets)."""
    rollout_mode: str = "sync"
    """How sampling and training take turns (the flat form of `rollout`). "sync": each step samples, then trains, with the same weights.
    "overlap": `step()` samples (and scores) the next step's batch while this step's update runs, in a
    background thread (a second core, or the sampler's own worker on Ray): one step off-policy, each batch sampled
    by the weights before the previous update; its `old_logp` is the sampler's log-probs (PPO's old policy is the
    one that sampled; no forward needed), or with rollout correction the policy's own forward, the correction
    weights carrying the lag; the next batch is kept in checkpoints. "async": `rollout_workers` rollout workers
    sample continuously into a buffer of finished groups, taking new weights after every update in the middle of
    a generation (partial rollouts: `token_version` says which weights drew each token); `step()` trains on the
    oldest groups, none more than `max_staleness` updates old, waiting when sampling falls behind; rollout
    correction is on by default (`correction`); the buffer and the in-flight prompts are kept in checkpoints
    (`rlbench/session/async_buffer.py`). In both background modes, stage timings overlap and a step's metrics describe the
    batch it trained on."""
    max_staleness: int = 1
    """rollout_mode="async": the most policy updates (one per step, all its mini-batches) between the weights that
    drew a group's oldest token and the weights it trains (0: every token drawn by the weights it trains, sampled
    while the previous step ends). Sampling pauses when more groups would break it."""
    rollout_workers: int = 1
    """rollout_mode="async": rollout workers, each with its own sampler: a process each on Ray; inline, threads of
    this process, which share its GIL with the trainer (measured slower per step than sync on CPU: inline async is
    for stepping through and debugging, cluster="ray" for the speed)."""
    correction: Any = "auto"
    """Rollout correction (importance weights between the sampler's and the trainer's log-probs): "auto" = the
    algorithm's own, and in async mode token TIS when the algorithm has none; a registered name ("token_tis",
    "seq_tis", "icepop", "mis", "geo_reject": `rl.algorithms.names("correction")`) or an
    `rl.algorithms.RolloutCorrection` replaces the algorithm's; None (or "none") turns it off (overlap and async
    then take the sampler's log-probs as `old_logp`: PPO's ratio against the weights that sampled)."""
    overlap_rollout: bool = False
    """The former name of rollout_mode="overlap" (True sets it)."""
    eval_samples: int = 1
    """Sampled completions per held-out prompt in `evaluate()` (sampled accuracy averages them)."""
    threads: int = 0
    """Torch threads of this process's workers (0 = all cores, at most 2)."""
    log_dir: str | None = "runs"
    """Every step's metrics row is appended to LOG_DIR/RUN_NAME/metrics.jsonl (None = no file)."""
    run_name: str | None = None
    """Name of this run's folder under log_dir (None = time, algorithm and seed)."""
    tensorboard: bool = False
    """Also write every step's metrics as TensorBoard scalars to LOG_DIR/RUN_NAME/ (needs the tensorboard
    package: `pip install 'rlbench[tensorboard]'`)."""
    wandb_project: str | None = None
    """Also log every step's metrics to this Weights & Biases project, as a run named RUN_NAME (needs
    `pip install 'rlbench[wandb]'` and `wandb login`, or WANDB_MODE=offline); None = off."""
    save_every: int = 0
    """run() saves a checkpoint every this many steps (0 = never), into save_dir."""
    save_dir: str | None = None
    """Where run() and save() put checkpoints (None = LOG_DIR/RUN_NAME/checkpoints)."""
    keep_last: int = 3
    """Checkpoints kept in save_dir: older ones are deleted after each save (0 = keep all)."""
    max_skipped_updates: int = 10
    """A non-finite loss or gradient norm skips that optimizer step (the reason goes to
    `session.skipped_updates`); after this many skipped steps the session stops with an error."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens, as the session renders it (None = no limit); see long_prompts."""
    long_prompts: str = "error"
    """"error": stop at start-up naming the first too-long example; "drop": leave them out (counts in
    session.task.dropped)."""
    reward_runner: Any = None
    """The reward runner's knobs together, `rl.RewardRunner(workers=8, timeout_s=60, processes=True,
    on_error="zero")`: reward_workers, reward_timeout_s, reward_processes and on_reward_error below, which it sets
    (a recipe's [reward_runner] table is the same)."""
    reward_workers: int = 4
    """Samples the reward runner scores at once (threads, or processes with reward_processes)."""
    reward_timeout_s: float | None = 30.0
    """Time limit per sample (a batched reward: per call); a sample past it fails with "timed out". None = no limit."""
    reward_processes: bool = False
    """Score in forked processes (a hung reward is killed; CPU-bound rewards like math-verify run in parallel);
    not for rewards that run torch models."""
    on_reward_error: str = "raise"
    """What a failing reward does: "raise" stops the step naming the sample; "zero" scores it 0 and records why."""
    sandbox: str | None = None
    """The code sandbox's mode in the worker that runs model-written code (a task's reward, an agent's tools:
    `rl.rewards.run_python` without `mode=`): "namespaces", "bwrap", or "rlimits" (no kernel isolation, for code you
    trust: a machine without the other two runs code only after this opt-in); one of
    `rl.rewards.sandbox_info()["available"]`, checked at start-up. On Ray the worker gets it as RLBENCH_SANDBOX; inline
    it is this process, whose environment a session leaves alone: RLBENCH_SANDBOX must already say it. None: nothing
    set (RLBENCH_SANDBOX where the worker has it, else the strongest mode here; never "rlimits" unasked)."""

    def check(self) -> Config:
        """Raise ValueError for any value that cannot work, naming the field, the value and what the field
        accepts: a type other than its hint's (an int is a float here, a bool is not an int), a NaN or an
        infinity, a number out of range, an unknown name, or fields that do not fit together; return self."""
        for name, hint in typing.get_type_hints(Config).items():
            problem = mismatch(getattr(self, name), hint)
            if problem:
                raise ValueError(f"{name}: {problem}")
        self._check_numbers()
        self._check_names()
        self._check_together()
        return self

    @property
    def data_parallel(self) -> int:
        """The policy's data-parallel groups: world_size / tensor_parallel (each takes its own rows)."""
        return self.world_size // self.tensor_parallel

    def _check_numbers(self) -> None:
        """Each number finite and in its field's range (a None, where the hint allows it, passes)."""
        for name in ["world_size", "tensor_parallel", "prompts_per_step", "samples_per_prompt", "max_new_tokens",
                     "mini_batches_per_step", "epochs_per_step", "micro_batch_tokens", "eval_samples", "lr_decay_steps",
                     "reward_workers", "rollout_workers"]:
            self._require(name, lambda v: v > 0, "a positive integer")
        for name in ["lr_warmup_steps", "top_k", "threads", "save_every", "keep_last", "max_skipped_updates",
                     "max_staleness", "logit_chunk_tokens"]:
            self._require(name, lambda v: v >= 0, "an integer >= 0")
        for name in ["max_prompt_tokens", "vllm_kv_cache_bytes", "vllm_max_model_len"]:
            self._require(name, lambda v: v > 0, "an integer > 0 or None")
        self._require("seed", lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)")
        self._require("lr", lambda v: v > 0, "a finite float > 0")
        self._require("critic_lr", lambda v: v > 0, "a finite float > 0 (or None for lr)")
        self._require("cpus_per_worker", lambda v: v > 0, "a finite float > 0")
        self._require("reward_timeout_s", lambda v: v > 0, "a finite float > 0 or None (no limit)")
        for name in ["weight_decay", "grad_clip"]:
            self._require(name, lambda v: v >= 0, "a finite float >= 0")
        self._require("temperature", lambda v: v >= 0, "a finite float >= 0 (0 = greedy)")
        self._require("top_p", lambda v: 0 < v <= 1, "a float in (0, 1]")
        self._require("vllm_gpu_memory_utilization", lambda v: 0 < v <= 1, "a float in (0, 1] or None")
        self._require("betas", lambda v: all(0 <= b < 1 for b in v), "a pair of floats in [0, 1)")

    def _require(self, name: str, ok: Callable[[Any], bool], accepts: str) -> None:
        """The field's value is None, or finite (every element of a pair) and `ok`; else a ValueError."""
        value = getattr(self, name)
        numbers = value if isinstance(value, (list, tuple)) else [value]
        finite = all(not isinstance(n, float) or math.isfinite(n) for n in numbers)
        if value is not None and not (finite and ok(value)):
            raise ValueError(f"{name} must be {accepts}, got {value!r}")

    def _check_names(self) -> None:
        """Each name among its field's choices."""
        if not (type(self.cluster).__name__ == "Ray" or self.cluster in ("inline", "ray")):
            raise ValueError(f"cluster={self.cluster!r} is not one of: 'inline', 'ray', rl.Ray(address=...)")
        _choice("placement", self.placement, ["colocated", "separate"])
        _choice("precision", self.precision, ["fp32", "bf16"])
        _choice("attention", self.attention, ["auto", "packed", "per_sample"])
        _choice("device", self.device, ["auto", "cpu", "cuda"])
        _choice("lr_schedule", self.lr_schedule, ["constant", "linear", "cosine"])
        _choice("long_prompts", self.long_prompts, ["error", "drop"])
        _choice("on_reward_error", self.on_reward_error, ["raise", "zero"])
        _choice("rollout_mode", self.rollout_mode, ["sync", "overlap", "async"])
        _choice("sandbox", self.sandbox, [None, "namespaces", "bwrap", "rlimits"])
        if not (self.lora is None or isinstance(self.lora, LoRA)):
            raise ValueError(f"lora={self.lora!r} is not rl.LoRA(...) or None (a table of its fields becomes one "
                             f"through rl.Session / make_config)")
        from rlbench.algorithms import RolloutCorrection, names  # the registry: names registered by the user too

        valid = ["auto", "none", *names("correction")]
        if not (self.correction is None or isinstance(self.correction, RolloutCorrection) or self.correction in valid):
            raise ValueError(f"correction={self.correction!r} is not one of: {', '.join(map(repr, valid))}, None or an "
                             f"rl.algorithms.RolloutCorrection")

    def _check_together(self) -> None:
        """Fields that each pass on their own but not together."""
        if self.save_every and self.save_dir is None and self.log_dir is None:
            raise ValueError("save_every needs a place for checkpoints: set save_dir (or log_dir)")
        if self.tensorboard and self.log_dir is None:
            raise ValueError("tensorboard=True writes its event files under log_dir: set log_dir")
        if self.cluster == "inline" and self.world_size > 1:
            raise ValueError(f"world_size={self.world_size} needs cluster='ray' (inline runs one rank)")
        longest = (self.max_prompt_tokens or 1) + self.max_new_tokens
        if self.micro_batch_tokens < longest:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens} cannot hold one sequence of up to {longest} "
                             f"tokens (max_prompt_tokens + max_new_tokens): raise it to at least {longest}")
        if self.world_size % self.tensor_parallel:
            raise ValueError(f"tensor_parallel={self.tensor_parallel} does not divide world_size={self.world_size}: the "
                             f"ranks form world_size / tensor_parallel groups of tensor_parallel ranks")
        if self.tensor_parallel > 1 and self.lora is not None:
            raise ValueError(f"tensor_parallel={self.tensor_parallel} with lora: the adapters wrap the projections that "
                             f"tensor parallel splits; use one of them")
        rows = self.prompts_per_step * self.samples_per_prompt
        if rows // self.mini_batches_per_step < self.data_parallel:
            raise ValueError(f"a mini-batch of {rows // self.mini_batches_per_step} samples cannot be split across "
                             f"{ranks_phrase(self)}: raise prompts_per_step or samples_per_prompt")
        if self.on_policy_old_logp and (self.epochs_per_step > 1 or self.mini_batches_per_step > 1):
            raise ValueError("on_policy_old_logp needs epochs_per_step=1 and mini_batches_per_step=1: later "
                             "optimizer steps of a batch are off-policy and need the recorded old_logp")
        if self.on_policy_old_logp and self.rollout_mode != "sync":
            raise ValueError(f"on_policy_old_logp needs on-policy batches, and rollout_mode={self.rollout_mode!r} trains "
                             f"on batches sampled by older weights: drop on_policy_old_logp")
        if self.overlap_rollout and self.rollout_mode != "overlap":
            raise ValueError(f"overlap_rollout=True is rollout_mode='overlap', not {self.rollout_mode!r}: set only "
                             f"rollout_mode")
        if self.rollout_mode != "async":
            for name, default in (("rollout_workers", 1), ("max_staleness", 1)):
                if getattr(self, name) != default:
                    raise ValueError(f"{name}={getattr(self, name)} applies to rollout_mode='async' only (this "
                                     f"session's is {self.rollout_mode!r})")
        if self.rollout_mode == "async" and self.vllm_sleep:
            raise ValueError("vllm_sleep frees a GPU the sampler shares with the policy between steps; "
                             "rollout_mode='async' samples during the update: drop one of them")
        if rows % self.mini_batches_per_step:
            raise ValueError(
                f"mini_batches_per_step={self.mini_batches_per_step} does not divide the step's "
                f"{rows} samples (prompts_per_step x samples_per_prompt)"
            )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_record(self) -> dict:
        """The fields as JSON values (what a checkpoint keeps); a Python object given for a field (a Task,
        an Algorithm, a Sampler, rl.Ray) cannot be kept and becomes {"python_object": its repr}."""
        def plain(value):
            if value is None or isinstance(value, (bool, int, float, str)):
                return value
            if isinstance(value, LoRA):
                return value.to_dict()
            if hasattr(value, "to_record"):  # a rollout mode: a built-in one is None (its flat fields say it)
                return value.to_record()
            if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
                return list(value)
            return {"python_object": repr(value)}
        return {name: plain(value) for name, value in self.to_dict().items()}

    @classmethod
    def from_record(cls, record: dict, **overrides) -> Config:
        """A checked Config from `to_record()`'s output and replacement values; a field that was a Python
        object must be among `overrides` (ValueError naming it otherwise)."""
        unknown = sorted(set(overrides) - set(cls.fields()))
        if unknown:
            raise TypeError(f"unknown Session argument(s) {unknown}; valid: {', '.join(cls.fields())}")
        values = {k: v for k, v in record.items() if k in cls.fields()} | overrides
        lost = {k: v["python_object"] for k, v in values.items() if isinstance(v, dict) and "python_object" in v}
        if lost:
            raise ValueError("these fields were Python objects, which a checkpoint cannot hold; pass them again, "
                             "e.g. Session.restore(path, name=...): "
                             + "; ".join(f"{k} (was {v})" for k, v in lost.items()))
        if "overlap_rollout" in overrides and "rollout_mode" not in overrides:  # the former name decides
            values["rollout_mode"] = "overlap" if overrides["overlap_rollout"] else (
                "sync" if values.get("rollout_mode") == "overlap" else values.get("rollout_mode", "sync"))
        if "rollout_mode" in overrides and "overlap_rollout" not in overrides:
            values["overlap_rollout"] = overrides["rollout_mode"] == "overlap"
        defaults = cls()
        values = {k: tuple(v) if isinstance(getattr(defaults, k), tuple) else v for k, v in values.items()}
        return make_config(**values)

    @classmethod
    def fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def signature(cls, init) -> inspect.Signature:
        """The signature of `init(self, config=None, **overrides)` with every field as a keyword-only parameter
        (its type and default), for `help()`, tab completion and IDEs."""
        hints = typing.get_type_hints(cls)
        fields = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
                  for f in dataclasses.fields(cls)]
        first = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ("self", "config")]
        return inspect.Signature([first[0], first[1].replace(default=None, annotation=cls | None), *fields])

    @classmethod
    def describe(cls) -> str:
        """Every field, its default and its docstring, as text."""
        docs = cls.docs()
        return "\n".join(f"{f.name} = {f.default!r}\n    {' '.join(docs[f.name].split())}" for f in dataclasses.fields(cls))

    @classmethod
    def docs(cls) -> dict[str, str]:
        """{field: its docstring}, in field order: the string literal under each field in the class body
        (Python keeps no such docstring at run time, so it is read from the source)."""
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        found = {}
        for statement, following in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
                found[statement.target.id] = inspect.cleandoc(following.value.value)
        return {name: found.get(name, "") for name in cls.fields()}


class Group:
    """The knobs of one part, given together (`rl.VLLM(sleep=True)`): each is a flat Config field (`KNOBS`: knob ->
    field), which keeps its default, its check and its docstring; a group holds only the knobs it was given, and
    `settings()` are those as flat fields."""

    KNOBS: dict[str, str] = {}

    def __init__(self, **knobs):
        unknown = sorted(set(knobs) - set(self.KNOBS))
        if unknown:
            raise TypeError(f"rl.{type(self).__name__} has no knob(s) {unknown}; its knobs: {', '.join(self.KNOBS)}")
        self.knobs = knobs

    def settings(self) -> dict:
        return {self.KNOBS[name]: value for name, value in self.knobs.items()}

    def to_record(self):  # a checkpoint keeps the flat fields it set
        return None

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.knobs == self.knobs

    def __repr__(self) -> str:
        return f"rl.{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.knobs.items())})"

    def __init_subclass__(cls):
        """The signature (each knob keyword-only, with its field's type and default) and the docstring (each
        knob's field docstring) come from the Config fields, for `help()` and tab completion."""
        hints, defaults, docs = typing.get_type_hints(Config), Config(), Config.docs()
        cls.__signature__ = inspect.Signature([
            inspect.Parameter(knob, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, field),
                              annotation=hints[field]) for knob, field in cls.KNOBS.items()])
        cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + "\n\n" + "\n".join(
            f"{knob} ({field}): {' '.join(docs[field].split())}" for knob, field in cls.KNOBS.items())


class VLLM(Group):
    """The vLLM sampler's knobs: `rl.Session(sampler="vllm", vllm=rl.VLLM(sleep=True))`."""

    KNOBS = {name: f"vllm_{name}" for name in ("kv_cache_bytes", "max_model_len", "enforce_eager",
                                               "gpu_memory_utilization", "sleep")}


class RewardRunner(Group):
    """The reward runner's knobs (how a task's reward is run over a batch): `rl.RewardRunner(workers=8)`."""

    KNOBS = {"workers": "reward_workers", "timeout_s": "reward_timeout_s", "processes": "reward_processes",
             "on_error": "on_reward_error"}


GROUPS: dict[str, type[Group]] = {"vllm": VLLM, "reward_runner": RewardRunner}
"""The Config fields that take a group of knobs (or a recipe's table of them)."""


def grouped_keywords(keywords: dict) -> str | None:
    """What to say when knobs that a group holds now are given by their flat names (None: none are)."""
    forms = {}
    for name, kind in GROUPS.items():
        knobs = {knob: keywords[field] for knob, field in kind.KNOBS.items() if field in keywords}
        if knobs:
            forms[name] = kind(**knobs)
    if not forms:
        return None
    flat = [field for kind in GROUPS.values() for field in kind.KNOBS.values() if field in keywords]
    return (f"{', '.join(flat)}: these knobs are set together now, "
            f"{', '.join(f'{name}={group!r}' for name, group in forms.items())} here; the flat keywords still work, "
            f"for a while")


def ranks_phrase(cfg: Config) -> str:
    """The policy's ranks that each take their own rows, as an error message names them: "world_size=4 ranks", or
    under tensor parallel "the 2 data-parallel groups of world_size=4, tensor_parallel=2"."""
    if cfg.tensor_parallel == 1:
        return f"world_size={cfg.world_size} ranks"
    return f"the {cfg.data_parallel} data-parallel groups of world_size={cfg.world_size}, tensor_parallel={cfg.tensor_parallel}"


def _choice(name: str, value, valid: list[str]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not one of: {', '.join(map(repr, valid))}")


def make_config(**kwargs) -> Config:
    """A checked Config from keyword arguments; unknown keys are named with the valid ones (TypeError), a
    value that cannot work with its field (ValueError, from `Config.check`)."""
    unknown = sorted(set(kwargs) - set(Config.fields()))
    if unknown:
        raise TypeError(f"unknown Session argument(s) {unknown}; valid: {', '.join(Config.fields())}")
    paths = {k: os.fspath(v) for k, v in kwargs.items() if isinstance(v, os.PathLike)}  # model, teacher, log_dir, save_dir
    if kwargs.get("overlap_rollout") and "rollout_mode" not in kwargs:  # the former name
        paths["rollout_mode"] = "overlap"
    if kwargs.get("rollout_mode") == "overlap":
        paths["overlap_rollout"] = True
    if kwargs.get("lora") is not None:  # a recipe's [lora] table, or a checkpoint's record of it
        paths["lora"] = LoRA.of(kwargs["lora"])
    if kwargs.get("rollout") is not None:  # a rollout mode sets the flat fields it stands for
        if not callable(getattr(kwargs["rollout"], "settings", None)):
            raise ValueError(f"rollout={kwargs['rollout']!r} is not a rollout mode: rl.Sync(), rl.Overlap(), "
                             f"rl.Async(max_staleness=..., workers=...) or an rl.RolloutMode of your own")
        flat = kwargs["rollout"].settings()
        given = {k: kwargs[k] for k in flat if k in kwargs and kwargs[k] != flat[k]}
        if given:
            raise ValueError(f"rollout={kwargs['rollout']!r} and {', '.join(f'{k}={v!r}' for k, v in given.items())} "
                             f"disagree: set the mode with rollout= alone")
        paths |= flat | {"overlap_rollout": flat["rollout_mode"] == "overlap"}
    for name, kind in GROUPS.items():  # a group (or a recipe's table) sets the flat fields it stands for
        if kwargs.get(name) is None:
            continue
        group = paths[name] = kind(**kwargs[name]) if isinstance(kwargs[name], dict) else kwargs[name]
        if not isinstance(group, kind):
            raise ValueError(f"{name}={group!r} is not an rl.{kind.__name__}(...) (or a table of its knobs)")
        given = {k: kwargs[k] for k, v in group.settings().items() if k in kwargs and kwargs[k] != v}
        if given:
            raise ValueError(f"{name}={group!r} and {', '.join(f'{k}={v!r}' for k, v in given.items())} disagree: "
                             f"set them in {name}= alone")
        paths |= group.settings()
    return Config(**kwargs | paths).check()


def mismatch(value, hint) -> str | None:
    """None where `value` fits the type hint; otherwise what was expected and what was given, e.g.
    "expected float, got 'fast' (str)"."""
    if conforms(value, hint):
        return None
    return f"expected {type_name(hint)}, got {value!r} ({type(value).__name__})"


def conforms(value, hint) -> bool:
    """Whether a plain value (a Python or TOML value) fits a type hint: an int fits float, a bool fits no
    number, a list fits a tuple of its length, a dict a mapping, and a callable is given by its registered
    name (the form a TOML file can hold)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, h) for h in args)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is tuple:
        return isinstance(value, (list, tuple)) and len(value) == len(args) and all(map(conforms, value, args))
    if hint in (dict, Mapping) or origin in (dict, Mapping):
        return isinstance(value, dict)
    if hint is Callable or origin is Callable:
        return isinstance(value, str)
    return isinstance(hint, type) and isinstance(value, hint)


def type_name(hint) -> str:
    """A type hint as an error message names it: "float", "str or none", "tuple[float, float]", "a table"."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(type_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "none"
    if hint is Callable or typing.get_origin(hint) is Callable:
        return "a registered name (str)"
    if hint in (dict, Mapping) or typing.get_origin(hint) in (dict, Mapping):
        return "a table"
    return getattr(hint, "__name__", str(hint)) if typing.get_origin(hint) is None else str(hint)
