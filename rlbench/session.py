"""The single controller: one RL iteration is `rollout -> score -> advantage -> update`.

Each method takes and returns a plain `Batch` (or a dict of metrics), so a notebook can run them one
cell at a time and look at everything in between; `step()` is the four in a row and `run()` repeats it.
This is the only module that knows every part: task, sampler, reward, policy, reference, algorithm.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from rlbench import algorithms, checkpoints, models, tasks
from rlbench.batch import Batch, left_pad
from rlbench.config import Config, make_config
from rlbench.cluster import Ray, WorkerDied, WorkerGroup, acquire_ray, check_resources, release_ray
from rlbench.policy import Critic, Policy, Reference
from rlbench.policy.fsdp import loss_mask, merge_ranks, sampler_mismatch
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
        if cfg.on_policy_old_logp and (self.algorithm.correction is not None or self.algorithm.reward_kl_coef):
            raise ValueError(f"on_policy_old_logp: algorithm {self.algorithm.name!r} reads old_logp before the "
                             "update (rollout correction or KL in the reward)")
        self.task = tasks.get(cfg.task)
        _check_sampler(cfg.sampler, cfg.cluster)
        self.model_dir = str(models.resolve(cfg.model))
        self.tokenizer = models.load_tokenizer(self.model_dir)
        tasks.check_prompts(self.task)
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
        self.skipped_updates: list[dict] = []
        """Optimizer steps skipped for a non-finite loss or gradient: {"step", "reason"} each."""
        self._stop_requested = False
        self._sampler_synced = True  # False after update(sync=False): checkpoints then keep the sampler's weights
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, shuffled example indices)
        self._timings: dict[str, float] = {}
        self._tokens_generated = 0  # response tokens sampled since the step began (extra rounds, baselines too)
        self._next: Future | None = None  # overlap_rollout: the next step's batch, sampled during this update
        self._background = ThreadPoolExecutor(1, thread_name_prefix="rlbench-rollout")

    def _start_workers(self) -> None:
        """Build every worker: the policy ranks (with the reference and critic colocated on them, or in
        groups of their own), the sampler and the reward scorer; in this process or as Ray actors."""
        cfg, need = self.config, self.algorithm
        ray = cfg.cluster if isinstance(cfg.cluster, Ray) else Ray() if cfg.cluster == "ray" else None
        separate = 1 + need.needs_reference + need.needs_critic if cfg.placement == "separate" else 1
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA GPU here: use device='cpu' or 'auto'")
        device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
        gpus = 1 if device == "cuda" and ray is not None else 0
        processes = cfg.world_size * separate + 2  # policy ranks (and their reference / critic), sampler, rewards
        if ray is not None:
            acquire_ray(ray, cpus_needed=processes * cfg.cpus_per_worker)
        self._closer = weakref.finalize(self, _close_groups, self._groups, ray is not None)
        if ray is not None:
            try:
                check_resources(processes * cfg.cpus_per_worker, (processes - 1) * gpus,
                                f"world_size={cfg.world_size} (placement={cfg.placement!r}: {processes} worker "
                                f"processes at cpus_per_worker={cfg.cpus_per_worker:g})")
            except ValueError:
                self._closer()
                raise
        threads = cfg.threads or (1 if ray else min(2, os.cpu_count() or 1))
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
                                                   seed=cfg.seed, precision=cfg.precision))
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
        self._background.shutdown(wait=True)
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
            self._tokens_generated += int(batch["response_mask"].sum())
            if self.algorithm.needs_greedy_baseline:
                greedy = self.generate(examples, SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0))
                self._tokens_generated += int(greedy["response_mask"].sum())
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
            if self.config.on_policy_old_logp:
                columns = {}
            elif self.config.overlap_rollout and algorithm.correction is None:  # sampled by the previous weights
                columns = {"old_logp": batch["sampler_logp"]}
            else:
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
                baselines_B=batch.tensors.get("baseline_reward"), old_logp_B_T=columns.get("old_logp"),
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
        self._sampler_synced = False
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
        self._sampler_synced = True

    # --------------------------------------------------------------------------------- the loop
    def step(self) -> dict:
        """One RL iteration, `update(advantage(score(rollout())))`; appends and returns its row of `metrics`.
        With `overlap_rollout`, the batch it trains on was rolled out and scored during the previous step."""
        self._timings, self._tokens_generated = {}, 0
        start = time.perf_counter()
        pending, self._next = self._next, None
        batch = self.advantage(pending.result() if pending is not None else self._collect())
        if self.config.overlap_rollout:
            # the next batch comes from the weights before this update, sampled while it runs; a failure
            # there surfaces when the next step asks for the batch, after this step is recorded. In one
            # process, sampling starts at the update's backward: the sampler's many small ops and the
            # forward's contend for Python's GIL (a quarter more update time), the backward runs without it.
            start_sampling = threading.Event()
            inline = not self.workers.ray
            if inline:
                self.workers.call("policy", "set_before_backward", start_sampling.set)
            else:
                start_sampling.set()
            self._next = self._background.submit(lambda: start_sampling.wait() and self._collect())
            try:
                stats = self.update(batch, sync=False)
            finally:
                start_sampling.set()  # an update that failed before its backward
                wait([self._next])  # the sampler takes the new weights only when idle
                if inline:
                    self.workers.call("policy", "set_before_backward", None)
            self.sync_weights()
        else:
            stats = self.update(batch)
        row = {"step": self.step_count, "tokens_generated": self._tokens_generated} | batch_metrics(batch) | stats | {
            f"time_{k}": v for k, v in self._timings.items()} | {"time_step": time.perf_counter() - start}
        self.history.append(row)
        self.step_count += 1
        self.last_batch = batch
        for sink in self.sinks:
            sink.write(row)
        for callback in self.callbacks:
            callback(self, row)
        if stats["skipped"]:
            self._skipped(stats)
        return row

    def _collect(self) -> Batch:
        """A scored batch for one step: `score(rollout())`, informative groups only under dynamic sampling."""
        batch = self.score(self.rollout())
        return self.keep_informative_groups(batch) if self.algorithm.filter_groups else batch

    def run(self, steps: int, *, progress: bool = True, retries: int = 0):
        """`steps` more iterations with a progress bar, saving a checkpoint every `save_every` steps;
        returns `metrics`.

        `retries`: when a worker dies (a Ray actor killed, a node lost), restart the workers, restore the
        latest checkpoint of `save_dir` and go on, at most this many times (a checkpoint is saved before
        the first step if there is none). `request_stop()` (e.g. the dashboard's stop button, or a
        callback) ends it after the current step.
        """
        self._stop_requested = False
        first, target = self.step_count, self.step_count + steps
        if retries and not checkpoints.step_dirs(self._save_dir()):
            self.save()
        bar = tqdm(total=steps, desc="rlbench", disable=not progress)
        while self.step_count < target and not self._stop_requested:
            try:
                row = self.step()
            except WorkerDied as error:
                if retries <= 0:
                    raise
                retries -= 1
                folder = self._recover()
                warnings.warn(f"{error}; restored {folder} and going on ({retries} retries left)", stacklevel=2)
                bar.n = max(self.step_count - first, 0)
                bar.refresh()
                continue
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.3f}")
            if self.config.save_every and self.step_count % self.config.save_every == 0:
                self.save()
        bar.close()
        return self.metrics

    def request_stop(self) -> None:
        """Ask a running `run()` to return after the step in progress (safe from callbacks and other threads)."""
        self._stop_requested = True

    # ------------------------------------------------------------------------------ checkpoints
    def save(self, path: str | os.PathLike | None = None, *, keep_last: int | None = None) -> Path:
        """Checkpoint everything a resumed run needs into PATH/step-NNNNNN (PATH: `save_dir`) and return it.

        Kept: the policy's weights and optimizer state, sharded (torch.distributed.checkpoint: any world
        size can load them), its LR schedule, the critic and reference where present, the sampler's weights
        when they lag the policy's, the batch sampled for the next step (`overlap_rollout`), the data position,
        every RNG, the metrics so far and the configuration.
        Atomic: a crash mid-save leaves the earlier checkpoints whole. Keeps the newest `keep_last`
        (default: the config's; 0 = all).
        """
        root = Path(path or self._save_dir()).resolve()
        keep_last = self.config.keep_last if keep_last is None else keep_last
        with checkpoints.writing(root, self.step_count, keep_last=keep_last) as folder:
            for workers, name in self._trained_groups():
                workers.call(name, "save_checkpoint", str(folder / name))
            if not self._sampler_synced:
                torch.save(self._sampler_weights(), folder / "sampler.pt")
            if self._next is not None and self._next.exception() is None:
                next_batch = self._next.result()
                torch.save({"tensors": next_batch.tensors, "lists": next_batch.lists, "meta": next_batch.meta},
                           folder / "next_batch.pt")
            (folder / "config.json").write_text(json.dumps(self.config.to_record(), indent=1))
            torch.save(self._state(), folder / "session.pt")
        return root / f"step-{self.step_count:06d}"

    @classmethod
    def restore(cls, path: str | os.PathLike, **overrides) -> Session:
        """A session continuing from a checkpoint: a `save()` folder, or the latest one under a checkpoint
        root. Keyword arguments replace saved settings (e.g. `cluster="ray"`, `world_size=2`: the sharded
        state reloads at any world size); fields that were Python objects (a Task, an Algorithm) must be
        passed again. The run goes on under its saved run_name, and exactly as it would have without the
        stop: same data order, same sampling seeds, same optimizer state.
        """
        folder = checkpoints.resolve(path)
        state = torch.load(folder / "session.pt", weights_only=True)
        record = json.loads((folder / "config.json").read_text())
        config = Config.from_record(record, **{"run_name": state["run_name"]} | overrides)
        session = cls(**config.to_dict())
        session._load(folder, state)
        return session

    def export(self, path: str | os.PathLike) -> Path:
        """The policy's current weights as a Hugging Face model folder (config, safetensors, tokenizer),
        loadable by `AutoModelForCausalLM.from_pretrained`, vLLM, and `rl.Session(model=path)`."""
        path = Path(path).resolve()
        path.mkdir(parents=True, exist_ok=True)
        self.workers.call("policy", "export", str(path))
        self.tokenizer.save_pretrained(path)
        return path

    def _sampler_weights(self) -> dict[str, torch.Tensor]:
        """The weights the sampler holds, for a checkpoint taken while they lag the policy's."""
        try:
            return self.generation.call("sampler", "state_dict")[0]
        except AttributeError as error:
            raise ValueError(f"the sampler's weights lag the policy's (update(sync=False)) and this sampler "
                             f"({self.sampler_choice}) cannot hand them over (no state_dict()): call "
                             f"sync_weights() before save()") from error

    def _save_dir(self) -> Path:
        cfg = self.config
        if cfg.save_dir is None and cfg.log_dir is None:
            raise ValueError("no place for checkpoints: pass save(path), or set save_dir (or log_dir)")
        return Path(cfg.save_dir) if cfg.save_dir is not None else Path(cfg.log_dir) / self.run_name / "checkpoints"

    def _trained_groups(self) -> list[tuple[WorkerGroup, str]]:
        """(worker group, object name) of every model a checkpoint keeps."""
        parts = [(self.workers, "policy"), (self.reference_workers, "reference"), (self.critic_workers, "critic")]
        return [(workers, name) for workers, name in parts if workers is not None]

    def _state(self) -> dict:
        """The controller's side of a checkpoint: counters, metrics, the KL controller, its RNGs."""
        kind, key, position, has_gauss, gauss = np.random.get_state()
        return {"run_name": self.run_name, "step_count": self.step_count, "examples_seen": self.examples_seen,
                "rollouts_done": self.rollouts_done, "history": self.history,
                "skipped_updates": self.skipped_updates,
                "reward_kl": None if self.reward_kl is None else dataclasses.asdict(self.reward_kl),
                "rng": {"python": random.getstate(), "torch": torch.get_rng_state(),
                        "numpy": (kind, torch.from_numpy(key.astype(np.int64)), position, has_gauss, gauss)}}

    def _load(self, folder: Path, state: dict) -> None:
        """Put a checkpoint's state into this session's workers and controller."""
        for workers, name in self._trained_groups():
            workers.call(name, "load_checkpoint", str(folder / name))
        self.step_count, self.examples_seen = state["step_count"], state["examples_seen"]
        self.rollouts_done, self.history = state["rollouts_done"], list(state["history"])
        self.skipped_updates = list(state["skipped_updates"])
        if state["reward_kl"] is not None:
            self.reward_kl = dataclasses.replace(self.reward_kl, **state["reward_kl"])
        self._order = (-1, [])
        rng = state["rng"]
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        kind, key, position, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, key.numpy().astype(np.uint32), position, has_gauss, gauss))
        for sink in self.sinks:
            sink.resume(self.history)
        self._next = None
        # (restored without overlap_rollout, the batch the old weights sampled would be trained on as if fresh)
        if self.config.overlap_rollout and (folder / "next_batch.pt").is_file():
            self._next = Future()
            self._next.set_result(Batch(**torch.load(folder / "next_batch.pt", weights_only=True)))
        if (folder / "sampler.pt").is_file():
            self.generation.call("sampler", "load_weights", torch.load(folder / "sampler.pt", weights_only=True))
            self._sampler_synced = False
        else:
            self.sync_weights()

    def _recover(self) -> Path:
        """After a worker died: end every worker, start them afresh and load the latest checkpoint."""
        folder = checkpoints.resolve(self._save_dir())
        self._closer()
        self._start_workers()
        self._load(folder, torch.load(folder / "session.pt", weights_only=True))
        return folder

    def _skipped(self, stats: dict) -> None:
        """Record an optimizer step skipped for non-finite numbers; stop past `max_skipped_updates`."""
        reason = "non-finite loss" if stats.get("nonfinite_loss") else "non-finite gradient norm"
        self.skipped_updates.append({"step": self.step_count - 1, "reason": reason})
        limit = self.config.max_skipped_updates
        warnings.warn(f"step {self.step_count - 1}: optimizer step skipped ({reason}); the weights are unchanged "
                      f"({len(self.skipped_updates)} skipped, max_skipped_updates={limit})", stacklevel=3)
        if len(self.skipped_updates) > limit:
            raise FloatingPointError(
                f"{len(self.skipped_updates)} optimizer steps were skipped for non-finite numbers, more than "
                f"max_skipped_updates={limit}: {self.skipped_updates[-3:]} (latest). The weights are those "
                f"before the skipped steps; look for NaN/inf in rewards and advantages, or lower lr.")

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
        """One row per step: rewards, accuracy, losses, KL, entropy, clipping, grad norm, lengths, tokens generated
        (every rollout of the step: extra dynamic-sampling rounds and greedy baselines too), timings."""
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
    mismatch = {}
    if "old_logp" in batch:  # else (on_policy_old_logp) the update reports it
        mismatch = {k: float(v) for k, v in sampler_mismatch(batch["old_logp"], batch["sampler_logp"], mask_B_T).items()}
    return {
        "reward_mean": float(batch["reward"].mean()),
        "reward_std": float(batch["reward"].std()) if len(batch) > 1 else 0.0,
        "score_mean": float(batch["score"].mean()),
        "accuracy": float(_accuracy(batch).mean()),
        "reward_errors": float(sum(e is not None for e in batch["reward_error"])),
        "response_length": float(mask_B_T.sum(-1).mean()),
        "truncated_frac": float((~batch["finished"]).float().mean()),
        "advantage_abs_mean": float((batch["advantages"].abs() * mask_B_T).sum() / valid),
    } | mismatch | {k: float(v) for k, v in batch.meta.items()}


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
    return (HFSampler.from_pretrained, dict(model_dir=model_dir, device=device, precision=cfg.precision),
            f"hf: {reason}")
