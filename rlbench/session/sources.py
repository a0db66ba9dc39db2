"""Where the batches a session trains on come from: one rollout source per rollout mode.

A `RolloutMode` is a setting, `Session(rollout=rl.Sync())`, `rl.Overlap()`, `rl.Async(max_staleness=2, workers=2)`
or a mode of your own; the session calls its `start(session)` once (and again after a worker restart) for the
`RolloutSource` it then talks to. The loop asks the source for the next scored batch, runs the update inside
`source.during_update()`, and hands it new weights with `source.push(...)`; it never asks which mode it is in.
`RolloutSource` itself is the synchronous mode (sample, score, train, with the same weights), so a new mode
overrides only what it changes. A mode that replays the last batch, from outside rlbench:

    @dataclasses.dataclass(frozen=True)
    class Replay(rl.RolloutMode):
        def start(self, session):
            return ReplaySource(session)

    class ReplaySource(rl.RolloutSource):
        last = None

        def next_batch(self):
            if self.last is None:
                self.last = self.session.collect()
            return self.last

    rl.Session(..., rollout=Replay())
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from rlbench import algorithms, tasks
from rlbench.batch import Batch
from rlbench.samplers import SamplingParams
from rlbench.session.async_buffer import AsyncRollouts
from rlbench.session.prefetch import Prefetch
from rlbench.session.state import mix


class RolloutSource:
    """The loop's side of a rollout mode; as it stands, the synchronous one."""

    lags = False
    """Whether a batch may have been sampled by older weights than the ones its update starts from (then, without a
    rollout correction, PPO's old log-probs are the sampler's: the policy that sampled)."""

    def __init__(self, session):
        self.session = session

    def rollout(self) -> Batch:
        """A new batch, sampled and not scored (`Session.rollout()`): the next `prompts_per_step` examples of the
        data order, `samples_per_prompt` completions (or episodes) each, seeded by the run's seed and counters."""
        session, cfg = self.session, self.session.config
        examples = session.state.next_examples(session.task.train, cfg.prompts_per_step, cfg.seed)
        params = SamplingParams.of(cfg, n=cfg.samples_per_prompt, seed=mix(cfg.seed, session.state.rollouts_done))
        session.state.rollouts_done += 1
        return session.sample(examples, params, baseline=session.algorithm.needs_greedy_baseline)

    def next_batch(self) -> Batch:
        """The scored batch the next step trains on."""
        return self.session.collect()

    def during_update(self) -> AbstractContextManager:
        """Runs around a step's update (which leaves the sampler's weights alone until `push`)."""
        return nullcontext()

    def push(self, weights, version: int) -> None:
        """The policy's new full weights (`PolicyHandle.weights_ref()`), after `version` updates."""
        self.session.sampler.load_weights(weights)

    def paused(self) -> AbstractContextManager:
        """No sampling of the mode's own meanwhile (an evaluation uses the sampler)."""
        return nullcontext()

    def frozen(self) -> AbstractContextManager:
        """No batch drawn or finished meanwhile: a checkpoint's state and `save()` see one moment."""
        return nullcontext()

    def stats(self) -> dict[str, float]:
        """The mode's columns of a step's metrics row, since the last call."""
        return {}

    def save(self, folder: Path) -> None:
        """Write into a checkpoint folder what the mode needs to go on: the sampler's weights when they lag."""
        session = self.session
        if not session.state.sampler_synced:
            torch.save(_sampler_weights(session), folder / "sampler.pt")

    def load(self, folder: Path) -> None:
        """Take back what `save` wrote (from a checkpoint of any mode: what this one cannot use it drops), and
        give the sampler its weights."""
        session = self.session
        if (folder / "sampler.pt").is_file():
            session.sampler.load_weights(torch.load(folder / "sampler.pt", weights_only=True))
            session.state.sampler_synced = False
        else:
            session.sync_weights()

    def stop(self) -> None:
        """Start nothing more (the workers are closed next)."""

    def close(self) -> None:
        """Wait for the mode's threads, once the workers are closed."""


class OverlapSource(RolloutSource):
    """The next step's batch is sampled and scored while this step's update runs (`rlbench/session/prefetch.py`)."""

    lags = True

    def __init__(self, session):
        super().__init__(session)
        self.prefetch = Prefetch()

    def next_batch(self) -> Batch:
        batch = self.prefetch.take()
        return self.session.collect() if batch is None else batch

    def during_update(self) -> AbstractContextManager:
        session = self.session  # in one process, collecting starts at the update's first backward
        return self.prefetch.during(session.collect, None if session.workers.on_ray else session.policy.set_before_backward)

    def save(self, folder: Path) -> None:
        super().save(folder)
        if (pending := self.prefetch.pending()) is not None:
            torch.save({"tensors": pending.tensors, "lists": pending.lists, "meta": pending.meta}, folder / "next_batch.pt")

    def load(self, folder: Path) -> None:
        next_batch = folder / "next_batch.pt"
        self.prefetch.put(Batch(**torch.load(next_batch, weights_only=True)) if next_batch.is_file() else None)
        super().load(folder)

    def stop(self) -> None:
        self.prefetch.close()


class AsyncSource(RolloutSource):
    """Rollout workers sample into a buffer of finished groups while the trainer trains (`rlbench/session/async_buffer.py`);
    a step takes the oldest `prompts_per_step` groups, none more than `max_staleness` updates old."""

    lags = True

    def __init__(self, session, mode: Async):
        super().__init__(session)
        self.max_staleness = mode.max_staleness
        cfg = session.config

        def draw() -> tuple[dict, int]:
            example = session.state.next_examples(session.task.train, 1, cfg.seed)[0]
            session.state.rollouts_done += 1
            return example, mix(cfg.seed, session.state.rollouts_done - 1)

        def sample(handle, tickets, min_version: int, trained_by: int) -> Batch:
            params = SamplingParams.of(cfg, n=cfg.samples_per_prompt, seeds=tuple(t.seed for t in tickets))
            return handle.rollout([t.example for t in tickets], params, min_version, trained_by)

        self.rollouts = AsyncRollouts(session.workers.rollout, max_staleness=mode.max_staleness,
                                      groups_per_step=cfg.prompts_per_step, draw=draw, sample=sample,
                                      restart=session.workers.restart_rollout, version=session.state.policy_version)

    def rollout(self) -> Batch:
        """The buffer's next `prompts_per_step` groups, in the order they were drawn (waiting for them if sampling is
        behind), with `token_version` (the weights version that drew each token), `staleness` and `ticket`."""
        batch = self.rollouts.take(self.session.config.prompts_per_step)
        self.session.count_generated(batch)
        return self._staleness(batch)

    def push(self, weights, version: int) -> None:  # inline, a copy: the update goes on meanwhile
        self.rollouts.push(weights if self.session.workers.on_ray else {k: v.copy() for k, v in weights.items()},
                           version)

    def paused(self) -> AbstractContextManager:
        return self.rollouts.paused()

    def frozen(self) -> AbstractContextManager:
        return self.rollouts.frozen()

    def stats(self) -> dict[str, float]:
        return self.rollouts.take_stats()

    def save(self, folder: Path) -> None:  # (in-flight groups are drawn again: the sampler's weights need no saving)
        torch.save(self.rollouts.snapshot(), folder / "rollouts.pt")

    def load(self, folder: Path) -> None:
        if (folder / "rollouts.pt").is_file():
            self.rollouts.restore(torch.load(folder / "rollouts.pt", weights_only=True))
        self.session.sync_weights()

    def stop(self) -> None:
        self.rollouts.close()

    def close(self) -> None:
        self.rollouts.join()

    def _staleness(self, batch: Batch) -> Batch:
        """Add `staleness` [B] (of each row's group: the policy updates since its oldest token was drawn) and its
        summary to `meta`; RuntimeError if it exceeds `max_staleness` (the bound of `rlbench.session.async_buffer`)."""
        K, now = self.max_staleness, self.session.state.policy_version
        groups = batch["group_ids"]
        oldest_B = batch["token_version"].masked_fill(batch["response_mask"] == 0, now).amin(-1)
        oldest_G = torch.full((int(groups.max()) + 1,), now).scatter_reduce(0, groups, oldest_B, "amin")
        staleness_G, staleness_B = now - oldest_G, now - oldest_G[groups]
        if int(staleness_G.max()) > K:
            raise RuntimeError(f"rollout: group {int(staleness_G.argmax())} was drawn {int(staleness_G.max())} updates "
                               f"ago, more than max_staleness={K} (a bug in rlbench.session.async_buffer: please report it)")
        hist = torch.bincount(staleness_G, minlength=K + 1).float() / len(staleness_G)
        return batch.with_columns(staleness=staleness_B).with_meta(
            staleness_mean=algorithms.to_float(staleness_G.float().mean()), staleness_max=int(staleness_G.max()),
            **{f"staleness_{k}": algorithms.to_float(hist[k]) for k in range(K + 1)})


@dataclasses.dataclass(frozen=True)
class RolloutMode:
    """A rollout mode: its settings, and `start(session)` for its live source. Subclass it for a new mode."""

    def start(self, session) -> RolloutSource:
        return RolloutSource(session)

    def rollout_workers(self) -> int:
        """Samplers of their own that take new weights in the middle of a generation (rl.Async's rollout workers),
        built instead of the session's one sampler; 0: that one sampler."""
        return 0

    def stale_samples(self) -> bool:
        """Whether it trains on tokens that older weights drew: then the "auto" rollout correction adds token TIS to
        an algorithm without a correction of its own (when its loss takes weights)."""
        return False

    def check(self, cfg, algorithm, task) -> None:
        """ValueError naming what this mode cannot run with these settings, before any worker starts."""

    def settings(self) -> dict:
        """The flat settings this mode stands for (`rollout_mode` and its knobs), kept in the configuration. A mode of
        your own samples with one sampler, as "sync" does."""
        return {"rollout_mode": "sync"}

    def to_record(self):
        """What a checkpoint's configuration keeps of the mode: nothing for a built-in one (its flat settings say
        it all); a mode of your own is a Python object, passed again to `Session.restore`."""
        return {"python_object": repr(self)}


@dataclasses.dataclass(frozen=True)
class Sync(RolloutMode):
    """Each step samples, then trains, with the same weights."""

    def to_record(self):
        return None


@dataclasses.dataclass(frozen=True)
class Overlap(RolloutMode):
    """`step()` samples (and scores) the next step's batch while this step's update runs, in a background thread
    (a second core, or the sampler's own worker on Ray): one step off-policy, each batch sampled by the weights
    before the previous update. Its `old_logp` is the sampler's log-probs (PPO's old policy is the one that sampled;
    no forward needed), or with rollout correction the policy's own forward, the correction weights carrying the lag.
    The next batch is kept in checkpoints."""

    def start(self, session) -> RolloutSource:
        return OverlapSource(session)

    def settings(self) -> dict:
        return {"rollout_mode": "overlap"}

    def to_record(self):
        return None


@dataclasses.dataclass(frozen=True)
class Async(RolloutMode):
    """`workers` rollout workers sample continuously into a buffer of finished groups, taking new weights after every
    update in the middle of a generation (partial rollouts: `token_version` says which weights drew each token);
    `step()` trains on the oldest groups, none more than `max_staleness` updates old, waiting when sampling falls
    behind. Rollout correction is on by default (`correction`); the buffer and the in-flight prompts are kept in
    checkpoints (`rlbench/session/async_buffer.py`)."""

    max_staleness: int = 1
    """The most policy updates (one per step, all its mini-batches) between the weights that drew a group's oldest
    token and the weights it trains (0: every token drawn by the weights it trains). Sampling pauses when more groups
    would break it."""
    workers: int = 1
    """Rollout workers, each with its own sampler: a process each on Ray; inline, threads of this process, which
    share its GIL with the trainer (inline async is for stepping through and debugging, cluster="ray" for speed)."""

    def start(self, session) -> RolloutSource:
        return AsyncSource(session, self)

    def rollout_workers(self) -> int:
        return self.workers

    def stale_samples(self) -> bool:
        return True

    def check(self, cfg, algorithm, task) -> None:
        """What it does not run (yet): episodes, a greedy baseline; and a sampler object shared by several workers."""
        if isinstance(task, tasks.AgentTask):
            raise ValueError(f"rollout_mode='async' samples single completions; task {getattr(task, 'name', task)!r} "
                             f"is agentic (its episodes are played turn by turn by the controller): use "
                             f"rollout_mode='sync' or 'overlap'")
        if algorithm.needs_greedy_baseline:
            raise ValueError(f"rollout_mode='async' does not sample algorithm {algorithm.name!r}'s greedy baseline: "
                             f"use rollout_mode='sync' or 'overlap'")
        if not isinstance(cfg.sampler, str) and self.workers > 1:
            raise ValueError(f"rollout_workers={self.workers} need a sampler each: a Sampler object is one "
                             f"(use sampler='hf' or 'vllm', or rollout_workers=1)")
        if getattr(cfg.sampler, "tokens_per_update", None) is not None and algorithm.filter_groups:
            raise ValueError(f"a sampler paced by the trainer (tokens_per_update) waits for weights that dynamic "
                             f"sampling (algorithm {algorithm.name!r}) may need its groups to make: use "
                             f"seconds_per_token, or an algorithm without filter_groups")
        if cfg.sampler == "vllm" and cfg.cluster == "inline" and self.workers > 1:
            raise ValueError("vLLM runs one engine per process: rollout_workers > 1 with sampler='vllm' needs "
                             "cluster='ray'")

    def settings(self) -> dict:
        return {"rollout_mode": "async", "max_staleness": self.max_staleness, "rollout_workers": self.workers}

    def to_record(self):
        return None


def mode_of(cfg) -> RolloutMode:
    """The session's rollout mode: `rollout=` when given, else the one its flat settings name."""
    if cfg.rollout is not None:
        return cfg.rollout
    return {"sync": Sync(), "overlap": Overlap(),
            "async": Async(max_staleness=cfg.max_staleness, workers=cfg.rollout_workers)}[cfg.rollout_mode]


def _sampler_weights(session) -> dict[str, torch.Tensor]:
    """The weights the sampler holds, for a checkpoint taken while they lag the policy's."""
    try:
        return session.sampler.state_dict()
    except AttributeError as error:
        raise ValueError(f"the sampler's weights lag the policy's (update(sync=False)) and this sampler "
                         f"({session.sampler.choice}) cannot hand them over (no state_dict()): call "
                         f"sync_weights() before save()") from error
