"""Building a session's workers: `start_workers` starts every part (the policy ranks, with the reference, teacher and
critic colocated on them or in groups of their own, the sampler, the rollout mode's rollout workers, the reward scorer
or the environment worker), in this process or as Ray actors, and returns them as `Workers`: one handle per part
(`rlbench/workers/handles.py`), the one sample path of rollouts and evaluation, and the scoring of a batch.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable

import torch

from rlbench import algorithms, models, tasks
from rlbench.agents import EnvPool, EpisodeHandle, EpisodeRunner, Renderer, get_parser
from rlbench.algorithms import Algorithm
from rlbench.batch import Batch
from rlbench.config import Config
from rlbench.policy import Critic, Policy, Reference
from rlbench.policy.training import OptimSettings
from rlbench.rewards import TaskScorer, sandbox_info
from rlbench.runs.progress import bar as progress_bar
from rlbench.models.vision import Vision
from rlbench.samplers import HFSampler, PartialRollouts, SamplingParams, SGLangSampler, VLLMSampler
from rlbench.samplers import sglang as sglang_sampler
from rlbench.samplers import vllm as vllm_sampler
from rlbench.workers.cluster import Placer, Ray, WorkerGroup, acquire_ray, check_resources, release_ray
from rlbench.workers.handles import CriticHandle, EnvHandle, PolicyHandle, ReferenceHandle, SamplerHandle, ScorerHandle


def _partial_rollouts(factory: Callable, kwargs: dict) -> PartialRollouts:
    """A rollout worker's sampler: the session's sampler, made interruptible and versioned."""
    return PartialRollouts(factory(**kwargs))


@dataclasses.dataclass
class Workers:
    """Every worker of a session, by handle; `close()` ends them (also when garbage-collected)."""

    policy: PolicyHandle
    sampler: SamplerHandle
    scorer: ScorerHandle | None
    """The task's reward over completions (None for an agentic task: its environments score episodes)."""
    episodes: EpisodeRunner | None
    """An agentic task's episodes: the sampler, the chat template, the parser and the environment worker."""
    reference: ReferenceHandle | None
    critic: CriticHandle | None
    groups: list[WorkerGroup]
    on_ray: bool
    placer: Placer | None = None
    """Where the Ray processes went (`Ray.nodes`), None inline."""
    teacher: ReferenceHandle | None = None
    """The on-policy distillation teacher (`Config.teacher`), or None."""
    rollout: list[SamplerHandle] | None = None
    """The rollout mode's rollout workers (`RolloutMode.rollout_workers()`: rl.Async's); `sampler` is the first."""
    restart_rollout: Callable[[int], None] | None = None
    """Replace rollout worker i, found dead, with a new one behind the same handle (`SamplerHandle.replace`)."""

    def __post_init__(self):
        self._closer = weakref.finalize(self, _close_groups, self.groups, self.on_ray, self.placer)

    def close(self) -> None:
        """End every worker (and the Ray instance rlbench started, once no session uses it). Idempotent."""
        self._closer()

    def sample(self, examples: list[dict], params: SamplingParams, *, baseline: bool = False,
               version: int = 0) -> tuple[Batch, int]:
        """(the batch, the tokens sampled for it): `params.n` completions of each example, or for an agentic task its
        episodes played to their ends (turns batched, `version` recorded as the weights' version); with `baseline`,
        the greedy one's result on every sample of its group (`baseline_completion` / `baseline_finished`, or an
        episode's `baseline_score`). The one sample path of rollouts and evaluation, for either kind of task."""
        if self.episodes is not None:
            runner = self.episodes
            runner.version, runner.seed = version, params.seed
            rows = [i for i in range(len(examples)) for _ in range(params.n)]
            batch = runner.rollout([examples[i] for i in rows], rows, greedy=params.greedy)
            tokens = int(batch["loss_mask"].sum())
            if baseline and not params.greedy:
                greedy = runner.rollout(examples, list(range(len(examples))), greedy=True)
                tokens += int(greedy["loss_mask"].sum())
                batch = batch.with_columns(baseline_score=greedy["score"][torch.tensor(rows)])
            return batch, tokens
        batch = self.sampler.generate(examples, params)
        tokens = int(batch["response_mask"].sum())
        if baseline:
            greedy = self.sampler.generate(examples, dataclasses.replace(params, n=1, temperature=0.0, seed=0, seeds=None))
            tokens += int(greedy["response_mask"].sum())
            rows = batch["group_ids"]
            batch = batch.with_columns(baseline_completion=[greedy["completion"][i] for i in rows],
                                       baseline_finished=greedy["finished"][rows])
        return batch, tokens

    def episode(self, example: dict, *, greedy: bool, version: int, seed: int) -> EpisodeHandle:
        """A new episode of an agentic task to step by hand (`version`: the weights' version its tokens record,
        `seed`: of its sampled turns); ValueError for a task of single completions."""
        if self.episodes is None:
            raise ValueError("episode: the session's task is not agentic (an rl.tasks.AgentTask); its rollouts are "
                             "single completions: s.rollout()")
        self.episodes.version, self.episodes.seed = version, seed
        return EpisodeHandle(self.episodes.start([example], greedy=greedy)[0], self.episodes)

    def score(self, batch: Batch) -> Batch:
        """`batch` with its samples scored: `score` [B], its named components (listed in `meta["reward_components"]`),
        `reward_error` (each sample's error or None), and `baseline_reward` when it has a greedy baseline. The task's
        reward runs over the completions; an agentic task's episodes were scored by their environments as they ended."""
        if batch.meta.get("agentic"):
            components = {k: batch[k] for k in batch.meta["reward_components"]}
            score_B, errors = batch["score"], batch["reward_error"]
            baseline = {"baseline_reward": batch["baseline_score"]} if "baseline_score" in batch else {}
        else:
            score_B, components, errors = self.scorer.score(batch["completion"], batch["example"], batch["finished"])
            baseline = {"baseline_reward": self.scorer.score(batch["baseline_completion"], batch["example"],
                                                             batch["baseline_finished"])[0]} \
                if "baseline_completion" in batch else {}
        return batch.with_columns(score=score_B, reward_error=errors, **components, **baseline).with_meta(
            reward_components=list(components))

    @staticmethod
    def capped_lengths(batch: Batch) -> torch.Tensor:
        """[B] the sampled tokens that max_new_tokens caps: a completion's, or an episode's longest turn (each
        turn is capped on its own)."""
        if batch.meta.get("agentic"):
            return algorithms.longest_turns(batch["loss_mask"], batch["turn"])
        return batch["response_mask"].sum(-1)

    def template_report(self, example: dict):
        """For an agentic task, whether its chat template is append-only with this tokenizer on `example`
        (`rl.agents.TemplateReport`; not ok: the model sees other tokens than it sampled); None otherwise."""
        return None if self.episodes is None else self.episodes.check_template(example)

    def trained(self) -> dict[str, PolicyHandle | ReferenceHandle | CriticHandle]:
        """The models a checkpoint keeps, by folder name."""
        reference = self.reference if self.reference is not None and self.reference.own_weights else None
        parts = {"policy": self.policy, "reference": reference, "critic": self.critic}
        return {name: handle for name, handle in parts.items() if handle is not None}


def start_workers(cfg: Config, algorithm: Algorithm, task, model_dir: str, tokenizer,
                  teacher_dir: str | None = None, *, rollout_workers: int = 0) -> Workers:
    """Build every worker of a session: in this process (`cluster="inline"`) or as Ray actors; `teacher_dir`: the
    distillation teacher's model directory (`preflight.teacher`); `rollout_workers`: the rollout mode's own
    (`RolloutMode.rollout_workers()`; 0: the one sampler)."""
    ray = cfg.cluster if isinstance(cfg.cluster, Ray) else Ray() if cfg.cluster == "ray" else None
    own_reference = algorithm.needs_reference and cfg.lora is None  # under LoRA: the policy with its adapter off
    parts = 1 + own_reference + algorithm.needs_critic + (teacher_dir is not None)
    separate = parts if cfg.placement == "separate" else 1
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA GPU here: use device='cpu' or 'auto'")
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    gpus = 1 if device == "cuda" and ray is not None else 0
    samplers = rollout_workers or 1
    processes = cfg.world_size * separate + samplers + 1  # policy ranks (and their reference / critic), samplers, rewards
    groups: list[WorkerGroup] = []
    placer = None
    if ray is not None:
        acquire_ray(ray, cpus_needed=processes * cfg.cpus_per_worker)
        try:
            check_resources(processes * cfg.cpus_per_worker, (processes - 1) * gpus,
                            f"world_size={cfg.world_size} (placement={cfg.placement!r}: {processes} worker "
                            f"processes at cpus_per_worker={cfg.cpus_per_worker:g})")
            # one bundle per process, in the order `_build` makes them (the reward worker, last, takes no GPU)
            bundle = {"CPU": cfg.cpus_per_worker} | ({"GPU": gpus} if gpus else {})
            placer = Placer(ray, [bundle] * (processes - 1) + [{"CPU": cfg.cpus_per_worker}])
        except ValueError:
            release_ray()
            raise
    try:
        return _build(cfg, algorithm, task, model_dir, tokenizer, teacher_dir, ray, separate > 1, device, gpus, groups,
                      rollout_workers, placer)
    except BaseException:
        _close_groups(groups, ray is not None, placer)
        raise


def _build(cfg: Config, algorithm: Algorithm, task, model_dir: str, tokenizer, teacher_dir: str | None, ray: Ray | None,
           separate: bool, device: str, gpus: int, groups: list[WorkerGroup], rollout_workers: int,
           placer: Placer | None) -> Workers:
    threads = cfg.threads or (1 if ray else None)  # inline: the user's thread count unless `threads` is set
    optim = OptimSettings(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                          lr_schedule=cfg.lr_schedule, lr_warmup_steps=cfg.lr_warmup_steps,
                          lr_decay_steps=cfg.lr_decay_steps)
    common = dict(model_dir=model_dir, micro_batch_tokens=cfg.micro_batch_tokens, device=device, attention=cfg.attention)

    def group(name: str, size: int, concurrency: int = 1, env: dict[str, str] | None = None,
              replicas: int = 1) -> WorkerGroup:
        workers = WorkerGroup(name, size, ray=ray is not None, threads=threads, cpus=cfg.cpus_per_worker,
                              gpus=gpus if name not in ("rewards", "envs") else 0, concurrency=concurrency, env=env,
                              placer=placer, replicas=replicas)
        groups.append(workers)
        return workers

    def ranks(workers: WorkerGroup, **kwargs) -> list[dict]:
        address = workers.rendezvous()
        return [common | kwargs | dict(rank=r, world_size=workers.size, init_method=address)
                for r in range(workers.size)]

    # every group's processes first, so that they all start (import, connect) at once; then every build at once
    policy = group("policy", cfg.world_size, replicas=cfg.tensor_parallel)
    lora_reference = algorithm.needs_reference and cfg.lora is not None  # the policy with its adapter off
    own = {"reference": algorithm.needs_reference and not lora_reference, "teacher": teacher_dir is not None,
           "critic": algorithm.needs_critic}
    on = {part: (group(part, cfg.world_size, replicas=1 if part == "critic" else cfg.tensor_parallel) if separate
                 else policy) for part, wanted in own.items() if wanted}
    factory, kwargs, choice, why = _sampler_factory(cfg, model_dir, device, images=tasks.has_images(task))
    # each rollout worker runs a rollout, a weights push and an evaluation at once
    samplers = [group(f"rollout-{i}", 1, concurrency=4) for i in range(rollout_workers)] or [group("sampler", 1)]
    agentic = isinstance(task, tasks.AgentTask)
    # the worker that runs model-written code (rewards, tools) with run_python, in the session's sandbox mode
    last = group("envs" if agentic else "rewards", 1, env={"RLBENCH_SANDBOX": cfg.sandbox} if cfg.sandbox else None)
    if ray is not None:
        _wait_started(groups)

    # the causal LMs' forwards and their split (a critic, refused under tensor parallel, has neither)
    heads = dict(precision=cfg.precision, logit_chunk_tokens=cfg.logit_chunk_tokens, tensor_parallel=cfg.tensor_parallel)
    builds = [policy.start_build("policy", Policy, ranks(
        policy, optim=optim, temperature=cfg.temperature, activation_checkpointing=cfg.activation_checkpointing,
        lora=cfg.lora, freeze_vision=cfg.freeze_vision, seed=cfg.seed, **heads))]
    if "reference" in on:
        builds.append(on["reference"].start_build("reference", Reference, ranks(on["reference"],
                                                                                temperature=cfg.temperature, **heads)))
    if "teacher" in on:  # its top-k stays within the policy's ids (a larger embedding's padding rows)
        builds.append(on["teacher"].start_build("teacher", Reference, ranks(
            on["teacher"], model_dir=teacher_dir, temperature=cfg.temperature, vocab=len(tokenizer), **heads)))
    if "critic" in on:
        builds.append(on["critic"].start_build("critic", Critic, ranks(on["critic"], seed=cfg.seed, optim=dataclasses.replace(
            optim, lr=cfg.critic_lr or cfg.lr))))
    if rollout_workers:  # samplers that take new weights mid-generation
        builds += [workers.start_build("sampler", _partial_rollouts, [dict(factory=factory, kwargs=kwargs)])
                   for workers in samplers]
    else:
        builds.append(samplers[0].start_build("sampler", factory, [kwargs]))
    if agentic:
        builds.append(last.start_build("envs", EnvPool, [dict(
            env=task.env, tools=task.tools, reward=task.reward, system=task.system, tool_timeout_s=task.tool_timeout_s,
            route=task.route, tool_concurrency=task.tool_concurrency)]))
    else:
        builds.append(last.start_build("rewards", TaskScorer, [dict(
            task=task, on_error=cfg.on_reward_error, timeout_s=cfg.reward_timeout_s, workers=cfg.reward_workers,
            processes=cfg.reward_processes)]))
    for pending in builds:
        pending.result()

    reference = ReferenceHandle(policy, "policy", Policy.reference_log_probs) if lora_reference else \
        ReferenceHandle(on["reference"]) if "reference" in on else None
    teacher = ReferenceHandle(on["teacher"], "teacher") if "teacher" in on else None
    critic = on.get("critic")
    if rollout_workers:
        def restart(dead: WorkerGroup) -> WorkerGroup:  # a new rollout worker in place of a dead one
            dead.close()
            groups.remove(dead)
            workers = group(dead.name, 1, concurrency=4)
            workers.build("sampler", _partial_rollouts, [dict(factory=factory, kwargs=kwargs)])
            return workers

        def restart_rollout(i: int) -> None:
            rollout[i].replace()

        vision = Vision.of(model_dir, tokenizer)
        rollout = [SamplerHandle(workers, tokenizer, choice, why, restart=restart, vision=vision) for workers in samplers]
        sampler = rollout[0]
    else:
        rollout = restart_rollout = None
        sampler = SamplerHandle(samplers[0], tokenizer, choice, why, sleeps=cfg.vllm_sleep and choice == "vllm",
                                vision=Vision.of(model_dir, tokenizer))
    scorer = episodes = None
    if agentic:
        episodes = _episode_runner(cfg, task, model_dir, tokenizer, sampler, EnvHandle(last))
    else:
        scorer = ScorerHandle(last)
    return Workers(policy=PolicyHandle(policy, algorithm, cfg.max_new_tokens), sampler=sampler,
                   scorer=scorer, episodes=episodes, reference=reference, teacher=teacher,
                   critic=critic and CriticHandle(critic, algorithm, cfg.max_new_tokens),
                   groups=groups, on_ray=ray is not None, placer=placer, rollout=rollout,
                   restart_rollout=restart_rollout)


def _wait_started(groups: list[WorkerGroup]) -> None:
    """Wait until every Ray worker process has started, with a bar: each imports torch and rlbench, and on a small
    machine they take a minute between them. An actor that failed to start raises here."""
    import ray

    pending = [host.__ray_ready__.remote() for workers in groups for host in workers.hosts]
    with progress_bar(total=len(pending), desc="worker processes started", unit="process") as started:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
            started.update(len(done))


def _episode_runner(cfg: Config, task, model_dir: str, tokenizer, sampler: SamplerHandle,
                    envs: EnvHandle) -> EpisodeRunner:
    """The driver of an agentic task's episodes: each turn samples with the session's settings (greedy on
    request), stopping at EOS or the parser's stop strings (the end of a tool call, for a parser that stops there),
    and keeps its KV cache for the episode's next turn (HF; vLLM's prefix cache does the same). Each environment's
    episodes render their prompts with its own tools."""
    parser = get_parser(task.parser)
    stops = []
    for text in parser.stop:  # a stop string the tokenizer has as one token stops the sampler there
        ids = tokenizer.encode(text, add_special_tokens=False)
        stops += ids if len(ids) == 1 else []
    info = envs.info()

    def sample(contexts, seeds, max_new_tokens, greedy, images):
        params = SamplingParams.of(cfg, greedy=greedy, max_new_tokens=max_new_tokens, seeds=tuple(seeds),
                                   stop_token_ids=tuple(stops), keep_cache=True)  # the next turn continues this context
        return sampler.generate_ids(contexts, params, images)

    context = task.max_context_tokens or models.prompt_room(model_dir, 0) or cfg.max_new_tokens * task.max_turns * 4
    renderers = {name: Renderer(tokenizer, schemas, sampler.vision)  # (vision: pictures in prompts and tools' results)
                 for name, schemas in info["schemas"].items()}
    return EpisodeRunner(sample, renderers, parser, envs, tokenizer, max_turns=task.max_turns,
                         max_new_tokens=cfg.max_new_tokens, max_context=context, game=info["game"],
                         route=info["route"])


def _close_groups(groups: list[WorkerGroup], on_ray: bool, placer: Placer | None = None) -> None:
    """End the groups' workers and free their placement; release Ray (shut down if rlbench started it and no session
    uses it)."""
    for workers in groups:
        workers.close()
    groups.clear()
    if placer is not None:
        placer.close()
    if on_ray:
        release_ray()


def check_sampler(sampler, cluster) -> None:
    """ValueError for a `sampler=` that is no choice, or a Sampler object outside the inline cluster."""
    if isinstance(sampler, str) and sampler not in ("auto", "hf", "vllm", "sglang"):
        raise ValueError(f"sampler={sampler!r} is not one of: 'auto', 'hf', 'vllm', 'sglang' (or a Sampler object)")
    if not isinstance(sampler, str) and cluster != "inline":
        raise ValueError("a Sampler object runs in this process: use cluster='inline', or sampler='hf' / 'vllm' / "
                         "'sglang'")


def check_sandbox(sandbox: str | None, cluster) -> None:
    """ValueError for a `sandbox=` mode that this machine lacks (`sandbox_info()`), or inline, one that this process's
    RLBENCH_SANDBOX does not say: the worker that runs code is this process then, and a session sets no variable."""
    if sandbox is None:
        return
    info = sandbox_info()
    if sandbox not in info["available"]:
        raise ValueError(f"sandbox={sandbox!r} is not available on this machine, which lacks "
                         f"{info['why_not'][sandbox]}; available: {', '.join(map(repr, info['available'])) or 'none'}")
    if cluster == "inline" and os.environ.get("RLBENCH_SANDBOX") != sandbox:
        raise ValueError(f"sandbox={sandbox!r} goes to the worker that scores code and runs tools, and inline that is "
                         f"this process, whose environment a session does not change (its RLBENCH_SANDBOX is "
                         f"{os.environ.get('RLBENCH_SANDBOX')!r}): use cluster='ray', or set "
                         f"os.environ['RLBENCH_SANDBOX'] = {sandbox!r} yourself before the session")


def _sampler_factory(cfg: Config, model_dir: str, device: str, images: bool = False):
    """(factory, its keyword arguments, which sampler, why that one) for `cfg.sampler`.

    "auto" takes vLLM on a GPU; on a CPU the HF decode loop, measured faster there than vLLM's CPU build
    (benchmarks/vllm_sampler.py) and without its engine start-up.
    """
    if not isinstance(cfg.sampler, str):
        return (lambda: cfg.sampler), {}, type(cfg.sampler).__name__, "given (sampler=)"
    if cfg.sampler == "sglang":
        return _sglang_factory(cfg, model_dir, images)
    usable, why = vllm_sampler.available()
    if cfg.sampler == "vllm" and not usable:
        raise ValueError(f"sampler='vllm' cannot run here: {why}")
    if cfg.sampler == "vllm" or (cfg.sampler == "auto" and usable and device == "cuda"):
        longest = cfg.max_prompt_tokens and cfg.max_prompt_tokens + cfg.max_new_tokens
        settings = dict(kv_cache_bytes=cfg.vllm_kv_cache_bytes, max_model_len=cfg.vllm_max_model_len or longest,
                        enforce_eager=cfg.vllm_enforce_eager, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                        sleep_mode=cfg.vllm_sleep, lora=cfg.lora)
        return VLLMSampler.from_pretrained, dict(model_dir=model_dir, **settings), "vllm", why
    reason = ("asked for (sampler='hf')" if cfg.sampler == "hf" else why if not usable
              else "on CPU the hf sampler is faster (benchmarks/vllm_sampler.py)")
    return (HFSampler.from_pretrained, dict(model_dir=model_dir, device=device, precision=cfg.precision, lora=cfg.lora),
            "hf", reason)


def _sglang_factory(cfg: Config, model_dir: str, images: bool):
    """`_sampler_factory` for sampler="sglang": SGLang's engine, or a ValueError naming what keeps it from this run."""
    usable, why = sglang_sampler.available()
    missing = (why if not usable else "prompts with images (not passed to SGLang yet)" if images
               else "LoRA on a CPU (SGLang's adapter manager takes CUDA)" if cfg.lora is not None
               and not torch.cuda.is_available() else None)
    if missing:
        raise ValueError(f"sampler='sglang' cannot run here: {missing}")
    longest = cfg.max_prompt_tokens and cfg.max_prompt_tokens + cfg.max_new_tokens
    settings = dict(max_model_len=cfg.vllm_max_model_len or longest, dtype="bfloat16" if cfg.precision == "bf16" else "float32",
                    lora=cfg.lora)
    return SGLangSampler.from_pretrained, dict(model_dir=model_dir, **settings), "sglang", why
