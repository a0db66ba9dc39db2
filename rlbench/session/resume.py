"""A session's checkpoint folder: what `Session.save` writes and `Session.restore` (or a worker restart, `recover`) reads.

A folder (`step-NNNNNN/`, written atomically by `rlbench.runs.checkpoints`) holds one subfolder per trained model
(`policy/`, `reference/`, `critic/`: each worker writes its shards), the rollout mode's part (`RolloutSource.save`:
the sampler's weights when they lag the policy's, `sampler.pt`; the batch sampled for the next step under `rl.Overlap`,
`next_batch.pt`; the finished groups and in-flight prompts of `rl.Async`, `rollouts.pt`), the configuration
(`config.json`) and the `SessionState` (`session.pt`).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlbench.runs import checkpoints
from rlbench.session import sources
from rlbench.session.state import SessionState
from rlbench.workers.build import start_workers


def save(session, root: Path, keep_last: int) -> Path:
    """Write `session`'s checkpoint under `root` (keeping the newest `keep_last`); return its folder."""
    step = session.state.step_count
    with checkpoints.writing(root, step, keep_last=keep_last) as folder:
        for name, handle in session.workers.trained().items():
            handle.save_checkpoint(str(folder / name))
        (folder / "config.json").write_text(json.dumps(session.config.to_record(), indent=1))
        with session.source.frozen():  # the rollout mode's part and the data position at one moment
            session.source.save(folder)
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
    session.source.load(folder)  # (restored in another mode, batches older weights sampled are dropped)


def recover(session, root: Path) -> Path:
    """After a worker died: end every worker of `session`, start them afresh and load the latest checkpoint under
    `root`; return its folder."""
    folder, state, _ = read(root)
    session.source.stop()
    session.workers.close()
    session.source.close()
    mode = sources.mode_of(session.config)
    session.workers = start_workers(session.config, session.algorithm, session.task, session.model_dir,
                                    session.tokenizer, session.teacher_dir, rollout_workers=mode.rollout_workers())
    session.source = mode.start(session)
    load(session, folder, state)
    return folder
