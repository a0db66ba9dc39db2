import json
import os
import re
import subprocess
import sys
import warnings
import weakref
from pathlib import Path

import pytest

from rlbench.runs import folders as runs
from rlbench.runs.folders import LOCK_FILE, RunFolderBusy, RunLock, new_run_name

# A subprocess loads rlbench/runs/folders.py alone (it imports nothing of rlbench): starts in ms, not torch's seconds.
_LOAD_RUNS = ("import importlib.util, json, os, sys, time; "
              f"spec = importlib.util.spec_from_file_location('runs', {runs.__file__!r}); "
              "runs = importlib.util.module_from_spec(spec); spec.loader.exec_module(runs); ")


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _LOAD_RUNS + code], stdout=subprocess.PIPE, text=True)


def _holder(folder: Path) -> dict:
    return json.loads((folder / LOCK_FILE).read_text())


# ------------------------------------------------------------------------------------------ run names
def test_run_names_made_in_a_loop_are_unique_readable_and_sorted_by_time():
    names = [new_run_name("grpo", 0) for _ in range(1000)]  # far more than one per ms
    assert len(set(names)) == 1000
    assert names == sorted(names)  # the time stamp leads and has a fixed width
    assert all(re.fullmatch(r"\d{8}-\d{6}\.\d{3}-grpo-seed0-[0-9a-f]{6}", name) for name in names)


def test_run_names_from_two_processes_differ():
    procs = [_python("print(json.dumps([runs.new_run_name('grpo', 0) for _ in range(1000)]))") for _ in range(2)]
    first, second = (set(json.loads(proc.communicate(timeout=60)[0])) for proc in procs)
    # Started together, the two make names in the same ms: only the suffix sets them apart (P(clash) ~ 1000 / 16^6).
    assert len(first) == len(second) == 1000 and not first & second


# ------------------------------------------------------------------------------------------ RunLock
def test_lock_creates_the_folder_and_names_this_process(tmp_path):
    folder = tmp_path / "logs" / "run"
    with RunLock(folder) as lock:
        assert lock.held and _holder(folder)["pid"] == os.getpid()
    assert not lock.held and not (folder / LOCK_FILE).exists() and folder.is_dir()


def test_second_lock_in_the_same_process_is_refused_naming_the_folder(tmp_path):
    with RunLock(tmp_path) as lock:
        with pytest.raises(RunFolderBusy, match=re.escape(str(tmp_path))) as refused:
            RunLock(tmp_path).acquire()
        assert isinstance(refused.value, RuntimeError) and refused.value.pid == os.getpid()
        assert "run_name" in str(refused.value) and f"pid {os.getpid()}" in str(refused.value)
        assert lock.acquire() is lock and lock.held  # the holder itself may ask again
    RunLock(tmp_path).acquire().release()  # free once released


def test_lock_of_a_live_process_is_refused_and_taken_over_once_it_is_killed(tmp_path):
    holder = _python(f"lock = runs.RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(120)")
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid} ") as refused:
            RunLock(tmp_path).acquire()
        assert str(tmp_path) in str(refused.value) and refused.value.pid == holder.pid
    finally:
        holder.kill()  # SIGKILL: no finalizer runs, the lock file stays
        holder.wait(timeout=30)
    assert _holder(tmp_path)["pid"] == holder.pid
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dead holder's lock is taken over silently
        with RunLock(tmp_path):
            assert _holder(tmp_path)["pid"] == os.getpid()


def test_lock_left_by_a_process_that_exited_is_taken_over(tmp_path):
    left = _python(f"lock = runs.RunLock({str(tmp_path)!r}).acquire(); os._exit(0)")  # exits, not releasing
    assert left.wait(timeout=60) == 0 and _holder(tmp_path)["pid"] == left.pid
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with RunLock(tmp_path):
            assert _holder(tmp_path)["pid"] == os.getpid()


@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/stat").exists(), reason="needs /proc")
def test_lock_of_a_reused_pid_is_taken_over(tmp_path):
    """A lock naming this process's PID, written by an earlier process that had it (its start differs)."""
    with RunLock(tmp_path):
        record = _holder(tmp_path)
    started = record["process_start"]
    assert started is not None
    record |= {"token": "earlier", "process_start": started[:-1] + str((int(started[-1]) + 1) % 10)}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with RunLock(tmp_path):
        assert _holder(tmp_path)["token"] != "earlier"


@pytest.mark.parametrize("text", ["", "garbage\x00", "[1, 2]", '{"pid": "12"}'])
def test_garbled_lock_file_is_taken_over_with_a_warning(tmp_path, text):
    (tmp_path / LOCK_FILE).write_text(text)
    with pytest.warns(UserWarning, match="not a lock file"):
        lock = RunLock(tmp_path).acquire()
    assert lock.held and _holder(tmp_path)["pid"] == os.getpid()
    lock.release()


def test_release_is_idempotent_and_removes_only_its_own_lock(tmp_path):
    RunLock(tmp_path).release()  # never acquired: nothing to do
    lock = RunLock(tmp_path).acquire()
    lock.release()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()

    lock = RunLock(tmp_path).acquire()
    other = _holder(tmp_path) | {"token": "another holder's"}  # e.g. taken over while we were thought dead
    (tmp_path / LOCK_FILE).write_text(json.dumps(other))
    lock.release()
    assert _holder(tmp_path) == other


def test_release_from_a_finalizer_and_when_the_lock_is_collected(tmp_path):
    class Owner:
        pass

    owner = Owner()
    lock = RunLock(tmp_path / "a").acquire()
    weakref.finalize(owner, lock.release)  # how a session releases its lock when it is collected
    del owner
    assert not (tmp_path / "a" / LOCK_FILE).exists() and not lock.held

    RunLock(tmp_path / "b").acquire()  # no reference kept: released as it is collected
    assert not (tmp_path / "b" / LOCK_FILE).exists()


def test_lock_without_hard_links_falls_back_to_exclusive_create(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    with RunLock(tmp_path):
        assert _holder(tmp_path)["pid"] == os.getpid()
        with pytest.raises(RunFolderBusy):
            RunLock(tmp_path).acquire()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no file written aside is left


def test_stale_lock_replaced_since_it_was_read_is_not_removed(tmp_path):
    """Two processes take over one stale lock: the slower must not remove the lock the faster has just made."""
    path = tmp_path / LOCK_FILE
    path.write_text("the faster one's lock")
    runs._remove_stale(path, "the stale lock both read")
    assert path.read_text() == "the faster one's lock" and [p.name for p in tmp_path.iterdir()] == [LOCK_FILE]
    runs._remove_stale(path, "the faster one's lock")
    assert not path.exists() and not list(tmp_path.iterdir())
