"""Run names, and the lock a live session holds on its run folder.

A run folder (`LOG_DIR/RUN_NAME`) holds one session's metrics and checkpoints. Two sessions sharing one
would interleave their metrics, delete each other's checkpoints (`keep_last`) and restore each other's
state, so:

- `new_run_name` gives a name no other session gets: the time to the millisecond (distinct within a
  process) and a random suffix (distinct across processes and machines);
- `RunLock` marks a folder as held by a live session: `folder/.lock` names the holder (PID, host, when
  the process started); a second lock on the folder is refused while that holder runs, and a lock left
  by a dead process (kill -9, a crashed machine) is taken over.

This module imports nothing of rlbench.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import socket
import threading
import time
import warnings
import weakref
from datetime import datetime
from pathlib import Path

LOCK_FILE = ".lock"

_last_ms = 0  # the time stamp of the last name made in this process, in ms since the epoch
_last_ms_guard = threading.Lock()


def new_run_name(algorithm: str, seed: int) -> str:
    """A new run's name, e.g. "20261201-203524.123-grpo-seed0-a3f9c2": readable, sorted by creation time.

    The time stamp (local time, in ms) is later than any other this process gave (a name made within the
    same ms as the last one gets the next ms), and the 6 random hex digits set apart names made in the
    same ms by other processes.
    """
    global _last_ms
    with _last_ms_guard:
        _last_ms = max(time.time_ns() // 1_000_000, _last_ms + 1)
        ms = _last_ms
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(ms // 1000)) + f".{ms % 1000:03d}"
    return f"{stamp}-{algorithm}-seed{seed}-{secrets.token_hex(3)}"


class RunFolderBusy(RuntimeError):
    """The run folder is held by a live session (its `RunLock`)."""

    def __init__(self, folder: Path, holder: dict, what: str = "run folder"):
        self.folder = folder
        self.pid = holder["pid"]
        elsewhere = "" if holder["host"] == socket.gethostname() else (
            " (another machine: this one cannot tell whether it still runs)")
        fix = "pick another run_name" if what == "run folder" else "pick another one"
        super().__init__(
            f"{what} {folder} is held by a live session: pid {self.pid} on {holder['host']}{elsewhere}, "
            f"since {holder['created']}. Two sessions must not share a {what.split(' (')[0]}: {fix}, or "
            f"close that session first (session.close()). If no such session runs, delete {folder / LOCK_FILE}.")


class RunLock:
    """A live session's hold on its run folder (or checkpoint folder): `folder/.lock`, naming the holding process.

    `acquire()` creates the lock file, or raises `RunFolderBusy` while another holder runs, this process
    included (two sessions in one notebook must not share a folder either). A lock whose process is gone
    (a PID that no longer runs, or now belongs to a later process) or whose file is unreadable is stale,
    and taken over. `release()` removes the file if it is still ours; it also runs when this object is
    collected or Python exits. Use it as a context manager, or call the two.
    """

    def __init__(self, folder: str | os.PathLike, what: str = "run folder"):
        self.folder = Path(folder).expanduser().resolve()  # later chdir()s do not move the lock
        self.path = self.folder / LOCK_FILE
        self.what = what
        """What the folder is, for the message when it is held (`RunFolderBusy`)."""
        self._release: weakref.finalize | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._release is not None and self._release.alive

    def acquire(self) -> RunLock:
        """Take the lock (creating the folder if need be); RunFolderBusy if a live session holds it."""
        if self.held:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(8)  # tells this hold from every other, in this process too
        record = {"pid": os.getpid(), "host": socket.gethostname(), "process_start": _process_start(os.getpid()),
                  "token": token, "created": datetime.now().isoformat(timespec="seconds")}
        while not _create_exclusive(self.path, json.dumps(record)):
            try:
                seen = self.path.read_text()
            except FileNotFoundError:  # released since: try again
                continue
            holder = _parse(seen)
            if holder is None:
                warnings.warn(f"{self.path} is not a lock file rlbench wrote ({seen[:80]!r}); taking it over as "
                              "stale", stacklevel=2)
            elif _is_running(holder):
                raise RunFolderBusy(self.folder, holder, self.what)
            _remove_stale(self.path, seen)
        self._release = weakref.finalize(self, _remove_if_ours, self.path, token)
        return self

    def release(self) -> None:
        """Remove the lock file if it is still ours. Idempotent."""
        if self._release is not None:
            self._release()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"RunLock({str(self.folder)!r}, held={self.held})"


def _create_exclusive(path: Path, text: str) -> bool:
    """Create `path` holding `text`; False if it exists. Atomic: no reader sees it half written (it is
    written aside, then hard-linked into place; where the file system has no hard links, O_EXCL then write)."""
    aside = path.with_name(f"{path.name}.new-{secrets.token_hex(4)}")
    aside.write_text(text)
    try:
        os.link(aside, path)
    except FileExistsError:
        return False
    except OSError:  # no hard links on this file system
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as file:
            file.write(text)
    finally:
        aside.unlink()
    return True


def _parse(text: str) -> dict | None:
    """A lock file's holder record; None if the text is not one."""
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    needed = {"pid": int, "host": str, "token": str, "created": str}
    if not isinstance(holder, dict) or not all(isinstance(holder.get(k), t) for k, t in needed.items()):
        return None
    return holder


def _is_running(holder: dict) -> bool:
    """Whether the process a lock names still runs (on another machine: assumed so, as this one cannot tell)."""
    if holder["host"] != socket.gethostname():
        return True
    if holder.get("process_start") is not None:  # written where /proc tells: a reused PID has another start
        return _process_start(holder["pid"]) == holder["process_start"]
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _process_start(pid: int) -> str | None:
    """When process `pid` started, as "boot id:clock ticks since boot" (a later process given the same PID
    has another); None if it does not run (or has exited, unreaped), or where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # fields 3 (state) on: the name before may hold spaces
    return None if fields[0] == "Z" else f"{_boot_id()}:{fields[19]}"  # field 22: starttime


@functools.cache
def _boot_id() -> str:
    """This boot's id: clock ticks since boot start again at each boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _remove_stale(path: Path, seen: str) -> None:
    """Remove the lock file at `path` if it still holds `seen` (a stale lock). It is moved aside first, so
    of two processes taking over the same stale lock at once one removes it, and the other does not remove
    the lock the first has made since (it moves it back)."""
    aside = path.with_name(f"{path.name}.stale-{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # removed by another process first
        return
    if aside.read_text() == seen:
        aside.unlink()
    else:
        os.rename(aside, path)


def _remove_if_ours(path: Path, token: str) -> None:
    """Remove the lock file at `path` if it is the hold `token` of this process (not a later holder's; not
    the parent's, in a forked child)."""
    try:
        holder = _parse(path.read_text())
    except OSError:
        return
    if holder is not None and holder["token"] == token and holder["pid"] == os.getpid():
        path.unlink(missing_ok=True)
