"""A session's checkpoint folder: what `Session.save` writes and `Session.restore` (or a worker restart, `recover`) reads.

A folder (`step-NNNNNN/`, written atomically by `rlbench.runs.checkpoints`) holds one subfolder per trained model
(`policy/`, `reference/`, `critic/`: each worker writes its shards), the rollout mode's part (`RolloutSource.save`:
the sampler's weights when they lag the policy's, `sampler.pt`; the batch sampled for the next step under `rl.Overlap`,
`next_batch.pt`; the finished groups and in-flight prompts of `rl.Async`, `rollouts.pt`), the configuration
(`config.json`), the `SessionState` (`session.pt`) and the manifest (`manifest.json`: every part, the run, the model
and its adapter), which the damage check reads.

A folder belongs to its run: saves of other runs into its root are refused, a new session named as a run whose
folder holds an earlier run is a run of its own (`fresh_run_name`), and a session restored from a checkpoint that later
ones of its run follow is a branch, a run of its own (`settings`).
"""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path

from rlbench.models.lora import LoRA
from rlbench.runs import checkpoints
from rlbench.session import sources
from rlbench.session.state import SessionState
from rlbench.workers.build import start_workers


def save(session, root: Path, keep_last: int) -> Path:
    """Write `session`'s checkpoint under `root` (keeping the newest `keep_last` of its run); return its folder."""
    step, cfg = session.state.step_count, session.config
    about = {"model": session.model_dir, "lora": cfg.lora.to_dict() if cfg.lora else None,
             "data": session.data_digest, "changes": session.state.changes}
    with checkpoints.writing(root, step, keep_last=keep_last, run=session.state.run_name, about=about) as folder:
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


def settings(folder: Path, state: SessionState, record: dict, overrides: dict) -> dict:
    """The settings that replace saved ones in a session restored from `folder`: `overrides`, the run's name, and for
    a branch its own run and checkpoint folder. Restored from a checkpoint that later ones of its run follow, the
    session is a branch, `<run>-from-<step>` (unless `run_name` is given), so that what it saves and logs never
    mixes with the later ones, which stay as they were. ValueError when `lora` differs from the saved adapter's."""
    _check_lora(record.get("lora"), overrides)
    step, run = checkpoints.step_of(folder), state.run_name
    later = [f for f in checkpoints.step_dirs(folder.parent) if checkpoints.step_of(f) > step
             and checkpoints.run_of(f) in (None, run) and checkpoints.damage(f) is None]
    if overrides.get("run_name", run) != run:  # a run of its own, in a folder of its own
        log_dir = overrides.get("log_dir", record.get("log_dir"))
        return overrides | {"run_name": fresh_run_name(log_dir and str(log_dir), overrides["run_name"])}
    if later and "run_name" in overrides:
        raise ValueError(f"restore: run_name={run!r} would go on from step {step} in run {run}'s own folder, over its "
                         f"later checkpoints (up to {later[-1].name}) and their metrics: leave run_name out (the "
                         f"session is then a branch, {run}-from-{step}, and the later ones stay) or pick another name")
    if not later:
        return {"run_name": run} | overrides
    branch = {"run_name": _unused(f"{run}-from-{step}", lambda name: record.get("log_dir") and
                                  Path(record["log_dir"], name).exists())}
    if record.get("save_dir") and "save_dir" not in overrides:
        branch["save_dir"] = _unused(f"{record['save_dir']}-from-{step}", lambda path: Path(path).exists())
    warnings.warn(f"restored step {step} of run {run}, whose checkpoints go on to {later[-1].name}: this session is "
                  f"a branch, run {branch['run_name']!r}"
                  + (f" (checkpoints in {branch['save_dir']})" if "save_dir" in branch else "")
                  + f"; run {run}'s later checkpoints and metrics stay as they are", stacklevel=3)
    return branch | overrides


def fresh_run_name(log_dir: str | None, name: str) -> str:
    """`name`, or when its folder under `log_dir` already holds a run (a metrics log, checkpoints), the first of
    `name-2`, `name-3`, ... that holds none, with a warning naming both and the way to go on with the earlier run:
    a cell run again never mixes two runs in one folder."""
    def holds_a_run(candidate: str) -> bool:
        folder = Path(log_dir, candidate)
        log = folder / "metrics.jsonl"
        return (log.is_file() and log.stat().st_size > 0) or bool(checkpoints.step_dirs(folder / "checkpoints"))

    if log_dir is None or not holds_a_run(name):
        return name
    fresh = _unused(name, holds_a_run)
    warnings.warn(f"run folder {Path(log_dir, name)} holds an earlier run: this session is run {fresh!r} "
                  f"({Path(log_dir, fresh)}); to go on with the earlier one, "
                  f"rl.Session.restore({str(Path(log_dir, name, 'checkpoints'))!r})", stacklevel=3)
    return fresh


def record_changes(session, folder: Path, saved: dict) -> None:
    """What `session`, restored from `folder`, changed from the checkpoint's settings (`saved`, its config record):
    every Config field that differs (the run name and checkpoint folder a branch takes aside), another model folder,
    other task data (its fingerprint). Warned of, and kept in `session.state.changes` (every later checkpoint's
    session.pt and manifest.json). A changed seed takes effect on the data order at the next epoch."""
    step, now = session.state.step_count, session.config.to_record()
    objects = [name for name, value in now.items() if _is_object(value) and _is_object(saved.get(name))]
    changed = [(name, saved.get(name), value) for name, value in now.items()  # (objects: by what they hold, below)
               if name not in ("run_name", "save_dir", *objects) and saved.get(name) != value]
    manifest = json.loads((folder / checkpoints.MANIFEST).read_text())
    for name, key, value in (("model folder", "model", session.model_dir), ("task data", "data", session.data_digest)):
        if manifest.get(key) is not None and manifest[key] != value:
            changed.append((name, manifest[key], value))
    if not changed:
        return
    session.state.changes.extend({"step": step, "setting": name, "from": old, "to": new} for name, old, new in changed)
    if saved.get("seed") != session.config.seed:
        session.state.reseed(saved["seed"], session.config.seed, len(session.task.train))
    warnings.warn(f"restored step {step} of run {session.run_name} with other settings than its checkpoint's: "
                  + "; ".join(f"{name} {old!r} -> {new!r}" for name, old, new in changed)
                  + ". The run goes on with them, and records them (session.state.changes, in its later checkpoints)"
                  + (": the data order takes the new seed from the next epoch on" if saved.get("seed") != session.config.seed
                     else ""), stacklevel=3)


def _is_object(value) -> bool:
    """Whether a config record's value stands for a Python object (`Config.to_record`: its repr, not comparable)."""
    return isinstance(value, dict) and "python_object" in value


def _unused(name: str, taken) -> str:
    """`name`, or `name-2`, `name-3`, ... : the first that is not `taken`."""
    return next(candidate for candidate in (name if i == 1 else f"{name}-{i}" for i in itertools.count(1))
                if not taken(candidate))


def _check_lora(saved: dict | None, overrides: dict) -> None:
    if "lora" not in overrides:
        return
    given, saved = LoRA.of(overrides["lora"]), LoRA.of(saved)
    if given == saved:
        return
    if saved is None or given is None:
        held = "a full model's weights, no adapter" if saved is None else f"an adapter, {saved!r}"
    else:
        held = "an adapter trained with " + ", ".join(f"{name}={getattr(saved, name)!r}" for name in
                                                      ("rank", "alpha", "target_modules")
                                                      if getattr(saved, name) != getattr(given, name))
    raise ValueError(f"restore: lora={given!r}, but the checkpoint holds {held}: the policy restored would not be "
                     f"the one saved (another alpha rescales every trained delta, other target modules leave "
                     f"trained adapters out). Leave lora= out to restore the saved adapter, or export() the model "
                     f"and start a new run from it")


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
    state.run_name = session.state.run_name  # a branch goes on under its own name
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
