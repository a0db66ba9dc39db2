"""Checkpoint folders: atomic writes, the latest complete one, keep the last k.

A checkpoint root holds one folder per saved step, `step-000010/`, ... Each is written under a hidden
temporary name and renamed into place when complete, so a crash mid-save leaves only a stray temporary
folder (removed by the next save). A folder can still be damaged later (a file deleted, a copy cut
short): `damage` checks one without loading any weights, and `resolve` passes over damaged folders to the
newest complete one (which is why `keep_last` keeps more than one).

What a folder holds is written by the session: `session.pt` (counters, RNGs, metrics), `config.json`,
one subfolder per trained model (`policy/`, `reference/`, `critic/`: torch.distributed.checkpoint's
`.metadata` and `*.distcp` shards plus each rank's `rank{r}.pt`), and optionally `sampler.pt` and
`next_batch.pt`. `writing` adds `manifest.json`: every file and folder the checkpoint must contain, the run it
belongs to and what the caller says of it (the model), so that a part deleted later is found missing.

A root holds one run's checkpoints: `writing` refuses to add a step of another run (its `keep_last` would delete
that run's checkpoints, and a restore of the root would mix the two), and counts `keep_last` over its own run.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

_STEP = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
LEGACY_PARTS = ("session.pt", "config.json", "policy")
"""What a checkpoint written before manifests must hold."""


def step_dirs(root: str | os.PathLike) -> list[Path]:
    """The checkpoint folders under `root`, oldest first (`damage` says whether each is readable)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def damage(folder: str | os.PathLike) -> str | None:
    """Why the checkpoint `folder` cannot be restored, naming the file (`step-000004/session.pt is
    missing`), or None when it is complete and readable.

    Loads the small files (`session.pt`, `config.json`, each model's `.metadata` and `rank*.pt`; the
    optional `sampler.pt` and `next_batch.pt` memory-mapped), and checks that every shard file a model's
    metadata names is there and long enough; it never reads the weights themselves.
    """
    return next(filter(None, _problems(Path(folder))), None)


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint folder `path`, or the newest complete checkpoint under the root `path`.

    Under a root, damaged newer folders are skipped with a warning naming each and why. ValueError when
    there is no checkpoint, when none under the root is complete, or when the folder `path` is damaged
    (naming the file and the previous complete checkpoint, if any).
    """
    path = Path(path).expanduser()
    if _is_checkpoint(path):
        problem = damage(path)
        if problem is not None:
            earlier = [p for p in step_dirs(path.parent) if step_of(p) < step_of(path)]
            previous = _newest_complete(earlier)
            fix = (f"restore the previous complete checkpoint, {previous}, instead" if previous is not None
                   else f"there is no earlier complete checkpoint in {path.parent}")
            raise ValueError(f"the checkpoint {path} is damaged: {problem}; {fix}")
        return path
    found = step_dirs(path)
    if not found:
        problem = "does not exist" if not path.exists() else "holds no complete checkpoint (step-*/session.pt)"
        raise ValueError(f"no checkpoint at {path}: it {problem}")
    skipped = []
    for folder in reversed(found):
        problem = damage(folder)
        if problem is None:
            for damaged, why in skipped:
                warnings.warn(f"skipping the damaged checkpoint {damaged}: {why}; using {folder.name}", stacklevel=2)
            return folder
        skipped.append((folder, problem))
    problems = "; ".join(f"{folder.name}: {why}" for folder, why in skipped)
    raise ValueError(f"no checkpoint under {path} is complete ({problems}). Put the damaged files back from a "
                     f"copy, or remove the folders and start the run afresh")


@contextmanager
def writing(root: str | os.PathLike, step: int, *, keep_last: int | None = None,
            expected_bytes: int | None = None, run: str | None = None, about: dict | None = None):
    """Yield a temporary folder to write step `step`'s checkpoint into; on success write its manifest (what it
    holds, `run`, `about`), rename it to `root/step-NNNNNN` (replacing a previous save of the same step) and delete
    all but the newest `keep_last` checkpoints of the run. On an error the temporary folder is removed and nothing
    else changes. ValueError, before anything is written, when `root` holds another run's checkpoints.

    Disk space: OSError (ENOSPC) before writing anything when the root's disk has less free than the
    newest complete checkpoint there takes (or `expected_bytes`, when there is none); a write cut short
    by a full disk is raised again as an OSError (ENOSPC) that says so.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step-*.partial-*"):  # left by a crash during an earlier save
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:06d}"
    others = {owner for folder in step_dirs(root) if (owner := run_of(folder)) not in (None, run)}
    if run is not None and others:
        raise ValueError(f"{root} holds the checkpoints of run {', '.join(sorted(others))}, and a checkpoint folder "
                         f"holds one run's (keep_last would delete the other run's, and restoring the folder would "
                         f"mix the two): save run {run} elsewhere (save(path), or save_dir=...)")
    _check_space(root, final.name, expected_bytes)
    partial = root / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        yield partial
        parts = sorted(p.name for p in partial.iterdir())
        (partial / MANIFEST).write_text(json.dumps({"step": step, "run": run, "parts": parts} | (about or {}),
                                                   indent=1))
        _sync_tree(partial)
        if final.exists():  # a second save of the same step: the new one wins
            trash = root / f".{final.name}.partial-old-{uuid.uuid4().hex[:8]}"
            final.rename(trash)
            partial.rename(final)
            shutil.rmtree(trash)
        else:
            partial.rename(final)
        _sync_dir(root)
    except BaseException as error:
        shutil.rmtree(partial, ignore_errors=True)
        if _disk_full(error):
            free = shutil.disk_usage(root).free
            raise OSError(errno.ENOSPC, f"the disk holding {root} is full: writing {final.name} stopped midway "
                                        f"(the partial folder is removed, {_size(free)} free now). Free some "
                                        f"space, or keep fewer checkpoints (keep_last), and save again") from error
        raise
    if keep_last:
        for old in [folder for folder in step_dirs(root) if run_of(folder) in (None, run)][:-keep_last]:
            shutil.rmtree(old)


def manifest(folder: str | os.PathLike) -> dict | None:
    """The checkpoint `folder`'s manifest (None for one written before manifests, or when unreadable)."""
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def run_of(folder: str | os.PathLike) -> str | None:
    """The run the checkpoint `folder` belongs to, as its manifest says (None: it does not say)."""
    return (manifest(folder) or {}).get("run")


# ---------------------------------------------------------------------------------------- checking
def _problems(folder: Path) -> Iterator[str | None]:
    """What is wrong with each part of the checkpoint `folder` (None for a part that is fine), in order."""
    if not folder.is_dir():
        yield f"{folder} is not a folder"
        return
    if (folder / MANIFEST).exists():
        yield _unreadable_json(folder / MANIFEST, folder)
    listed = manifest(folder)
    parts = listed["parts"] if listed is not None else LEGACY_PARTS
    yield next((f"{_name(folder / part, folder)} is missing" for part in parts if not (folder / part).exists()), None)
    yield _unreadable_torch(folder / "session.pt", folder)
    yield _unreadable_json(folder / "config.json", folder)
    for optional in ("sampler.pt", "next_batch.pt"):
        if (folder / optional).exists():
            yield _unreadable_torch(folder / optional, folder)
    for model in sorted(p for p in folder.iterdir() if p.is_dir()):
        yield _unreadable_model(model, folder)


def _unreadable_model(model: Path, folder: Path) -> str | None:
    """A torch.distributed.checkpoint folder: its metadata loads, every shard file it names is at least
    as long as the byte ranges it names there, and rank 0's local state (plus any other rank's) loads."""
    try:
        ranges = [(info.relative_path, info.offset + info.length)
                  for info in FileSystemReader(str(model)).read_metadata().storage_data.values()]
    except Exception as error:
        return _unreadable(model / ".metadata", folder, error)
    needed: dict[str, int] = {}
    for name, end in ranges:
        needed[name] = max(needed.get(name, 0), end)
    for name, need in sorted(needed.items()):
        shard = model / name
        if not shard.is_file():
            return f"{_name(shard, folder)} is missing"
        if (size := shard.stat().st_size) < need:
            return f"{_name(shard, folder)} is truncated: {size} bytes, the metadata needs {need}"
    ranks = {model / "rank0.pt"} | set(model.glob("rank*.pt"))
    return next(filter(None, (_unreadable_torch(path, folder) for path in sorted(ranks))), None)


def _unreadable_torch(path: Path, folder: Path) -> str | None:
    try:
        torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as error:
        return _unreadable(path, folder, error)
    return None


def _unreadable_json(path: Path, folder: Path) -> str | None:
    try:
        json.loads(path.read_text())
    except Exception as error:
        return _unreadable(path, folder, error)
    return None


def _unreadable(path: Path, folder: Path, error: Exception) -> str:
    if not path.exists():
        return f"{_name(path, folder)} is missing"
    return f"{_name(path, folder)} is damaged or truncated ({_first_line(error)})"


def _name(path: Path, folder: Path) -> str:
    """`step-000004/policy/__0_0.distcp`: the path from the checkpoint folder's name on."""
    return str(path.relative_to(folder.parent))


def _first_line(error: BaseException) -> str:
    """`RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory`: the
    error's type and first sentence."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].split('. ')[0] if lines else ''}"


def _is_checkpoint(path: Path) -> bool:
    """Whether `path` is one checkpoint folder (whole or damaged), rather than a root holding them."""
    return path.is_dir() and (bool(_STEP.match(path.name)) or (path / "session.pt").exists()
                              or (path / "config.json").exists())


def step_of(folder: Path) -> int:
    """The step of the checkpoint folder `step-NNNNNN` (-1 for another name)."""
    m = _STEP.match(folder.name)
    return int(m.group(1)) if m else -1


def _newest_complete(folders: list[Path]) -> Path | None:
    return next((folder for folder in reversed(folders) if damage(folder) is None), None)


# ---------------------------------------------------------------------------------------- disk space
def _check_space(root: Path, name: str, expected_bytes: int | None) -> None:
    """OSError (ENOSPC) when `root`'s disk has less free than a checkpoint is expected to take: the newest
    complete one under `root`, else `expected_bytes`, else nothing is checked."""
    previous = _newest_complete(step_dirs(root))
    needed = _tree_bytes(previous) if previous is not None else expected_bytes
    if needed is None:
        return
    free = shutil.disk_usage(root).free
    if free < needed:
        basis = f"the size of {previous.name}" if previous is not None else "expected_bytes"
        raise OSError(errno.ENOSPC, f"not enough disk space for checkpoint {name} under {root}: {_size(free)} "
                                    f"free, it needs about {_size(needed)} ({basis}). Free some space, or keep "
                                    f"fewer checkpoints (keep_last)")


def _disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is a write cut short by a full disk (ENOSPC, or torch's
    `unexpected pos` from a short write; a Ray worker's or dcp's error quotes the original in its text)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error) or "unexpected pos" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _tree_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _size(n_bytes: int) -> str:
    """`512 bytes`, `3.2 MiB`, `41.0 GiB`."""
    size, unit = float(n_bytes), "bytes"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{n_bytes} bytes" if unit == "bytes" else f"{size:.1f} {unit}"


# ---------------------------------------------------------------------------------------- syncing
def _sync_tree(folder: Path) -> None:
    """Flush every file and folder under `folder` to disk, so the rename never publishes half-written data."""
    paths = list(folder.rglob("*"))
    for path in paths:
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in [p for p in paths if p.is_dir()] + [folder]:
        _sync_dir(path)


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
