"""Config.check(): every field rejects a wrong type, a NaN or infinity and an out-of-range value, naming the
field, the value and what it accepts; the table below has rows for every field (a new field needs its own)."""

import inspect
import math
import typing

import pytest

import rlbench as rl
from rlbench.config import Config, conforms, grouped_keywords, make_config

nan, inf = math.nan, math.inf

BAD = [  # (field, value, the start of the error)
    ("model", 123, "model: expected str, got 123 (int)"),
    ("vllm_kv_cache_bytes", 0, "vllm_kv_cache_bytes must be an integer > 0 or None, got 0"),
    ("vllm_kv_cache_bytes", 1.5e9, "vllm_kv_cache_bytes: expected int or none, got 1500000000.0 (float)"),
    ("vllm_max_model_len", -1, "vllm_max_model_len must be an integer > 0 or None, got -1"),
    ("vllm_max_model_len", "512", "vllm_max_model_len: expected int or none, got '512' (str)"),
    ("vllm_enforce_eager", 1, "vllm_enforce_eager: expected bool or none, got 1 (int)"),
    ("vllm_gpu_memory_utilization", 1.5, "vllm_gpu_memory_utilization must be a float in (0, 1] or None, got 1.5"),
    ("vllm_gpu_memory_utilization", nan, "vllm_gpu_memory_utilization must be a float in (0, 1] or None, got nan"),
    ("vllm_gpu_memory_utilization", "0.9", "vllm_gpu_memory_utilization: expected float or none, got '0.9' (str)"),
    ("vllm_sleep", None, "vllm_sleep: expected bool, got None (NoneType)"),
    ("cluster", "slurm", "cluster='slurm' is not one of: 'inline', 'ray', rl.Ray(address=...)"),
    ("world_size", 0, "world_size must be a positive integer, got 0"),
    ("world_size", True, "world_size: expected int, got True (bool)"),  # a bool is not an int here
    ("world_size", 2, "world_size=2 needs cluster='ray'"),
    ("tensor_parallel", 0, "tensor_parallel must be a positive integer, got 0"),
    ("tensor_parallel", 2.0, "tensor_parallel: expected int, got 2.0 (float)"),
    ("tensor_parallel", 2, "tensor_parallel=2 does not divide world_size=1"),
    ("placement", "spread", "placement='spread' is not one of: 'colocated', 'separate'"),
    ("placement", None, "placement: expected str, got None (NoneType)"),
    ("device", "tpu", "device='tpu' is not one of: 'auto', 'cpu', 'cuda'"),
    ("device", None, "device: expected str, got None (NoneType)"),
    ("cpus_per_worker", 0, "cpus_per_worker must be a finite float > 0, got 0"),
    ("cpus_per_worker", inf, "cpus_per_worker must be a finite float > 0, got inf"),
    ("cpus_per_worker", "1", "cpus_per_worker: expected float, got '1' (str)"),
    ("seed", 1.5, "seed: expected int, got 1.5 (float)"),
    ("seed", "x", "seed: expected int, got 'x' (str)"),
    ("seed", -1, "seed must be an integer in [0, 2**63), got -1"),
    ("seed", 2**63, "seed must be an integer in [0, 2**63), got 9223372036854775808"),
    ("prompts_per_step", 0, "prompts_per_step must be a positive integer, got 0"),
    ("prompts_per_step", 2.5, "prompts_per_step: expected int, got 2.5 (float)"),
    ("samples_per_prompt", -4, "samples_per_prompt must be a positive integer, got -4"),
    ("samples_per_prompt", "8", "samples_per_prompt: expected int, got '8' (str)"),
    ("max_new_tokens", -1, "max_new_tokens must be a positive integer, got -1"),
    ("max_new_tokens", 16.0, "max_new_tokens: expected int, got 16.0 (float)"),
    ("temperature", -0.1, "temperature must be a finite float >= 0 (0 = greedy), got -0.1"),
    ("temperature", nan, "temperature must be a finite float >= 0 (0 = greedy), got nan"),
    ("temperature", "hot", "temperature: expected float, got 'hot' (str)"),
    ("top_p", 0.0, "top_p must be a float in (0, 1], got 0.0"),
    ("top_p", nan, "top_p must be a float in (0, 1], got nan"),
    ("top_p", None, "top_p: expected float, got None (NoneType)"),
    ("top_k", -1, "top_k must be an integer >= 0, got -1"),
    ("top_k", 5.0, "top_k: expected int, got 5.0 (float)"),
    ("lr", 0, "lr must be a finite float > 0, got 0"),
    ("lr", inf, "lr must be a finite float > 0, got inf"),
    ("lr", -inf, "lr must be a finite float > 0, got -inf"),
    ("lr", nan, "lr must be a finite float > 0, got nan"),
    ("lr", "abc", "lr: expected float, got 'abc' (str)"),
    ("weight_decay", -0.1, "weight_decay must be a finite float >= 0, got -0.1"),
    ("weight_decay", inf, "weight_decay must be a finite float >= 0, got inf"),
    ("weight_decay", None, "weight_decay: expected float, got None (NoneType)"),
    ("betas", 0.9, "betas: expected tuple[float, float], got 0.9 (float)"),
    ("betas", (0.9,), "betas: expected tuple[float, float], got (0.9,) (tuple)"),
    ("betas", (0.9, 1.0), "betas must be a pair of floats in [0, 1), got (0.9, 1.0)"),
    ("betas", (nan, 0.999), "betas must be a pair of floats in [0, 1), got (nan, 0.999)"),
    ("grad_clip", nan, "grad_clip must be a finite float >= 0, got nan"),  # nan > 0 is false: clipping was off
    ("grad_clip", -1.0, "grad_clip must be a finite float >= 0, got -1.0"),
    ("grad_clip", True, "grad_clip: expected float, got True (bool)"),
    ("lr_schedule", "cos", "lr_schedule='cos' is not one of: 'constant', 'linear', 'cosine'"),
    ("lr_schedule", None, "lr_schedule: expected str, got None (NoneType)"),
    ("lr_warmup_steps", -1, "lr_warmup_steps must be an integer >= 0, got -1"),
    ("lr_warmup_steps", 0.5, "lr_warmup_steps: expected int, got 0.5 (float)"),
    ("lr_decay_steps", 0, "lr_decay_steps must be a positive integer, got 0"),
    ("lr_decay_steps", "1000", "lr_decay_steps: expected int, got '1000' (str)"),
    ("critic_lr", 0.0, "critic_lr must be a finite float > 0 (or None for lr), got 0.0"),
    ("critic_lr", inf, "critic_lr must be a finite float > 0 (or None for lr), got inf"),
    ("critic_lr", "x", "critic_lr: expected float or none, got 'x' (str)"),
    ("mini_batches_per_step", 0, "mini_batches_per_step must be a positive integer, got 0"),
    ("mini_batches_per_step", 1.0, "mini_batches_per_step: expected int, got 1.0 (float)"),
    ("mini_batches_per_step", 3, "mini_batches_per_step=3 does not divide the step's 128 samples"),
    ("epochs_per_step", 0, "epochs_per_step must be a positive integer, got 0"),
    ("epochs_per_step", 2.0, "epochs_per_step: expected int, got 2.0 (float)"),
    ("micro_batch_tokens", 0, "micro_batch_tokens must be a positive integer, got 0"),
    ("micro_batch_tokens", 8, "micro_batch_tokens=8 cannot hold one sequence of up to 17 tokens"),
    ("micro_batch_tokens", 4096.0, "micro_batch_tokens: expected int, got 4096.0 (float)"),
    ("precision", "fp16", "precision='fp16' is not one of: 'fp32', 'bf16'"),
    ("precision", 16, "precision: expected str, got 16 (int)"),
    ("attention", "flash", "attention='flash' is not one of: 'auto', 'packed', 'per_sample'"),
    ("attention", None, "attention: expected str, got None (NoneType)"),
    ("activation_checkpointing", 1, "activation_checkpointing: expected bool, got 1 (int)"),
    ("freeze_vision", "yes", "freeze_vision: expected bool, got 'yes' (str)"),
    ("logit_chunk_tokens", -1, "logit_chunk_tokens must be an integer >= 0, got -1"),
    ("logit_chunk_tokens", 4096.0, "logit_chunk_tokens: expected int or none, got 4096.0 (float)"),
    ("teacher", 3, "teacher: expected str or none, got 3 (int)"),
    ("lora", 16, "lora: expected rl.LoRA(...), a table of its fields or None, got 16"),
    ("lora", {"rank": 0}, "LoRA rank must be a positive integer, got 0"),
    ("lora", {"alpha": inf}, "LoRA alpha must be a finite number > 0, got inf"),  # every loss NaN, every step skipped
    ("lora", {"target_modules": "q_proj"}, "LoRA target_modules='q_proj': a single layer name goes in a list, "
                                           "target_modules=['q_proj']"),  # peft reads a string as a regex
    ("on_policy_old_logp", 1, "on_policy_old_logp: expected bool, got 1 (int)"),
    ("overlap_rollout", "no", "overlap_rollout: expected bool, got 'no' (str)"),
    ("rollout", "async", "rollout='async' is not a rollout mode: rl.Sync(), rl.Overlap(), rl.Async(max_staleness=..., "
                         "workers=...) or an rl.RolloutMode of your own"),
    ("rollout", rl.Async(max_staleness=-1), "max_staleness must be an integer >= 0, got -1"),
    ("vllm", "fast", "vllm='fast' is not an rl.VLLM(...) (or a table of its knobs)"),
    ("vllm", rl.VLLM(sleep=True, gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization must be a float in (0, 1]"),
    ("reward_runner", rl.VLLM(sleep=True), "reward_runner=rl.VLLM(sleep=True) is not an rl.RewardRunner(...)"),
    ("reward_runner", {"workers": 0}, "reward_workers must be a positive integer, got 0"),
    ("rollout_mode", "asynch", "rollout_mode='asynch' is not one of: 'sync', 'overlap', 'async'"),
    ("rollout_mode", None, "rollout_mode: expected str, got None (NoneType)"),
    ("max_staleness", -1, "max_staleness must be an integer >= 0, got -1"),
    ("max_staleness", 1.5, "max_staleness: expected int, got 1.5 (float)"),
    ("rollout_workers", 0, "rollout_workers must be a positive integer, got 0"),
    ("rollout_workers", 2.0, "rollout_workers: expected int, got 2.0 (float)"),
    ("correction", "tis", "correction='tis' is not one of: 'auto', 'none', 'geo_reject', 'icepop', 'mis', 'seq_tis', "
                          "'token_tis', None or an rl.algorithms.RolloutCorrection"),
    ("correction", 3, "correction=3 is not one of: 'auto', 'none', "),
    ("eval_samples", 0, "eval_samples must be a positive integer, got 0"),
    ("eval_samples", 1.0, "eval_samples: expected int, got 1.0 (float)"),
    ("threads", -1, "threads must be an integer >= 0, got -1"),
    ("threads", 2.0, "threads: expected int, got 2.0 (float)"),
    ("log_dir", 123, "log_dir: expected str or none, got 123 (int)"),
    ("run_name", 7, "run_name: expected str or none, got 7 (int)"),
    ("tensorboard", "yes", "tensorboard: expected bool, got 'yes' (str)"),
    ("wandb_project", 1, "wandb_project: expected str or none, got 1 (int)"),
    ("save_every", -1, "save_every must be an integer >= 0, got -1"),
    ("save_every", 2.5, "save_every: expected int, got 2.5 (float)"),
    ("save_dir", 5, "save_dir: expected str or none, got 5 (int)"),
    ("keep_last", -1, "keep_last must be an integer >= 0, got -1"),
    ("keep_last", 3.0, "keep_last: expected int, got 3.0 (float)"),
    ("max_skipped_updates", -1, "max_skipped_updates must be an integer >= 0, got -1"),
    ("max_skipped_updates", "10", "max_skipped_updates: expected int, got '10' (str)"),
    ("max_prompt_tokens", 0, "max_prompt_tokens must be an integer > 0 or None, got 0"),
    ("max_prompt_tokens", 64.0, "max_prompt_tokens: expected int or none, got 64.0 (float)"),
    ("long_prompts", "skip", "long_prompts='skip' is not one of: 'error', 'drop'"),
    ("long_prompts", False, "long_prompts: expected str, got False (bool)"),
    ("reward_workers", 0, "reward_workers must be a positive integer, got 0"),
    ("reward_workers", 0.5, "reward_workers: expected int, got 0.5 (float)"),
    ("reward_timeout_s", 0, "reward_timeout_s must be a finite float > 0 or None (no limit), got 0"),
    ("reward_timeout_s", inf, "reward_timeout_s must be a finite float > 0 or None (no limit), got inf"),
    ("reward_timeout_s", "30", "reward_timeout_s: expected float or none, got '30' (str)"),
    ("reward_processes", 0, "reward_processes: expected bool, got 0 (int)"),
    ("on_reward_error", "ignore", "on_reward_error='ignore' is not one of: 'raise', 'zero'"),
    ("on_reward_error", None, "on_reward_error: expected str, got None (NoneType)"),
    ("sandbox", "nonsense", "sandbox='nonsense' is not one of: None, 'namespaces', 'bwrap', 'rlimits'"),
    ("sandbox", True, "sandbox: expected str or none, got True (bool)"),
]

SESSION_BAD = [  # fields typed Any (a name or an object): Config takes any value, the Session checks the name
    ("task", "arithmatic", "unknown task 'arithmatic'; built-in tasks: arithmetic"),
    ("algorithm", "grpoo", "unknown algorithm 'grpoo'; valid: "),
    ("sampler", "hff", "sampler='hff' is not one of: 'auto', 'hf', 'vllm'"),
]

TOGETHER = [  # fields that pass on their own but not together
    (dict(save_every=2, log_dir=None), "save_every needs a place for checkpoints"),
    (dict(tensorboard=True, log_dir=None), "tensorboard=True writes its event files under log_dir"),
    (dict(cluster="ray", world_size=4, prompts_per_step=1, samples_per_prompt=2),
     "a mini-batch of 2 samples cannot be split across world_size=4 ranks"),
    (dict(on_policy_old_logp=True, epochs_per_step=2), "on_policy_old_logp needs epochs_per_step=1"),
    (dict(on_policy_old_logp=True, overlap_rollout=True), "on_policy_old_logp needs on-policy batches"),
    (dict(on_policy_old_logp=True, rollout_mode="async"), "on_policy_old_logp needs on-policy batches, and "
                                                          "rollout_mode='async' trains on batches sampled by older"),
    (dict(overlap_rollout=True, rollout_mode="async"), "overlap_rollout=True is rollout_mode='overlap', not 'async'"),
    (dict(rollout_workers=2), "rollout_workers=2 applies to rollout_mode='async' only (this session's is 'sync')"),
    (dict(rollout_mode="async", vllm_sleep=True), "vllm_sleep frees a GPU the sampler shares with the policy"),
    (dict(vllm=rl.VLLM(sleep=True), vllm_sleep=False), "vllm=rl.VLLM(sleep=True) and vllm_sleep=False disagree"),
]

HINTS = typing.get_type_hints(Config)


def _takes(hint, kind: type) -> bool:
    """Whether a field's hint has numbers of `kind` in it (float in `float | None` and `tuple[float, float]`)."""
    return hint is kind or any(_takes(h, kind) for h in typing.get_args(hint))


@pytest.mark.parametrize("field, value, message", BAD, ids=lambda x: repr(x)[:30])
def test_a_bad_value_is_named_with_what_the_field_accepts(field, value, message):
    with pytest.raises(ValueError) as error:  # never a bare TypeError from comparing a str with a number
        make_config(**{field: value})
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("field, value, message", SESSION_BAD)
def test_a_bad_name_of_an_any_field_stops_the_session_before_any_work(monkeypatch, field, value, message):
    def no_work(*args, **kwargs):
        raise AssertionError("a model was resolved before the configuration was checked")
    monkeypatch.setattr(rl.models, "resolve", no_work)
    assert make_config(**{field: value})
    with pytest.raises(ValueError) as error:
        rl.Session(**{field: value})
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("changes, message", TOGETHER)
def test_fields_that_do_not_fit_together_are_named(changes, message):
    with pytest.raises(ValueError) as error:
        make_config(**changes)
    assert str(error.value).startswith(message)


def test_the_table_covers_every_field_with_each_kind_of_bad_value():
    rows = {field: [value for f, value, _ in BAD if f == field] for field in Config.fields()}
    assert set(Config.fields()) == {f for f, _, _ in BAD} | {f for f, _, _ in SESSION_BAD}, "a field without a row"
    for field, values in rows.items():
        hint = HINTS[field]
        if hint is typing.Any:
            continue
        assert any(not conforms(v, hint) for v in values), f"{field}: no row of the wrong type"
        if _takes(hint, float):
            assert any(not math.isfinite(x) for v in values if conforms(v, hint) for x in _numbers(v)), \
                f"{field}: no row with a NaN or infinity"
        if _takes(hint, float) or _takes(hint, int):
            assert any(conforms(v, hint) and all(map(math.isfinite, _numbers(v))) for v in values), \
                f"{field}: no row out of range"


def _numbers(value) -> list:
    return [x for x in (value if isinstance(value, tuple) else [value]) if x is not None]


def test_the_defaults_pass_and_numbers_take_their_wider_forms():
    assert Config().check() == Config() == make_config()
    config = make_config(lr=1, top_p=1, critic_lr=2, betas=[0.9, 0.95], reward_timeout_s=None,
                         vllm_gpu_memory_utilization=1, seed=2**63 - 1, cluster=rl.Ray(address="auto"))
    assert config.lr == 1 and config.betas == [0.9, 0.95]


def test_an_unknown_key_is_named_with_the_valid_ones():
    with pytest.raises(TypeError, match=r"unknown Session argument\(s\) \['lrr'\]; valid: model, task"):
        make_config(lrr=1e-4)
    with pytest.raises(TypeError, match=r"unknown Session argument\(s\) \['lrr'\]; valid: model, task"):
        Config.from_record(Config().to_record(), lrr=1e-3)  # Session.restore(path, lrr=...): was an AttributeError


def test_every_field_has_its_docstring():
    docs = Config.docs()
    assert list(docs) == Config.fields()
    assert all(doc.strip() for doc in docs.values()), [name for name, doc in docs.items() if not doc.strip()]
    assert docs["lr"] == "Peak learning rate of AdamW."
    assert docs["vllm_sleep"].startswith("vLLM sampler on a GPU shared with the policy: sleep during update()")
    assert "\n    " not in docs["precision"]  # continuation lines lose the class body's indent


def test_a_group_sets_the_flat_fields_of_its_knobs_and_takes_their_defaults_and_docs():
    config = make_config(vllm=rl.VLLM(sleep=True, max_model_len=512), reward_runner={"workers": 2, "on_error": "zero"})
    assert (config.vllm_sleep, config.vllm_max_model_len, config.vllm_enforce_eager) == (True, 512, None)
    assert (config.reward_workers, config.on_reward_error, config.reward_timeout_s) == (2, "zero", 30.0)
    assert config.reward_runner == rl.RewardRunner(workers=2, on_error="zero")  # a recipe's table, made a group
    assert config.to_record()["vllm"] is None and config.to_record()["vllm_sleep"] is True  # kept as flat fields
    restored = Config.from_record(config.to_record())
    assert (restored.vllm_sleep, restored.vllm_max_model_len, restored.reward_workers) == (True, 512, 2)
    parameters = inspect.signature(rl.VLLM).parameters
    assert list(parameters) == ["kv_cache_bytes", "max_model_len", "enforce_eager", "gpu_memory_utilization", "sleep"]
    assert parameters["sleep"].default is False and parameters["max_model_len"].annotation == int | None
    assert "sleep (vllm_sleep): vLLM sampler on a GPU shared with the policy" in rl.VLLM.__doc__
    with pytest.raises(TypeError, match=r"rl.RewardRunner has no knob\(s\) \['worker'\]; its knobs: workers, "):
        rl.RewardRunner(worker=2)


def test_knobs_given_by_their_flat_names_are_deprecated_with_the_group_form():
    assert grouped_keywords({"lr": 1e-3}) is None
    assert grouped_keywords({"vllm_sleep": True, "reward_processes": True, "lr": 1e-3}) == (
        "vllm_sleep, reward_processes: these knobs are set together now, vllm=rl.VLLM(sleep=True), "
        "reward_runner=rl.RewardRunner(processes=True) here; the flat keywords still work, for a while")


def test_paths_are_accepted_as_strings(tmp_path):
    config = make_config(log_dir=tmp_path, save_dir=tmp_path / "ckpt")
    assert (config.log_dir, config.save_dir) == (str(tmp_path), str(tmp_path / "ckpt"))
