"""The single controller: one RL iteration is `rollout -> score -> advantage -> update`.

Each method takes and returns a plain `Batch` (or a dict of metrics), so a notebook can run them one
cell at a time and look at everything in between; `step()` is the four in a row and `run()` repeats it.
The workers are reached through typed handles (`s.policy`, `s.sampler`, `s.scorer`, `s.reference`,
`s.teacher`, `s.critic`: `rlbench.workers`); the run's own state is one `SessionState` (`s.state`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import sys
import time
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from rlbench import algorithms, models, tasks
from rlbench.batch import Batch
from rlbench.config import Config, make_config, ranks_phrase
from rlbench.policy.fsdp import loss_mask
from rlbench.runs import checkpoints
from rlbench.runs.folders import RunLock, new_run_name
from rlbench.runs.progress import bar as progress_bar
from rlbench.runs.sinks import make_sinks
from rlbench.samplers import SamplingParams
from rlbench.session import interrupts, preflight, resume, sources
from rlbench.session.calls import Calls, one_at_a_time
from rlbench.session.metrics import accuracy, alarms, at_k, batch_metrics
from rlbench.session.state import SessionState, mix
from rlbench.workers.build import start_workers
from rlbench.workers.cluster import WorkerDied


class Session:
    """A policy, a sampler, a task's reward and an algorithm, stepped by you or by `run()`."""

    def __init__(self, config: Config | None = None, *, _restored: bool = False, **overrides):
        """`_restored` is `restore()`'s: the session goes on with the run in its folder (any other session named as a
        run whose folder holds one is a new run, `resume.fresh_run_name`)."""
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be an rl.Config or None, got {type(config).__name__}")
        settings, task, self.task_settings = preflight.task_settings(config, overrides)
        """The settings this session took from its task (`rl.tasks.settings_of`), those it was not given."""
        self.config = cfg = make_config(**settings)
        for moved in preflight.flat_keywords(cfg, overrides):
            warnings.warn(moved, DeprecationWarning, stacklevel=2)
        self.algorithm = preflight.with_correction(algorithms.get(cfg.algorithm), cfg)
        self.task, self.model_dir, self.tokenizer = preflight.prepare(cfg, self.algorithm, task)
        self.teacher_dir = preflight.teacher(cfg, self.tokenizer, self.task)
        self.identity = {"model": self.model_dir, "tokenizer": f"{type(self.tokenizer).__name__}, {len(self.tokenizer)} tokens",
                         "task": tasks.fingerprint(self.task)}
        """What the batches of this session carry (`meta["session"]`): its stages refuse another session's."""
        if cfg.run_name and not _restored:  # a cell run again is a new run: never two in one folder
            self.config = cfg = dataclasses.replace(cfg, run_name=resume.fresh_run_name(cfg.log_dir, cfg.run_name))
        self.state = SessionState(run_name=cfg.run_name or new_run_name(self.algorithm.name, cfg.seed),
                                  reward_kl=self.algorithm.reward_kl_controller() if self.algorithm.reward_kl_coef else None)
        # the run folder and the checkpoint folder are this session's alone while it is open (another live
        # session's is refused, naming it)
        self._locks = [RunLock(Path(cfg.log_dir) / self.state.run_name)] if cfg.log_dir else []
        if cfg.save_dir is not None and Path(cfg.save_dir).expanduser().resolve() not in {l.folder for l in self._locks}:
            self._locks.append(RunLock(cfg.save_dir, what="checkpoint folder (save_dir)"))
        try:
            for lock in self._locks:
                lock.acquire()
            self.workers = start_workers(cfg, self.algorithm, self.task, self.model_dir, self.tokenizer, self.teacher_dir,
                                         rollout_workers=sources.mode_of(cfg).rollout_workers())
        except BaseException:
            for lock in self._locks:
                lock.release()
            raise
        report = self.workers.template_report(self.task.train[0])  # not append-only: the model sees other tokens
        if report is not None and not report.ok:
            warnings.warn(f"task {self.task.name!r} with the tokenizer of {self.model_dir}: {report}", stacklevel=2)
        self.sinks = make_sinks(cfg.log_dir, self.state.run_name, tensorboard=cfg.tensorboard,
                                wandb_project=cfg.wandb_project, config=cfg.to_dict())
        """Where every metrics row also goes: JSONL by default, TensorBoard and wandb when configured."""
        self.callbacks: list = []
        """Functions `f(session, row)` called after every step (the dashboard is one)."""
        self.last_batch: Batch | None = None
        self.source = sources.mode_of(cfg).start(self)
        """Where the batches come from: the rollout mode's live part (`rlbench/session/sources.py`)."""
        self._stop_requested = self._running = False
        self._aborted: str | None = None  # why the session cannot go on (a step stopped midway)
        self._timings: dict[str, float] = {}
        self._tokens_generated = 0  # response tokens sampled since the step began (extra rounds, baselines too)
        self._alarmed: set[str] = set()  # the kinds of `alarms` already warned of (once each per session)
        self._mark = secrets.token_hex(8)  # this session's mark on the batches it trained on (`update`)
        self.calls = Calls()
        """Which thread is inside this session's calls: one at a time (`rlbench/session/calls.py`)."""

    # the workers, by handle (`self.workers` holds them all; a worker restart, `run(retries=...)`, makes new ones)
    policy = property(lambda self: self.workers.policy, doc="The policy's ranks (`rl.workers.PolicyHandle`).")
    sampler = property(lambda self: self.workers.sampler, doc="The sampler (`rl.workers.SamplerHandle`).")
    scorer = property(lambda self: self.workers.scorer, doc="The reward worker (`rl.workers.ScorerHandle`).")
    reference = property(lambda self: self.workers.reference, doc="The reference policy's ranks, or None.")
    critic = property(lambda self: self.workers.critic, doc="The critic's ranks, or None.")
    teacher = property(lambda self: self.workers.teacher, doc="The distillation teacher's ranks, or None.")
    step_count = property(lambda self: self.state.step_count, doc="Steps recorded so far.")
    run_name = property(lambda self: self.state.run_name, doc="The run's folder name under `log_dir`.")
    skipped_updates = property(lambda self: self.state.skipped_updates, doc="Optimizer steps skipped (non-finite).")
    history = property(lambda self: self.state.history, doc="One metrics dict per step (`metrics` as a list).")

    def close(self) -> None:
        """End every worker of this session (and the Ray instance rlbench started, once unused). Idempotent."""
        self.source.stop()
        self.workers.close()
        self.source.close()
        for sink in self.sinks:
            sink.close()
        for lock in self._locks:
            lock.release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @functools.cached_property
    def data_digest(self) -> str:
        """A hash of every example of the task (`rl.tasks.digest`): what a checkpoint records of the run's data."""
        return tasks.digest(self.task)

    # ------------------------------------------------------------------------- the four stages
    @one_at_a_time
    def rollout(self) -> Batch:
        """A new batch to train on, sampled and not scored: `prompts_per_step` prompts, `samples_per_prompt`
        completions (or episodes) of each.

        When the algorithm needs a greedy baseline (ReMax), each prompt's greedy completion comes along
        as `baseline_completion` / `baseline_finished` on every sample of its group.

        rl.Async: the buffer's next `prompts_per_step` groups, in the order they were drawn (waiting for
        them if sampling is behind), with `token_version` (the weights version that drew each token), `staleness`
        (updates between the weights that drew its group's oldest token and the current ones) and `ticket`.
        """
        with self._timed("rollout"):
            return self.source.rollout().with_meta(session=self.identity)

    def sample(self, examples: list[dict], params: SamplingParams, *, baseline: bool = False) -> Batch:
        """`params.n` completions of each example, or for an agentic task its episodes played to their ends; with
        `baseline`, the greedy one's result on every sample of its group (`Workers.sample`: the one sample path of
        rollouts and evaluation). Its tokens count towards the step's `tokens_generated`."""
        batch, tokens = self.workers.sample(examples, params, baseline=baseline, version=self.state.step_count)
        self._tokens_generated += tokens
        return batch

    def count_generated(self, batch: Batch) -> None:
        """Add the tokens of a batch sampled elsewhere (rl.Async's rollout workers) to the step's `tokens_generated`."""
        self._tokens_generated += int(batch["response_mask"].sum())

    @one_at_a_time
    def score(self, batch: Batch) -> Batch:
        """Add the task's `score` [B] (and its named components, e.g. `acc`, listed in `meta["reward_components"]`),
        `reward_error` per sample, and `reward` [B]: the score plus the algorithm's shaping (DAPO's overlong
        penalty, on an episode's longest turn), what advantages use."""
        self._check_origin(batch, "score")
        algorithm = self.algorithm
        with self._timed("score"):
            scored = self.workers.score(batch)
            reward_B = scored["score"]
            if algorithm.overlong_buffer:
                penalty_B = algorithms.overlong_penalty(self.workers.capped_lengths(batch), self.config.max_new_tokens,
                                                        algorithm.overlong_buffer, algorithm.overlong_factor)
                scored, reward_B = scored.with_columns(overlong_penalty=penalty_B), reward_B + penalty_B
            return scored.with_columns(reward=reward_B)

    @one_at_a_time
    def advantage(self, batch: Batch) -> Batch:
        """Add `old_logp`, and what the algorithm declares it needs (`ref_logp`, critic `values`, rollout
        correction weights), the teacher's `teacher_logp` with a teacher (and `teacher_topk_logp` / `teacher_topk_ids`
        `[B, T, k]` when the algorithm has forward_kl_coef), the token rewards (with KL-in-reward if declared),
        `advantages`, `returns`. Changes no session state: running it twice on a batch gives the same batch."""
        self._check_origin(batch, "advantage")
        algorithm, cfg = self.algorithm, self.config
        with self._timed("advantage"):
            mask_B_T = loss_mask(batch)  # an episode's: its sampled tokens only
            columns, meta, started = {}, {}, []
            sampler_is_old = algorithm.bypass or (self.source.lags and algorithm.correction is None)
            if sampler_is_old:  # bypass, or sampled by older weights: PPO's old (the update then measures the mismatch)
                columns["old_logp"], meta["old_logp_is_sampler"] = batch["sampler_logp"], True
            if algorithm.needs_sum_pi2 or not (sampler_is_old or cfg.on_policy_old_logp):  # (else the update's forward)
                started.append(self.policy.columns_async(batch, sum_pi2=algorithm.needs_sum_pi2))
            if self.reference is not None:  # all started before any is waited for (on Ray: no idle round trip)
                started.append(self.reference.columns_async(batch))
            if self.teacher is not None:
                topk = algorithm.teacher_topk if algorithm.forward_kl_coef else 0  # (a forward KL reads its top-k)
                started.append(self.teacher.columns_async(batch, topk=topk))
            if self.critic is not None:
                started.append(self.critic.columns_async(batch))
            for pending in started:  # (a sampler's old_logp stays: OTB's forward adds only sum_pi2 then)
                for name, value in pending.result().items():
                    columns.setdefault(name, value)
            for column in algorithm.inputs:  # an input registered from outside (`register_advantage_input`)
                if column not in columns and column not in batch and algorithms.input_provider(column) is not None:
                    columns[column] = algorithms.input_provider(column)(self, batch)
            rewards_B_T = algorithms.outcome_rewards(batch["reward"], mask_B_T)
            if self.state.reward_kl is not None:  # β moves when the update is applied (`update`)
                rewards_B_T, batch_kl = algorithms.kl_in_reward(
                    rewards_B_T, columns["old_logp"], columns["ref_logp"], mask_B_T, coef=self.state.reward_kl.coef,
                    kind=algorithm.reward_kl_estimator)
                meta |= {"reward_kl": algorithms.to_float(batch_kl), "reward_kl_coef": self.state.reward_kl.coef}
            if algorithm.correction is not None and not algorithm.bypass:  # (bypass: the loss corrects)
                weights_B_T, loss_mask_B_T, stats = algorithm.correction(columns["old_logp"], batch["sampler_logp"], mask_B_T)
                loss_mask_B_T = loss_mask_B_T * mask_B_T.to(loss_mask_B_T.dtype)
                columns |= {"correction_weights": weights_B_T, "loss_mask": loss_mask_B_T}
                meta |= {k: algorithms.to_float(v) for k, v in stats.items()}
            components = batch.meta.get("reward_components") or []
            data = {keyword: columns[column] if column in columns else batch.tensors.get(column)
                    for column, keyword in algorithms.ADVANTAGE_INPUTS.items()}
            advantages_B_T, returns_B_T = algorithm.estimate(  # rejected tokens left the mask: no advantage
                rewards_B_T, columns.get("loss_mask", mask_B_T), **data,
                reward_components_B_K=torch.stack([batch[k] for k in components], -1) if components else None)
            return batch.with_columns(**columns, token_rewards=rewards_B_T, advantages=advantages_B_T,
                                      returns=returns_B_T).with_meta(**meta)

    @one_at_a_time
    def update(self, batch: Batch, *, sync: bool = True, again: bool = False) -> dict[str, float]:
        """Optimizer step(s) over the batch (and the critic's, if any), then push the new weights to the
        sampler (unless `sync=False`); returns the metrics averaged over optimizer steps. A batch with fewer
        than `world_size x mini_batches_per_step` rows (under tensor parallel, data-parallel groups instead of ranks;
        dynamic sampling kept few groups) takes fewer steps.

        An update by hand is a step, as `step()`'s is: it counts (`step_count`), its metrics row is logged (with the
        hand-run stages' timings) and the callbacks see it, so that a `save()` after it is its own step's. A batch
        that already trained the policy is refused (a cell run twice would train on it again, on samples older
        weights drew) unless `again`.
        Ctrl-C finishes the update, then stops; twice within a second stops it at once, and the session then refuses
        to go on (update, step, save), as after a step stopped midway: see `rl.interrupts`."""
        start = time.perf_counter()
        stats = self._update(batch, sync=sync, again=again)
        self._record(batch, stats, time.perf_counter() - start)
        return stats

    def _update(self, batch: Batch, *, sync: bool, again: bool = False) -> dict[str, float]:
        if self._aborted is not None:  # (a stopped update may have left gradients that the next one would add to)
            raise RuntimeError(f"update: {self._aborted}")
        self._check_origin(batch, "update")
        trained_at = batch.meta.get("trained_at", {}).get(self._mark)
        if trained_at is not None and not again:
            raise ValueError(f"update: this batch already trained the policy, at step {trained_at}: training on it "
                             f"again is another epoch on samples that older weights drew. Roll out a new one "
                             f"(s.rollout()), or pass again=True to train on it once more")
        cfg = self.config
        # dynamic sampling may keep fewer rows than planned: then fewer mini-batches, each with a row per rank
        minis = min(cfg.mini_batches_per_step, len(batch) // cfg.data_parallel)
        if minis == 0:
            raise ValueError(f"update: the batch has {len(batch)} rows, fewer than {ranks_phrase(cfg)} (each needs a row)")
        with self._finishing("the update"):  # (inside step(): part of the step's)
            self.sampler.before_update()  # (vLLM with vllm_sleep frees the GPU it shares with the policy)
            with self._timed("update"):
                steps = []
                for epoch in range(cfg.epochs_per_step):
                    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(
                        mix(cfg.seed, self.state.step_count, epoch))) if cfg.epochs_per_step > 1 else torch.arange(len(batch))
                    for mini in batch[order].chunk(minis):
                        stats = self.policy.train_step(mini)  # forward_backward | optim_step, one call
                        steps.append(stats | (self.critic.train_mini_batch(mini) if self.critic is not None else {}))
                metrics = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]} | {
                    "skipped": sum(s["skipped"] for s in steps)}
            if "reward_kl" in batch.meta:
                self.state.reward_kl.update(batch.meta["reward_kl"], len(batch))
            self.state.policy_version += 1
            self.state.sampler_synced = False
            # (the batches made from it carry it too; another session may still train on it)
            batch.meta["trained_at"] = batch.meta.get("trained_at", {}) | {self._mark: self.state.step_count}
            if sync:
                self.sync_weights()
            return metrics

    def keep_informative_groups(self, batch: Batch) -> Batch:
        """DAPO's dynamic sampling: drop prompt groups whose rewards all equal, and roll out more prompts
        (at most `algorithm.max_filter_rounds` extra rounds) until `prompts_per_step` groups remain."""
        wanted = self.config.prompts_per_step
        kept = batch[algorithms.filter_groups(batch["reward"], batch["group_ids"])]
        rounds = 0
        while len(set(kept["group_ids"].tolist())) < wanted and rounds < self.algorithm.max_filter_rounds:
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
        store as numpy arrays, zero-copy; inline as views of the same memory. rl.Async: to every rollout
        worker, which takes them at its next token (inline, a copy: the update goes on meanwhile)."""
        with self._timed("sync"):
            self.source.push(self.policy.weights_ref(), self.state.policy_version)
        self.state.sampler_synced = True

    # --------------------------------------------------------------------------------- the loop
    @one_at_a_time
    def step(self) -> dict:
        """One RL iteration, `update(advantage(score(rollout())))`; appends and returns its row of `metrics`.
        rl.Overlap: the batch it trains on was rolled out and scored during the previous step;
        rl.Async: it was sampled in the background (`rollout()`).
        Ctrl-C finishes and records the step, then stops (twice within a second: at once, see `rl.interrupts`)."""
        if self._aborted is not None:
            raise RuntimeError(self._aborted)
        with self._finishing(f"step {self.state.step_count}"):
            return self._step()

    @contextmanager
    def _finishing(self, what: str, *, abortable: bool = True):
        """`interrupts.finishes_first(what)`; stopped midway (a double Ctrl-C), the session refuses to go on."""
        try:
            with interrupts.finishes_first(what, abortable=abortable):
                yield
        except interrupts.StepAborted as error:
            self._aborted = str(error)
            raise

    def _step(self) -> dict:
        self._timings, self._tokens_generated = {}, 0
        start = time.perf_counter()
        batch = self.advantage(self.source.next_batch())
        with self.source.during_update():  # rl.Overlap: the next batch is sampled by these weights meanwhile
            stats = self._update(batch, sync=False)
        self.sync_weights()
        return self._record(batch, stats, time.perf_counter() - start)

    @one_at_a_time
    def collect(self) -> Batch:
        """A scored batch for one step: `score(rollout())`, informative groups only under dynamic sampling."""
        batch = self.score(self.rollout())
        return self.keep_informative_groups(batch) if self.algorithm.filter_groups else batch

    def _record(self, batch: Batch, stats: dict, seconds: float) -> dict:
        """Append a step's metrics row (history, sinks, callbacks) and count the step."""
        row = {"step": self.state.step_count, "tokens_generated": self._tokens_generated} | batch_metrics(batch) | stats | {
            f"time_{k}": v for k, v in self._timings.items()} | {"time_step": seconds} | self.source.stats()
        self.state.history.append(row)
        self.state.step_count += 1
        self.last_batch = batch
        self._timings, self._tokens_generated = {}, 0  # the next step's, by hand or not, start now
        unwritten = None
        for sink in self.sinks:
            try:
                sink.write(row)
            except OSError as error:  # the step stays recorded whole: the sink keeps the row for its next write
                unwritten = error
        for callback in self.callbacks:
            callback(self, row)
        self._alarm(alarms(batch, f"step {row['step']}", self.config.max_new_tokens))
        if stats["skipped"]:
            self.state.record_skipped(stats, self.config.max_skipped_updates)
        if unwritten is not None:
            raise OSError(unwritten.errno, f"step {row['step']} is trained and recorded (session.metrics), but its "
                                           f"log is behind: {unwritten.strerror or unwritten}. Make room and go on") from unwritten
        return row

    @one_at_a_time
    def run(self, steps: int, *, progress: bool = True, retries: int = 0):
        """`steps` more iterations with a progress bar, saving a checkpoint every `save_every` steps;
        returns `metrics`.

        `retries`: when a worker dies (a Ray actor killed, a node lost), restart the workers, restore the
        latest checkpoint of `save_dir` and go on, at most this many times (a checkpoint is saved before
        the first step if there is none). `request_stop()` (e.g. the dashboard's stop button, or a
        callback) ends it after the current step. Ctrl-C ends it after the current step and the checkpoint due
        after it (twice within a second during the step: at once, see `rl.interrupts`).
        """
        self._stop_requested, self._running = False, True
        try:
            return self._run(steps, progress, retries)
        finally:
            self._running = False

    running = property(lambda self: self._running, doc="Whether `run()` is going (in this thread or another).")

    def _run(self, steps: int, progress: bool, retries: int):
        first, target = self.state.step_count, self.state.step_count + steps
        if retries and not checkpoints.step_dirs(self._save_dir()):
            self.save()
        bar = progress_bar(total=steps, desc=self.run_name, unit="step", disable=not progress)
        while self.state.step_count < target and not self._stop_requested:
            due = self.config.save_every and (self.state.step_count + 1) % self.config.save_every == 0
            try:  # Ctrl-C: the checkpoint due after the step is written before stopping too
                with interrupts.finishes_first(f"step {self.state.step_count}{' and its checkpoint' if due else ''}",
                                               abortable=False):  # (a double Ctrl-C still stops the step at once)
                    row = self.step()
                    if due:
                        self.save()
            except WorkerDied as error:
                if retries <= 0:
                    raise
                retries -= 1
                folder = resume.recover(self, self._save_dir())
                warnings.warn(f"{error}; restored {folder} and going on ({retries} retries left)", stacklevel=2)
                bar.n = max(self.state.step_count - first, 0)
                bar.refresh()
                continue
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.3f}")
        bar.close()
        return self.metrics

    def request_stop(self) -> None:
        """Ask a running `run()` to return after the step in progress (safe from callbacks and other threads)."""
        self._stop_requested = True

    # ------------------------------------------------------------------------------ checkpoints
    @one_at_a_time
    def save(self, path: str | os.PathLike | None = None, *, keep_last: int | None = None) -> Path:
        """Checkpoint everything a resumed run needs into PATH/step-NNNNNN (PATH: `save_dir`) and return it.

        Kept: the policy's weights and optimizer state, sharded (torch.distributed.checkpoint: any world
        size can load them), its LR schedule, the critic and reference where present, the sampler's weights
        when they lag the policy's, the batch sampled for the next step (rl.Overlap), the buffer of finished
        groups and the prompts of those in flight (rl.Async), the
        `SessionState` (data position, counters, metrics so far) and the configuration.
        Atomic: a crash mid-save leaves the earlier checkpoints whole. Keeps the newest `keep_last`
        (default: the config's; 0 = all). Ctrl-C (once or more) lets the save finish, then stops: a save is never
        stopped midway, which would cut a file being written. Refused after a step or update stopped midway (a
        double Ctrl-C): what it would write is not a state the run was ever in.
        """
        if self._aborted is not None:  # its weights and bookkeeping may disagree: never over a good checkpoint
            raise RuntimeError(f"save: {self._aborted}")
        keep_last = self.config.keep_last if keep_last is None else keep_last
        root = Path(path or self._save_dir()).resolve()
        with interrupts.finishes_first(f"the save of step {self.state.step_count}", abortable=False):
            return resume.save(self, root, keep_last)

    @classmethod
    def restore(cls, path: str | os.PathLike, **overrides) -> Session:
        """A session continuing from a checkpoint: a `save()` folder, or the latest one under a checkpoint
        root. Keyword arguments replace saved settings (e.g. `cluster="ray"`, `world_size=2`: the sharded
        state reloads at any world size); fields that were Python objects (a Task, an Algorithm) must be
        passed again; `lora=` must be the saved adapter's. The run goes on under its saved run_name, and exactly
        as it would have without the stop: same data order, same sampling seeds, same optimizer state. From a
        checkpoint that later ones of the run follow, the session is a branch with a run name (and checkpoint
        folder) of its own, `<run>-from-<step>`, and the later ones stay as they were. The process's global RNGs
        are not touched (the loop draws nothing from them).
        """
        folder, state, record = resume.read(path)
        session = cls(Config.from_record(record, **resume.settings(folder, state, record, overrides)), _restored=True)
        try:
            resume.load(session, folder, state)
            resume.record_changes(session, folder, record)
        except BaseException:
            session.close()
            raise
        return session

    def _save_dir(self) -> Path:
        cfg = self.config
        if cfg.save_dir is None and cfg.log_dir is None:
            raise ValueError("no place for checkpoints: pass save(path), or set save_dir (or log_dir)")
        return Path(cfg.save_dir) if cfg.save_dir is not None else Path(cfg.log_dir) / self.state.run_name / "checkpoints"

    @one_at_a_time
    def export(self, path: str | os.PathLike, *, adapter: bool = False) -> Path:
        """The policy's current weights as a Hugging Face model folder (config, safetensors, tokenizer; a
        vision-language model's image processor too), loadable by `AutoModelForCausalLM.from_pretrained`, vLLM, and
        `rl.Session(model=path)`; under LoRA the adapter merged into the base. `adapter=True` (LoRA only): the adapter alone, as a peft folder
        (`peft.PeftModel.from_pretrained(base, path)`, vLLM's `LoRARequest`)."""
        path = Path(path).resolve()
        path.mkdir(parents=True, exist_ok=True)
        self.policy.export(str(path), adapter)
        self.tokenizer.save_pretrained(path)
        if models.vision.has_vision(self.model_dir) and not adapter:  # and its image processor, to take images
            from transformers import AutoImageProcessor

            AutoImageProcessor.from_pretrained(self.model_dir, local_files_only=True).save_pretrained(path)
        return path

    # ------------------------------------------------------------------------------ looking at it
    @property
    def metrics(self):
        """One row per step: rewards, accuracy, losses, KL, entropy, clipping, grad norm, lengths, tokens generated
        (every rollout of the step: extra dynamic-sampling rounds and greedy baselines too), timings."""
        import pandas as pd

        return pd.DataFrame(self.state.history)

    def plot(self, **kwargs):
        """A matplotlib Figure of this run's metrics: reward, accuracy, KL, entropy, clip fraction, response
        length, stage timings (keyword arguments: `rl.viz.plot`)."""
        from rlbench import viz

        return viz.plot(self, **kwargs)

    def dashboard(self, **kwargs):
        """A live notebook panel over this session (`rl.viz.Dashboard`): display it, then `start(steps)`."""
        from rlbench import viz

        return viz.Dashboard(self, **kwargs)

    @one_at_a_time
    def complete(self, texts: list[str], *, max_new_tokens: int | None = None) -> list[str]:
        """Greedy completions of text prompts by the current policy (e.g. `rl.rewards.LLMJudge(generate=...)`)."""
        params = SamplingParams.of(self.config, greedy=True, max_new_tokens=max_new_tokens)
        return self.sampler.generate(texts, params)["completion"] if texts else []

    @one_at_a_time
    def evaluate(self, *, max_prompts: int | None = None, samples: int | None = None, progress: bool = False,
                 examples: Sequence[dict] | None = None) -> dict[str, float]:
        """Held-out accuracy and mean reward, greedy and sampled (`eval_samples` per prompt); with `samples=k`, k
        per prompt and also pass@k and maj@k (`metrics.at_k`). `examples`: these instead of the task's test split
        (rows as the task's, scored by its reward: e.g. its questions with the pictures blanked). rl.Async: by the
        weights the first rollout worker holds (the newest pushed), with no new group started meanwhile."""
        cfg = self.config
        source = "test examples" if examples is None else "examples given"
        given = list(self.task.test if examples is None else examples)
        examples = given[:max_prompts]
        if not examples:
            raise ValueError(f"evaluate: no held-out prompts (task {getattr(self.task, 'name', self.task)!r}: "
                             f"{len(given)} {source}, max_prompts={max_prompts})")
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
            raise ValueError(f"evaluate: samples must be a positive integer (completions per prompt), got {samples!r}")
        greedy = SamplingParams.of(cfg, greedy=True)
        sampled = SamplingParams.of(cfg, n=samples or cfg.eval_samples, seed=mix(cfg.seed, -1))
        result = {}
        with self.source.paused():  # rl.Async: no new groups meanwhile
            for mode, params in progress_bar([("greedy", greedy), ("sampled", sampled)], desc=f"{self.run_name} evaluate",
                                             disable=not progress):
                scored = self.score(self.sample(examples, params))
                self._alarm(alarms(scored, f"evaluate ({mode})", cfg.max_new_tokens))
                result[f"{mode}_accuracy"] = algorithms.to_float(accuracy(scored).mean())
                result[f"{mode}_reward"] = algorithms.to_float(scored["score"].mean())
        if samples is not None:
            result |= at_k(scored, len(examples))
        return result

    def _alarm(self, found: dict[str, str]) -> None:
        """Warn of each kind of `metrics.alarms` once per session, at the first caller outside rlbench (a cell's
        `s.step()`, `s.update(batch)` or `s.run()`, however deep the session's own calls go)."""
        package, frame, level = str(Path(__file__).parents[1]), sys._getframe(0), 1
        while frame is not None and frame.f_code.co_filename.startswith(package):
            frame, level = frame.f_back, level + 1
        for kind, message in found.items():
            if kind not in self._alarmed:
                self._alarmed.add(kind)
                warnings.warn(message, stacklevel=level)

    @one_at_a_time
    def episode(self, example: dict | None = None, *, greedy: bool = False):
        """A new episode of an agentic task to step by hand (`rl.agents.EpisodeHandle`): `ep.step()` samples a turn
        (with its tool calls), `ep.pending_tool_calls` can be edited, the next `ep.step()` runs the tools and
        appends their results; `ep.show()`, `ep.to_pandas()`, `ep.reward()`. Default example: the first test one."""
        example = example if example is not None else (self.task.test or self.task.train)[0]
        return self.workers.episode(example, greedy=greedy, version=self.state.step_count,
                                    seed=mix(self.config.seed, -2, self.state.step_count))

    def _check_origin(self, batch: Batch, stage: str) -> None:
        """ValueError when `batch` is another session's (another model, tokenizer or task: its token ids and
        examples would mean something else here)."""
        theirs = batch.meta.get("session")
        if theirs is not None and theirs != self.identity:
            raise ValueError(f"{stage}: this batch comes from another session ({theirs}), not this one "
                             f"({self.identity}): its token ids and examples mean something else here")

    @contextmanager
    def _timed(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        except WorkerDied as e:
            raise WorkerDied(f"{e} (at step {self.state.step_count}, stage {stage})") from e
        finally:
            self._timings[stage] = self._timings.get(stage, 0.0) + time.perf_counter() - start

    def __repr__(self) -> str:
        cfg = self.config
        teacher = f"teacher={cfg.teacher!r}, " if cfg.teacher is not None else ""
        taken = "".join(f", {k}={v!r} (the task's)" for k, v in self.task_settings.items())
        return (f"Session(model={cfg.model!r}, task={getattr(self.task, 'name', self.task)!r}, "
                f"algorithm={self.algorithm.name!r}, {teacher}cluster={cfg.cluster!r}, sampler={self.sampler.choice!r}"
                f"{taken}, step={self.state.step_count})")


# `help(Session)`, tab completion and IDEs show every field of `Config`, its default and its docstring
Session.__init__.__signature__ = Config.signature(Session.__init__)
Session.__init__.__doc__ = ("Start a session from a `Config` and/or keyword overrides of its fields, e.g. "
                            "`Session(model=\"tiny-arith\", algorithm=\"grpo\", cluster=\"inline\", seed=0)`.\n\n"
                            + Config.describe())
