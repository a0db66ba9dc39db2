"""Checkpoint folders: atomic writes, the latest complete one, keep the last k.

A checkpoint root holds one folder per saved step, `step-000010/`, ... Each is written under a hidden
temporary name and renamed into place when complete, so a crash mid-save leaves only a stray temporary
folder (removed by the next save) and every `step-*` folder is whole. Who writes what inside a folder
is the session's business; this module only knows folders.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

_STEP = re.compile(r"^step-(\d+)$")


def step_dirs(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint folder itself, or the latest complete checkpoint under a root; ValueError if neither."""
    path = Path(path).expanduser()
    if (path / "session.pt").is_file():
        return path
    found = step_dirs(path)
    if not found:
        problem = "does not exist" if not path.exists() else "holds no complete checkpoint (step-*/session.pt)"
        raise ValueError(f"no checkpoint at {path}: it {problem}")
    return found[-1]


@contextmanager
def writing(root: str | os.PathLike, step: int, *, keep_last: int | None = None):
    """Yield a temporary folder to write step `step`'s checkpoint into; on success rename it to
    `root/step-NNNNNN` (replacing a previous save of the same step) and delete all but the newest
    `keep_last` checkpoints. On an error the temporary folder is removed and nothing else changes."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step-*.partial-*"):  # left by a crash during an earlier save
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:06d}"
    partial = root / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        yield partial
        _sync_tree(partial)
        if final.exists():  # a second save of the same step: the new one wins
            trash = root / f".{final.name}.partial-old-{uuid.uuid4().hex[:8]}"
            final.rename(trash)
            partial.rename(final)
            shutil.rmtree(trash)
        else:
            partial.rename(final)
        _sync_dir(root)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if keep_last:
        for old in step_dirs(root)[:-keep_last]:
            shutil.rmtree(old)


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
