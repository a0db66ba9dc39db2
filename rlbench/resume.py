"""A session's checkpoint folder: what `Session.save` writes and `Session.restore` (or a worker restart) reads.

A folder (`step-NNNNNN/`, written atomically by `rlbench.checkpoints`) holds one subfolder per trained model
(`policy/`, `reference/`, `critic/`: each worker writes its shards), the sampler's weights when they lag the
policy's (`sampler.pt`), the batch sampled for the next step under rollout_mode="overlap" (`next_batch.pt`), the
finished groups and in-flight prompts of rollout_mode="async" (`rollouts.pt`), the configuration (`config.json`)
and the `SessionState` (`session.pt`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlbench import checkpoints
from rlbench.batch import Batch
from rlbench.state import SessionState


def save(session, root: Path, keep_last: int) -> Path:
    """Write `session`'s checkpoint under `root` (keeping the newest `keep_last`); return its folder."""
    step = session.state.step_count
    with checkpoints.writing(root, step, keep_last=keep_last) as folder:
        for name, handle in session.workers.trained().items():
            handle.save_checkpoint(str(folder / name))
        if not session.state.sampler_synced and session._async is None:  # (async: in-flight groups are drawn again)
            torch.save(_sampler_weights(session), folder / "sampler.pt")
        if (pending := session._prefetch.pending()) is not None:
            torch.save({"tensors": pending.tensors, "lists": pending.lists, "meta": pending.meta},
                       folder / "next_batch.pt")
        (folder / "config.json").write_text(json.dumps(session.config.to_record(), indent=1))
        if session._async is None:
            session.state.save(folder / "session.pt")
        else:  # the buffer and the data position at one moment: no group is drawn or finished meanwhile
            with session._async.frozen():
                torch.save(session._async.snapshot(), folder / "rollouts.pt")
                session.state.save(folder / "session.pt")
    return root / f"step-{step:06d}"


def read(path) -> tuple[Path, SessionState, dict]:
    """(the checkpoint folder of `path`: a folder or the latest under a root, its state, its config record)."""
    folder = checkpoints.resolve(path)
    return folder, SessionState.load(folder / "session.pt"), json.loads((folder / "config.json").read_text())


def load(session, folder: Path, state: SessionState) -> None:
    """Put a checkpoint into `session`'s workers and controller. A model the checkpoint lacks: a reference
    starts from the model as loaded (which it is); a critic cannot (ValueError naming it)."""
    trained = session.workers.trained()
    if "critic" in trained and not (folder / "critic").is_dir():
        raise ValueError(f"algorithm {session.algorithm.name!r} trains a critic, and the checkpoint {folder} has none "
                         f"(an algorithm without one saved it: its config.json names which): "
                         f"restore it with the algorithm it was saved with, or start a new run from its exported weights")
    for name, handle in trained.items():
        if (folder / name).is_dir():
            handle.load_checkpoint(str(folder / name))
    if session.state.reward_kl is None or state.reward_kl is None:  # the algorithm decides whether there is a β
        state.reward_kl = session.state.reward_kl
    session.state = state
    for sink in session.sinks:
        sink.resume(state.history)
    # (restored in another mode, the batches older weights sampled would be trained on as if fresh: dropped)
    next_batch, rollouts = folder / "next_batch.pt", folder / "rollouts.pt"
    session._prefetch.put(Batch(**torch.load(next_batch, weights_only=True))
                          if session.config.rollout_mode == "overlap" and next_batch.is_file() else None)
    if session._async is not None and rollouts.is_file():
        session._async.restore(torch.load(rollouts, weights_only=True))
    if (folder / "sampler.pt").is_file() and session._async is None:
        session.sampler.load_weights(torch.load(folder / "sampler.pt", weights_only=True))
        state.sampler_synced = False
    else:
        session.sync_weights()


def _sampler_weights(session) -> dict[str, torch.Tensor]:
    """The weights the sampler holds, for a checkpoint taken while they lag the policy's."""
    try:
        return session.sampler.state_dict()
    except AttributeError as error:
        raise ValueError(f"the sampler's weights lag the policy's (update(sync=False)) and this sampler "
                         f"({session.sampler.choice}) cannot hand them over (no state_dict()): call "
                         f"sync_weights() before save()") from error
