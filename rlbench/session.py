"""The single controller: one RL iteration is `rollout -> score -> advantage -> update`.

Each method takes and returns a plain `Batch` (or a dict of metrics), so a notebook can run them one
cell at a time and look at everything in between; `step()` is the four in a row and `run()` repeats it.
This is the only module that knows every part: task, sampler, reward, policy, reference, algorithm.
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from rlbench import algorithms, models, tasks
from rlbench.batch import Batch, left_pad
from rlbench.config import Config, make_config
from rlbench.cluster import Ray, WorkerDied, WorkerGroup, acquire_ray, release_ray
from rlbench.policy import Critic, Policy, Reference
from rlbench.policy.fsdp import loss_mask, merge_ranks
from rlbench.policy.training import OptimSettings
from rlbench.rewards import score_all
from rlbench.sinks import make_sinks
from rlbench.samplers import HFSampler, SamplingParams, VLLMSampler
from rlbench.samplers import vllm as vllm_sampler


class Session:
    """A policy, a sampler, a task's reward and an algorithm, stepped by you or by `run()`.

    Keyword arguments are the fields of `rl.config.Config` (see its docstrings), e.g.
    `Session(model="tiny-arith", task="arithmetic", algorithm="grpo", cluster="inline", seed=0)`.
    """

    def __init__(self, **kwargs):
        self._groups: list[WorkerGroup] = []
        self.config: Config = make_config(**kwargs)
        cfg = self.config
        self.algorithm = algorithms.get(cfg.algorithm)
        self.task = tasks.get(cfg.task)
        _check_sampler(cfg.sampler, cfg.cluster)
        self.model_dir = str(models.resolve(cfg.model))
        self.tokenizer = models.load_tokenizer(self.model_dir)
        self.task = tasks.limit_prompt_tokens(self.task, self.tokenizer, cfg.max_prompt_tokens, on_long=cfg.long_prompts)
        self._start_workers()
        need = self.algorithm
        self.reward_kl = need.reward_kl_controller() if need.reward_kl_coef else None
        self.run_name = cfg.run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{self.algorithm.name}-seed{cfg.seed}"
        self.step_count = 0
        self.examples_seen = 0
        self.rollouts_done = 0
        self.history: list[dict] = []
        self.last_batch: Batch | None = None
        self.callbacks: list = []
        """Functions `f(session, row)` called after every step (the dashboard is one)."""
        self.sinks = make_sinks(cfg.log_dir, self.run_name, tensorboard=cfg.tensorboard,
                                wandb_project=cfg.wandb_project, config=cfg.to_dict())
        """Where every metrics row also goes: JSONL by default, TensorBoard and wandb when configured."""
        self._stop_requested = False
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, shuffled example indices)
        self._timings: dict[str, float] = {}

    def _start_workers(self) -> None:
        """Build every worker: the policy ranks (with the reference and critic colocated on them, or in
        groups of their own), the sampler and the reward scorer; in this process or as Ray actors."""
        cfg, need = self.config, self.algorithm
        ray = cfg.cluster if isinstance(cfg.cluster, Ray) else Ray() if cfg.cluster == "ray" else None
        separate = 1 + need.needs_reference + need.needs_critic if cfg.placement == "separate" else 1
        if ray is not None:
            acquire_ray(ray, cpus_needed=(cfg.world_size * separate + 2) * cfg.cpus_per_worker)
        self._closer = weakref.finalize(self, _close_groups, self._groups, ray is not None)
        threads = cfg.threads or (1 if ray else min(2, os.cpu_count() or 1))
        device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
        gpus = 1 if device == "cuda" and ray is not None else 0
        optim = OptimSettings(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                              lr_schedule=cfg.lr_schedule, lr_warmup_steps=cfg.lr_warmup_steps,
                              lr_decay_steps=cfg.lr_decay_steps)
        common = dict(model_dir=self.model_dir, micro_batch_tokens=cfg.micro_batch_tokens, device=device)

        def group(name: str, size: int) -> WorkerGroup:
            workers = WorkerGroup(name, size, ray=ray is not None, threads=threads, cpus=cfg.cpus_per_worker,
                                  gpus=gpus if name != "rewards" else 0)
            self._groups.append(workers)
            return workers

        def ranks(workers: WorkerGroup, **kwargs) -> list[dict]:
            address = workers.rendezvous()
            return [common | kwargs | dict(rank=r, world_size=workers.size, init_method=address)
                    for r in range(workers.size)]

        self.workers = group("policy", cfg.world_size)
        self.workers.build("policy", Policy, ranks(self.workers, optim=optim, temperature=cfg.temperature,
                                                   seed=cfg.seed))
        self.reference_workers = self.critic_workers = None
        if need.needs_reference:
            self.reference_workers = group("reference", cfg.world_size) if separate > 1 else self.workers
            self.reference_workers.build("reference", Reference,
                                         ranks(self.reference_workers, temperature=cfg.temperature))
        if need.needs_critic:
            self.critic_workers = group("critic", cfg.world_size) if separate > 1 else self.workers
            self.critic_workers.build("critic", Critic, ranks(self.critic_workers, seed=cfg.seed, optim=dataclasses.replace(
                optim, lr=cfg.critic_lr or cfg.lr)))
        factory, kwargs, self.sampler_choice = _sampler_factory(cfg, self.model_dir, device)
        self.generation = group("sampler", 1)
        self.generation.build("sampler", factory, [kwargs])
        self.scoring = group("rewards", 1)
        self.scoring.build("rewards", TaskScorer, [dict(task=self.task, on_error=cfg.on_reward_error,
                                                        timeout_s=cfg.reward_timeout_s, workers=cfg.reward_workers,
                                                        processes=cfg.reward_processes)])

    def close(self) -> None:
        """End every worker of this session (and the Ray instance rlbench started, once unused). Idempotent."""
        self._closer()
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------- the four stages
    def rollout(self) -> Batch:
        """Draw `prompts_per_step` prompts and sample `samples_per_prompt` completions of each.

        When the algorithm needs a greedy baseline (ReMax), each prompt's greedy completion comes along
        as `baseline_completion` / `baseline_finished` on every sample of its group.
        """
        cfg = self.config
        with self._timed("rollout"):
            examples = self._next_examples(cfg.prompts_per_step)
            params = SamplingParams(n=cfg.samples_per_prompt, max_new_tokens=cfg.max_new_tokens,
                                    temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                    seed=_mix(cfg.seed, self.rollouts_done))
            self.rollouts_done += 1
            batch = self.generate(examples, params)
            if self.algorithm.needs_greedy_baseline:
                greedy = self.generate(examples, SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0))
                rows = batch["group_ids"]
                batch = batch.with_columns(baseline_completion=[greedy["completion"][i] for i in rows],
                                           baseline_finished=greedy["finished"][rows])
            return batch

    def score(self, batch: Batch) -> Batch:
        """Add the task's `score` [B] (and its named components, e.g. `acc`), `reward_error` per sample, and
        `reward` [B]: the score plus the algorithm's shaping (DAPO's overlong penalty), what advantages use."""
        cfg, algorithm = self.config, self.algorithm
        with self._timed("score"):
            score_B, components, errors = self._score(batch["completion"], batch["example"], batch["finished"])
            columns = {"score": score_B, "reward_error": errors, **components}
            reward_B = score_B
            if algorithm.overlong_buffer:
                penalty_B = algorithms.overlong_penalty(batch["response_mask"].sum(-1), cfg.max_new_tokens,
                                                        algorithm.overlong_buffer, algorithm.overlong_factor)
                reward_B = reward_B + penalty_B
                columns["overlong_penalty"] = penalty_B
            if "baseline_completion" in batch:
                columns["baseline_reward"], _, _ = self._score(batch["baseline_completion"], batch["example"],
                                                               batch["baseline_finished"])
            return batch.with_columns(**columns, reward=reward_B)

    def advantage(self, batch: Batch) -> Batch:
        """Add `old_logp`, and what the algorithm declares it needs (`ref_logp`, critic `values`, rollout
        correction weights), the token rewards (with KL-in-reward if declared), `advantages`, `returns`."""
        algorithm = self.algorithm
        with self._timed("advantage"):
            mask_B_T = batch["response_mask"].float()
            columns = {"old_logp": self.workers.map_rows("policy", "log_probs", batch)}
            meta = {}
            if self.reference_workers is not None:
                columns["ref_logp"] = self.reference_workers.map_rows("reference", "log_probs", batch)
            if self.critic_workers is not None:
                columns["values"] = self.critic_workers.map_rows("critic", "values", batch)
            rewards_B_T = outcome_rewards(batch["reward"], mask_B_T)
            if self.reward_kl is not None:
                rewards_B_T, batch_kl = algorithms.kl_in_reward(
                    rewards_B_T, columns["old_logp"], columns["ref_logp"], mask_B_T, coef=self.reward_kl.coef,
                    kind=algorithm.reward_kl_estimator)
                meta = {"reward_kl": float(batch_kl), "reward_kl_coef": self.reward_kl.coef}
                self.reward_kl.update(float(batch_kl), len(batch))
            if algorithm.correction is not None:
                weights_B_T, loss_mask_B_T, stats = algorithm.correction(columns["old_logp"], batch["sampler_logp"],
                                                                         mask_B_T)
                columns |= {"correction_weights": weights_B_T, "loss_mask": loss_mask_B_T}
                meta |= {k: float(v) for k, v in stats.items()}
            advantages_B_T, returns_B_T = algorithm.advantage(
                rewards_B_T, mask_B_T, group_ids=batch["group_ids"], values_B_T=columns.get("values"),
                baselines_B=batch.tensors.get("baseline_reward"), old_logp_B_T=columns["old_logp"],
                **algorithm.advantage_kwargs)
            return batch.with_columns(**columns, token_rewards=rewards_B_T, advantages=advantages_B_T,
                                      returns=returns_B_T).with_meta(**meta)

    def update(self, batch: Batch, *, sync: bool = True) -> dict[str, float]:
        """Optimizer step(s) over the batch (and the critic's, if any), then push the new weights to the
        sampler (unless `sync=False`); returns the metrics averaged over optimizer steps."""
        cfg = self.config
        if cfg.vllm_sleep and self.sampler_choice.startswith("vllm"):  # a GPU shared with the policy
            self.generation.call("sampler", "sleep")
        with self._timed("update"):
            sums: dict[str, float] = {}
            steps = 0
            for epoch in range(cfg.epochs_per_step):
                order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(
                    _mix(cfg.seed, self.step_count, epoch))) if cfg.epochs_per_step > 1 else torch.arange(len(batch))
                for mini in batch[order].chunk(cfg.mini_batches_per_step):
                    counts = dict(num_tokens=int(loss_mask(mini).sum()), num_seqs=len(mini),
                                  norm_length=self.algorithm.norm_length or cfg.max_new_tokens)
                    stats = merge_ranks(self.workers.map_shards("policy", "train_mini_batch", mini,
                                                                algorithm=self.algorithm, **counts))
                    if self.critic_workers is not None:
                        stats |= merge_ranks(self.critic_workers.map_shards(
                            "critic", "train_mini_batch", mini, mode=self.algorithm.reduction, **counts))
                    sums = {k: sums.get(k, 0.0) + v for k, v in stats.items()}
                    steps += 1
            metrics = {k: v / steps for k, v in sums.items()} | {"skipped": sums["skipped"]}
        if sync:
            self.sync_weights()
        return metrics

    def keep_informative_groups(self, batch: Batch) -> Batch:
        """DAPO's dynamic sampling: drop prompt groups whose rewards all equal, and roll out more prompts
        (at most `algorithm.max_filter_rounds` extra rounds) until `prompts_per_step` groups remain."""
        wanted = self.config.prompts_per_step
        kept = batch[algorithms.filter_groups(batch["reward"], batch["group_ids"])]
        rounds = 0
        while _groups(kept) < wanted and rounds < self.algorithm.max_filter_rounds:
            rounds += 1
            more = self.score(self.rollout())
            more = more.with_columns(group_ids=more["group_ids"] + rounds * wanted)
            kept = Batch.concat([kept, more[algorithms.filter_groups(more["reward"], more["group_ids"])]])
        if len(kept) == 0:  # no group carried signal even after the extra rounds: its advantages are all 0
            return batch.with_meta(filter_rounds=rounds, groups_kept=0)
        first = list(dict.fromkeys(kept["group_ids"].tolist()))[:wanted]
        kept = kept[torch.isin(kept["group_ids"], torch.tensor(first))]
        return kept.with_meta(filter_rounds=rounds, groups_kept=len(first))

    def sync_weights(self) -> None:
        """Send the policy's full weights (gathered on rank 0) to the sampler: on Ray through the object
        store as numpy arrays, zero-copy; inline as views of the same memory."""
        with self._timed("sync"):
            arrays = self.workers.ref("policy", "state_arrays")
            self.generation.call("sampler", "load_weights", arrays)

    # --------------------------------------------------------------------------------- the loop
    def step(self) -> dict:
        """One RL iteration; appends and returns its row of `metrics`."""
        self._timings = {}
        start = time.perf_counter()
        batch = self.score(self.rollout())
        if self.algorithm.filter_groups:
            batch = self.keep_informative_groups(batch)
        batch = self.advantage(batch)
        stats = self.update(batch)
        row = {"step": self.step_count} | batch_metrics(batch) | stats | {
            f"time_{k}": v for k, v in self._timings.items()} | {"time_step": time.perf_counter() - start}
        self.history.append(row)
        self.step_count += 1
        self.last_batch = batch
        for sink in self.sinks:
            sink.write(row)
        for callback in self.callbacks:
            callback(self, row)
        return row

    def run(self, steps: int, *, progress: bool = True):
        """`steps` more iterations with a progress bar; returns `metrics`.

        `request_stop()` (e.g. the dashboard's stop button, or a callback) ends it after the current step.
        """
        self._stop_requested = False
        bar = tqdm(range(steps), desc="rlbench", disable=not progress)
        for _ in bar:
            row = self.step()
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.3f}")
            if self._stop_requested:
                break
        bar.close()
        return self.metrics

    def request_stop(self) -> None:
        """Ask a running `run()` to return after the step in progress (safe from callbacks and other threads)."""
        self._stop_requested = True

    def plot(self, **kwargs):
        """A matplotlib Figure of this run's metrics: reward, accuracy, KL, entropy, clip fraction, response
        length, stage timings (keyword arguments: `rl.viz.plot`)."""
        from rlbench import viz

        return viz.plot(self, **kwargs)

    def dashboard(self, **kwargs):
        """A live notebook panel over this session (`rl.viz.Dashboard`): display it, then `start(steps)`."""
        from rlbench import viz

        return viz.Dashboard(self, **kwargs)

    def complete(self, texts: list[str], *, max_new_tokens: int | None = None) -> list[str]:
        """Greedy completions of text prompts by the current policy (e.g. `rl.rewards.LLMJudge(generate=...)`)."""
        params = SamplingParams(max_new_tokens=max_new_tokens or self.config.max_new_tokens, temperature=0)
        return self.generate([{"prompt": t} for t in texts], params)["completion"]

    @property
    def metrics(self):
        """One row per step: rewards, accuracy, losses, KL, entropy, clipping, grad norm, lengths, timings."""
        import pandas as pd

        return pd.DataFrame(self.history)

    def evaluate(self, *, max_prompts: int | None = None, progress: bool = False) -> dict[str, float]:
        """Held-out accuracy and mean reward, greedy and sampled (`eval_samples` per prompt)."""
        cfg = self.config
        examples = list(self.task.test)[:max_prompts]
        greedy = SamplingParams(n=1, max_new_tokens=cfg.max_new_tokens, temperature=0.0)
        sampled = SamplingParams(n=cfg.eval_samples, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                 top_p=cfg.top_p, top_k=cfg.top_k, seed=_mix(cfg.seed, -1))
        result = {}
        for mode, params in tqdm([("greedy", greedy), ("sampled", sampled)], desc="evaluate", disable=not progress):
            scored = self.score(self.generate(examples, params))
            result[f"{mode}_accuracy"] = float(_accuracy(scored).mean())
            result[f"{mode}_reward"] = float(scored["score"].mean())
        return result

    # ---------------------------------------------------------------------------- building blocks
    def generate(self, examples: list[dict], params: SamplingParams) -> Batch:
        """Sample completions of `examples`' prompts: the rollout table, before any score."""
        prompt_ids = [self.encode_prompt(e["prompt"]) for e in examples]
        out = self.generation.call("sampler", "generate", prompt_ids, params)[0]
        rows = [i for i in range(len(examples)) for _ in range(params.n)]
        ids_B_P, mask_B_P = left_pad([prompt_ids[i] for i in rows], self.tokenizer.pad_token_id)
        completions = self.tokenizer.batch_decode(
            [ids[: n - int(done)] for ids, n, done in
             zip(out["response_ids"].tolist(), out["response_mask"].sum(-1).tolist(), out["finished"].tolist())])
        return out.with_columns(
            prompt=[examples[i]["prompt"] for i in rows], completion=completions,
            group_ids=torch.tensor(rows), prompt_ids=ids_B_P, prompt_mask=mask_B_P,
            example=[examples[i] for i in rows])

    def encode_prompt(self, prompt) -> list[int]:
        """Token ids of a prompt (`rl.tasks.encode_prompt`): chat template if the tokenizer has one, else plain text."""
        return tasks.encode_prompt(self.tokenizer, prompt)

    def _score(self, completions: list[str], examples: list[dict], finished_B: torch.Tensor):
        """(score [B], components {name: [B]}, errors) of completions, from the reward worker."""
        return self.scoring.call("rewards", "score", completions, examples, finished_B)[0]

    def _next_examples(self, n: int) -> list[dict]:
        """The next `n` training examples in a seeded order, reshuffled each epoch."""
        train = self.task.train
        out = []
        for position in range(self.examples_seen, self.examples_seen + n):
            epoch, index = divmod(position, len(train))
            if self._order[0] != epoch:
                generator = torch.Generator().manual_seed(_mix(self.config.seed, epoch))
                self._order = (epoch, torch.randperm(len(train), generator=generator).tolist())
            out.append(train[self._order[1][index]])
        self.examples_seen += n
        return out

    @contextmanager
    def _timed(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        except WorkerDied as e:
            raise WorkerDied(f"{e} (at step {self.step_count}, stage {stage})") from e
        finally:
            self._timings[stage] = self._timings.get(stage, 0.0) + time.perf_counter() - start

    def __repr__(self) -> str:
        cfg = self.config
        return (f"Session(model={cfg.model!r}, task={getattr(self.task, 'name', self.task)!r}, "
                f"algorithm={self.algorithm.name!r}, cluster={cfg.cluster!r}, sampler={self.sampler_choice!r}, "
                f"step={self.step_count})")


class TaskScorer:
    """The reward worker: a task's reward over completions, with the task's rule for truncated ones."""

    def __init__(self, task, on_error: str, **runner):
        self.task, self.on_error, self.runner = task, on_error, runner

    def score(self, completions: list[str], examples: list[dict], finished_B: torch.Tensor):
        """(score [B], components {name: [B]}, errors) of completions under the task's reward."""
        scores = score_all(self.task.reward, completions, examples, on_error=self.on_error, **self.runner)
        score_B = torch.tensor(scores.score, dtype=torch.float32)
        components = {k: torch.tensor(v, dtype=torch.float32) for k, v in scores.components.items()}
        if self.task.truncated_reward is not None:  # completions cut at max_new_tokens
            score_B = score_B.masked_fill(~finished_B, self.task.truncated_reward)
            components = {k: v.masked_fill(~finished_B, 0.0) for k, v in components.items()}
        return score_B, components, scores.error


def _close_groups(groups: list[WorkerGroup], on_ray: bool) -> None:
    """End the groups' workers; release Ray (shut down if rlbench started it and no session uses it)."""
    for workers in groups:
        workers.close()
    groups.clear()
    if on_ray:
        release_ray()


def outcome_rewards(reward_B: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """Token-level rewards `[B, T]`: each sample's score on its last valid token, 0 elsewhere."""
    rewards_B_T = torch.zeros(mask_B_T.shape, dtype=torch.float32)
    last_B = (mask_B_T.sum(-1).long() - 1).clamp(min=0)
    rewards_B_T[torch.arange(len(reward_B)), last_B] = reward_B.float()
    return rewards_B_T * mask_B_T


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Per-step summaries of a scored, advantaged batch (and its whole-batch `meta` values)."""
    mask_B_T = batch["response_mask"].float()
    valid = mask_B_T.sum().clamp(min=1)
    delta_B_T = (batch["sampler_logp"] - batch["old_logp"]).abs() * mask_B_T
    return {
        "reward_mean": float(batch["reward"].mean()),
        "reward_std": float(batch["reward"].std()) if len(batch) > 1 else 0.0,
        "score_mean": float(batch["score"].mean()),
        "accuracy": float(_accuracy(batch).mean()),
        "reward_errors": float(sum(e is not None for e in batch["reward_error"])),
        "response_length": float(mask_B_T.sum(-1).mean()),
        "truncated_frac": float((~batch["finished"]).float().mean()),
        "advantage_abs_mean": float((batch["advantages"].abs() * mask_B_T).sum() / valid),
        "sampler_mismatch_mean": float(delta_B_T.sum() / valid),
        "sampler_mismatch_max": float(delta_B_T.max()),
    } | {k: float(v) for k, v in batch.meta.items()}


def _accuracy(batch: Batch) -> torch.Tensor:
    """Per-sample accuracy: the reward's "acc" component when it has one, else the task's score."""
    return batch["acc"] if "acc" in batch else batch["score"]


def _groups(batch: Batch) -> int:
    return len(set(batch["group_ids"].tolist()))


def _mix(*numbers: int) -> int:
    """A seed derived from several integers (the run's seed, a step, an epoch)."""
    seed = 0x9E3779B1
    for n in numbers:
        seed = (seed * 1_000_003 + n) % (2**63 - 1)
    return seed


def _check_sampler(sampler, cluster) -> None:
    if isinstance(sampler, str) and sampler not in ("auto", "hf", "vllm"):
        raise ValueError(f"sampler={sampler!r} is not one of: 'auto', 'hf', 'vllm' (or a Sampler object)")
    if not isinstance(sampler, str) and cluster != "inline":
        raise ValueError("a Sampler object runs in this process: use cluster='inline', or sampler='hf' / 'vllm'")


def _sampler_factory(cfg: Config, model_dir: str, device: str):
    """(factory, its keyword arguments, which sampler and why) for `cfg.sampler`.

    "auto" takes vLLM on a GPU; on a CPU the HF decode loop, measured faster there than vLLM's CPU build
    (benchmarks/vllm_sampler.py) and without its engine start-up.
    """
    if not isinstance(cfg.sampler, str):
        return (lambda: cfg.sampler), {}, f"{type(cfg.sampler).__name__} (given)"
    usable, why = vllm_sampler.available()
    if cfg.sampler == "vllm" and not usable:
        raise ValueError(f"sampler='vllm' cannot run here: {why}")
    if cfg.sampler == "vllm" or (cfg.sampler == "auto" and usable and device == "cuda"):
        longest = cfg.max_prompt_tokens and cfg.max_prompt_tokens + cfg.max_new_tokens
        settings = dict(kv_cache_bytes=cfg.vllm_kv_cache_bytes, max_model_len=cfg.vllm_max_model_len or longest,
                        enforce_eager=cfg.vllm_enforce_eager, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                        sleep_mode=cfg.vllm_sleep)
        return VLLMSampler.from_pretrained, dict(model_dir=model_dir, **settings), f"vllm: {why}"
    reason = ("asked for" if cfg.sampler == "hf" else why if not usable
              else "on CPU the hf sampler is faster (benchmarks/vllm_sampler.py)")
    return HFSampler.from_pretrained, dict(model_dir=model_dir, device=device), f"hf: {reason}"
