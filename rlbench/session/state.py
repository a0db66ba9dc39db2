"""`SessionState`: everything of a run that lives in the controller, not in a worker, as one object.

The counters, the data position, the metrics so far, the skipped updates, the adaptive KL coefficient and
whether the sampler holds the policy's weights. A checkpoint saves it as a whole (`session.pt`) and a
restored session loads it as a whole. There is no global RNG state in it: every random draw of the loop
(the data order, the sampling seeds, the mini-batch order) comes from a generator seeded by the run's seed
and these counters, so a restored run continues bit for bit without touching the process's RNGs.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from rlbench.algorithms import AdaptiveKL


@dataclass
class SessionState:
    run_name: str
    """The run's folder name under `log_dir` (metrics, checkpoints)."""
    step_count: int = 0
    """Steps recorded (one row of `history` each)."""
    examples_seen: int = 0
    """The data position: training examples drawn so far, over all epochs."""
    rollouts_done: int = 0
    """Rollouts sampled so far (each seeds its draws with the run's seed and this count; rollout_mode="async": groups)."""
    policy_version: int = 0
    """Policy updates applied so far: the version of the weights a sampler holds after a sync."""
    history: list[dict] = field(default_factory=list)
    """One metrics row per step."""
    skipped_updates: list[dict] = field(default_factory=list)
    """Optimizer steps skipped for a non-finite loss or gradient: {"step", "reason"} each."""
    reward_kl: AdaptiveKL | None = None
    """The KL-in-reward coefficient β (PPO's way), when the algorithm has one."""
    sampler_synced: bool = True
    """Whether the sampler holds the policy's current weights (False after `update(sync=False)`)."""
    changes: list[dict] = field(default_factory=list)
    """What restores changed from the checkpoint they went on from: {"step", "setting", "from", "to"} each."""
    order_seeds: list[list[int]] = field(default_factory=list)
    """[first epoch, seed] of each data order after a restore changed the seed (empty: the run's seed throughout)."""
    _order: tuple[int, list[int]] = field(default=(-1, []), repr=False, compare=False)
    """Cache: (epoch, its shuffled example indices)."""

    def next_examples(self, train: Sequence[dict], n: int, seed: int) -> list[dict]:
        """The next `n` training examples in a seeded order, reshuffled each epoch; advances the data position.
        An epoch's order comes from `seed`, or from the seed it began under when a restore changed it since
        (`order_seeds`): an epoch never mixes two orders, so no example is drawn twice in it."""
        out = []
        for position in range(self.examples_seen, self.examples_seen + n):
            epoch, index = divmod(position, len(train))
            if self._order[0] != epoch:
                epoch_seed = next((s for first, s in reversed(self.order_seeds) if first <= epoch), seed)
                generator = torch.Generator().manual_seed(mix(epoch_seed, epoch))
                self._order = (epoch, torch.randperm(len(train), generator=generator).tolist())
            out.append(train[self._order[1][index]])
        self.examples_seen += n
        return out

    def reseed(self, old: int, new: int, train_size: int) -> None:
        """A restore changed the run's seed from `old` to `new`: the epoch in progress keeps `old`'s order, the
        next ones take `new`'s."""
        epoch, index = divmod(self.examples_seen, train_size)
        if not self.order_seeds:
            self.order_seeds.append([0, old])
        self.order_seeds.append([epoch + (index > 0), new])

    def record_skipped(self, stats: dict, limit: int) -> None:
        """Record that the last step's optimizer step was skipped for non-finite numbers (warn); raise
        FloatingPointError past `limit` such steps (`Config.max_skipped_updates`)."""
        reason = "non-finite loss" if stats.get("nonfinite_loss") else "non-finite gradient norm"
        step = self.step_count - 1
        self.skipped_updates.append({"step": step, "reason": reason})
        skipped = len(self.skipped_updates)
        warnings.warn(f"step {step}: optimizer step skipped ({reason}); the weights are unchanged ({skipped} skipped, "
                      f"max_skipped_updates={limit})", stacklevel=4)
        if skipped > limit:
            raise FloatingPointError(
                f"{skipped} optimizer steps were skipped for non-finite numbers, more than max_skipped_updates={limit}: "
                f"{self.skipped_updates[-3:]} (latest). The weights are those before the skipped steps; look for "
                f"NaN/inf in rewards and advantages, or lower lr.")

    def save(self, path: Path) -> None:
        torch.save(self.to_dict(), path)

    def to_dict(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        return fields | {"reward_kl": None if self.reward_kl is None else dataclasses.asdict(self.reward_kl)}

    @classmethod
    def load(cls, path: Path) -> SessionState:
        """What `save` wrote (keys of older checkpoints that this version no longer keeps are ignored)."""
        saved = torch.load(path, weights_only=True)
        names = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        values = {k: v for k, v in saved.items() if k in names}
        if values.get("reward_kl") is not None:
            values["reward_kl"] = AdaptiveKL(**values["reward_kl"])
        return cls(**values)


def mix(*numbers: int) -> int:
    """A seed derived from several integers (the run's seed, a step, an epoch)."""
    seed = 0x9E3779B1
    for n in numbers:
        seed = (seed * 1_000_003 + n) % (2**63 - 1)
    return seed
