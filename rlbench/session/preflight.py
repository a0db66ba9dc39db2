"""What a session checks before it starts a worker: the run's worst case, against the algorithm, the task and
the model. Every failure is a ValueError naming the setting, the example or the file, and the fix."""

from __future__ import annotations

import dataclasses

from rlbench import algorithms, models, tasks
from rlbench.algorithms import Algorithm
from rlbench.config import Config, grouped_keywords, ranks_phrase
from rlbench.session.sources import mode_of
from rlbench.workers.build import check_sampler, check_sandbox


def flat_keywords(cfg: Config, keywords: dict) -> list[str]:
    """What to say of the knobs given by their former flat names (the rollout mode's, a group's): the new form of
    each, with this session's values."""
    said = []
    if flat := [k for k in ("rollout_mode", "max_staleness", "rollout_workers", "overlap_rollout") if k in keywords]:
        said.append(f"{', '.join(flat)}: the rollout mode is one setting now, rollout={mode_of(cfg)!r} here "
                    f"(rl.Sync(), rl.Overlap(), rl.Async(max_staleness=..., workers=...)); the flat keywords still "
                    f"work, for a while")
    if moved := grouped_keywords(keywords):
        said.append(moved)
    return said


def task_settings(config: Config | None, overrides: dict):
    """(the session's settings, its task, the settings taken from the task): `config`'s fields and `overrides`, and
    where neither gives one, the task's own (`rl.tasks.settings_of`: what it needs to learn, e.g. the calculator's
    turn length). A field of `config` at its default counts as not given. The task is built here, once."""
    settings = (config.to_dict() if config else {}) | overrides
    given = set(overrides) | {f.name for f in dataclasses.fields(Config)
                              if config is not None and getattr(config, f.name) != f.default}
    task = tasks.get(settings.get("task", Config.task))
    own = tasks.settings_of(task)
    if unknown := sorted(set(own) - set(Config.fields())):
        raise ValueError(f"task {getattr(task, 'name', task)!r} asks for unknown Session setting(s) {unknown}")
    taken = {k: v for k, v in own.items() if k not in given}
    return settings | taken, task, taken


def prepare(cfg: Config, algorithm: Algorithm, task):
    """(task, model directory, tokenizer) of a checked run: the settings fit the algorithm, every prompt is
    usable (too-long ones refused or dropped), the model's vocabulary covers the tokenizer's and its context
    the longest prompt plus `max_new_tokens`. `task`: `cfg.task` built (`task_settings`)."""
    check_algorithm(cfg, algorithm)
    if algorithm.needs_turns and not isinstance(task, tasks.AgentTask):
        raise ValueError(f"algorithm {algorithm.name!r} credits each turn of an episode: it needs an agentic task "
                         f"(rl.tasks.AgentTask, e.g. task='calculator'), not {getattr(task, 'name', task)!r}")
    check_sampler(cfg.sampler, cfg.cluster)
    check_sandbox(cfg.sandbox, cfg.cluster)
    mode_of(cfg).check(cfg, algorithm, task)
    model_dir = str(models.resolve(cfg.model))
    tokenizer = models.load_tokenizer(model_dir)
    check_tensor_parallel(cfg, model_dir)
    check_images(cfg, task, model_dir)
    if cfg.freeze_vision and not models.vision.has_vision(model_dir):
        raise ValueError(f"freeze_vision=True, but model {cfg.model!r} has no vision tower (its config.json has no "
                         f"vision_config)")
    if isinstance(task, tasks.AgentTask):  # first turns come from the environment: their length is per turn
        tasks.check_pictures(task, takes_images=models.vision.has_vision(model_dir))
        models.check_fits(model_dir, tokenizer, max_prompt_tokens=None, max_new_tokens=cfg.max_new_tokens)
        return task, model_dir, tokenizer
    tasks.check_prompts(task, takes_images=models.vision.has_vision(model_dir))
    vision = models.vision.Vision.of(model_dir, tokenizer) if tasks.has_images(task) else None  # images' tokens count
    task = tasks.limit_prompt_tokens(task, tokenizer, cfg.max_prompt_tokens, on_long=cfg.long_prompts, vision=vision)
    room = models.prompt_room(model_dir, cfg.max_new_tokens)
    longest = cfg.max_prompt_tokens or tasks.longest_prompt_tokens(
        tokenizer, [*task.train, *task.test], fits=lambda n: room is None or n <= room, vision=vision)
    models.check_fits(model_dir, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens, max_new_tokens=cfg.max_new_tokens,
                      longest_prompt_tokens=longest)
    return task, model_dir, tokenizer


def check_images(cfg: Config, task, model_dir: str) -> None:
    """For a task with images on the vLLM sampler, ImportError where vLLM's Qwen2-VL cannot load here (it needs
    torchvision: `rl.samplers.vllm.check_vision_support`), before any worker starts."""
    if tasks.has_images(task) and cfg.sampler == "vllm" and models.vision.has_vision(model_dir):
        from rlbench.samplers.vllm import check_vision_support

        check_vision_support(model_dir)


def teacher(cfg: Config, tokenizer, task) -> str | None:
    """The teacher's model directory (None without `teacher=`): its tokenizer is the policy's, and its context holds
    what it scores, the task's longest prompt (as `prepare` left the task) plus `max_new_tokens`."""
    if cfg.teacher is None:
        return None
    teacher_dir = str(models.resolve(cfg.teacher))
    check_tensor_parallel(cfg, teacher_dir, "teacher")
    models.check_same_tokenizer(tokenizer, models.load_tokenizer(teacher_dir), teacher_dir, "teacher")
    longest = None
    if not isinstance(task, tasks.AgentTask):  # an episode's turns are checked as they come
        room = models.prompt_room(teacher_dir, cfg.max_new_tokens)
        longest = tasks.longest_prompt_tokens(tokenizer, [*task.train, *task.test],
                                              fits=lambda n: room is None or n <= room)
    models.check_fits(teacher_dir, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens, max_new_tokens=cfg.max_new_tokens,
                      longest_prompt_tokens=longest)
    return teacher_dir


def with_correction(algorithm: Algorithm, cfg: Config) -> Algorithm:
    """The algorithm with the session's rollout correction (`Config.correction`): "auto" keeps the algorithm's own,
    adding token TIS when the rollout mode trains on what older weights sampled (rl.Async: up to max_staleness
    updates old) and the algorithm has none and its loss takes weights; None or "none" removes it; a name or a
    RolloutCorrection replaces it."""
    if cfg.correction == "auto":
        takes_weights = algorithms.declared(algorithm.loss, {"weights_B_T": None})
        if mode_of(cfg).stale_samples() and algorithm.correction is None and takes_weights:
            return algorithm.replace(correction="token_tis")
        return algorithm
    return algorithm.replace(correction=None if cfg.correction == "none" else cfg.correction)


def check_algorithm(cfg: Config, algorithm: Algorithm) -> None:
    """The settings that cannot work with this algorithm."""
    if cfg.on_policy_old_logp and (algorithm.correction is not None or algorithm.reward_kl_coef):
        raise ValueError(f"on_policy_old_logp: algorithm {algorithm.name!r} reads old_logp before the update "
                         "(rollout correction or KL in the reward)")
    if cfg.on_policy_old_logp and algorithm.needs_sum_pi2:
        raise ValueError(f"on_policy_old_logp: algorithm {algorithm.name!r} reads Σ_v π_v² per token (OTB), which the "
                         f"old-policy forward computes before the update: drop on_policy_old_logp")
    if cfg.on_policy_old_logp and algorithm.needs_teacher:
        raise ValueError(f"on_policy_old_logp: algorithm {algorithm.name!r} distils from a teacher, comparing old_logp "
                         f"with the teacher's before the update: drop on_policy_old_logp")
    if algorithm.needs_teacher and cfg.teacher is None:
        raise ValueError(f"algorithm {algorithm.name!r} distils from a teacher (its advantage reads teacher_logp_B_T, or "
                         f"distill_coef / forward_kl_coef > 0): pass teacher= a built-in model name or a local Hugging "
                         f"Face model directory")
    if cfg.samples_per_prompt == 1 and "group_ids" in algorithms.declared(algorithm.advantage, {"group_ids": 0}):
        raise ValueError(f"samples_per_prompt=1: algorithm {algorithm.name!r} compares the samples of a prompt (its "
                         f"advantage declares group_ids), and one sample has none to compare with (GRPO would train "
                         f"on raw rewards): use samples_per_prompt >= 2, or an estimator without groups")
    greedy = "temperature=0" if cfg.temperature == 0 else "top_k=1" if cfg.top_k == 1 else None
    if greedy and cfg.samples_per_prompt > 1 and "group_ids" in algorithms.declared(algorithm.advantage,
                                                                                    {"group_ids": 0}):
        raise ValueError(f"{greedy}: the {cfg.samples_per_prompt} samples of a prompt are the same greedy "
                         f"completion, so algorithm {algorithm.name!r}, which compares them (its advantage declares "
                         f"group_ids), gives every one an advantage of 0 and trains nothing: sample with temperature > 0 "
                         f"and top_k 0 or above 1 (evaluate() is greedy on its own)")
    if algorithm.filter_groups and cfg.samples_per_prompt < cfg.data_parallel:
        raise ValueError(f"dynamic sampling may keep a single group of samples_per_prompt={cfg.samples_per_prompt} "
                         f"rows, fewer than {ranks_phrase(cfg)}: raise samples_per_prompt")
    if cfg.tensor_parallel > 1 and algorithm.needs_critic:
        raise ValueError(f"tensor_parallel={cfg.tensor_parallel}: algorithm {algorithm.name!r} trains a critic, whose "
                         f"value head tensor parallel does not split: use FSDP alone (tensor_parallel=1)")


def check_tensor_parallel(cfg: Config, model_dir: str, role: str = "model") -> None:
    """A ValueError naming why `model_dir` cannot be split `cfg.tensor_parallel` ways (`training.check_tensor_parallel`,
    on the model built without weights; a vision-language model is refused)."""
    if cfg.tensor_parallel == 1:
        return
    if models.vision.has_vision(model_dir):
        raise ValueError(f"tensor_parallel={cfg.tensor_parallel}: the {role} {model_dir} is a vision-language model, "
                         f"which tensor parallel does not split: use FSDP alone (tensor_parallel=1)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlbench.policy.training import check_tensor_parallel as check_blocks

    with torch.device("meta"), models.quiet_transformers():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    try:
        check_blocks(model, cfg.tensor_parallel)
    except ValueError as error:
        raise ValueError(f"the {role} {model_dir}: {error}") from None
