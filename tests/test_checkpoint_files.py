"""Damaged checkpoint folders and full disks: `checkpoints.damage` names the broken file without loading any
weights, `resolve` falls back to the newest complete checkpoint, a broken model folder fails to load as an
Exception naming it, and a disk without room says so before (or while) writing."""

import errno
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from rlbench.runs import checkpoints
from rlbench.policy import checkpoint


def _save(root: Path, step: int) -> Path:
    """A checkpoint laid out as Session.save writes one, with a Linear layer as the policy (one rank, as
    inline: no process group)."""
    with checkpoints.writing(root, step) as folder:
        checkpoint.save(folder / "policy", torch.nn.Linear(8, 4))
        (folder / "config.json").write_text(json.dumps({"model": "tiny-arith", "seed": step}, indent=1))
        torch.save({"step_count": step, "history": [{"step": 0, "reward_mean": 0.5}],
                    "rng": {"torch": torch.get_rng_state()}}, folder / "session.pt")
    return root / f"step-{step:06d}"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# (how the folder is damaged, what `damage` says: the file's path from the step folder's name on)
DAMAGES = {
    "missing session.pt": (lambda f: (f / "session.pt").unlink(), r"step-000002/session.pt is missing"),
    "truncated session.pt": (lambda f: _truncate(f / "session.pt"),
                             r"step-000002/session.pt is damaged or truncated \(RuntimeError: .*zip archive.*\)"),
    "garbled config.json": (lambda f: (f / "config.json").write_text('{"model": "tiny'),
                            r"step-000002/config.json is damaged or truncated \(JSONDecodeError.*\)"),
    "truncated distcp": (lambda f: _truncate(f / "policy" / "__0_0.distcp"),
                         r"step-000002/policy/__0_0\.distcp is truncated: \d+ bytes, the metadata needs \d+"),
    "missing distcp": (lambda f: (f / "policy" / "__0_0.distcp").unlink(),
                       r"step-000002/policy/__0_0\.distcp is missing"),
    "garbled metadata": (lambda f: (f / "policy" / ".metadata").write_bytes(b"garbled" * 20),
                         r"step-000002/policy/\.metadata is damaged or truncated \(UnpicklingError.*\)"),
    "missing rank0.pt": (lambda f: (f / "policy" / "rank0.pt").unlink(), r"step-000002/policy/rank0\.pt is missing"),
}


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_folder_is_named_and_the_root_falls_back_to_the_previous_one(kind, tmp_path):
    older, newer = _save(tmp_path, 1), _save(tmp_path, 2)
    assert checkpoints.damage(older) is None and checkpoints.damage(newer) is None
    spoil, reason = DAMAGES[kind]
    spoil(newer)

    assert re.fullmatch(reason, checkpoints.damage(newer))
    assert checkpoints.damage(older) is None
    with pytest.warns(UserWarning, match=f"skipping the damaged checkpoint {re.escape(str(newer))}: {reason}"):
        assert checkpoints.resolve(tmp_path) == older
    with pytest.raises(ValueError, match=f"the checkpoint {re.escape(str(newer))} is damaged: {reason}; restore "
                                         f"the previous complete checkpoint, {re.escape(str(older))}, instead"):
        checkpoints.resolve(newer)


def test_a_healthy_root_resolves_to_its_newest_checkpoint_quietly(tmp_path):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checkpoints.resolve(tmp_path) == newest
        assert checkpoints.resolve(newest) == newest


def test_a_root_without_a_complete_checkpoint_lists_every_problem(tmp_path):
    older, newer = _save(tmp_path, 1), _save(tmp_path, 2)
    (older / "session.pt").unlink()
    _truncate(newer / "policy" / "__0_0.distcp")
    with pytest.raises(ValueError) as error:
        checkpoints.resolve(tmp_path)
    assert re.fullmatch(
        f"no checkpoint under {re.escape(str(tmp_path))} is complete \\(step-000002: step-000002/policy/__0_0.distcp "
        f"is truncated: .*; step-000001: step-000001/session.pt is missing\\). Put the damaged files back from a "
        f"copy, or remove the folders and start the run afresh", str(error.value))
    with pytest.raises(ValueError, match="there is no earlier complete checkpoint in "):
        checkpoints.resolve(newer)


@pytest.mark.parametrize("kind", ["truncated distcp", "garbled metadata", "missing rank0.pt"])
def test_loading_a_damaged_model_folder_raises_an_exception_naming_it(kind, tmp_path):
    folder = _save(tmp_path, 2)
    model = torch.nn.Linear(8, 4)
    checkpoint.load(folder / "policy", model)  # whole, it loads
    DAMAGES[kind][0](folder)
    with pytest.raises(checkpoint.CheckpointError) as error:
        checkpoint.load(folder / "policy", model)
    message = str(error.value)
    assert isinstance(error.value, Exception) and error.value.__cause__ is not None
    assert message.startswith(f"cannot read the checkpoint {folder / 'policy'}: ") and "\n" not in message


def test_a_full_disk_midway_is_named_and_the_partial_folder_removed(tmp_path, monkeypatch):
    older = _save(tmp_path, 1)
    with pytest.raises(OSError) as error:
        with checkpoints.writing(tmp_path, 2):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert error.value.errno == errno.ENOSPC
    assert f"the disk holding {tmp_path} is full: writing step-000002 stopped midway" in str(error.value)

    def short_write(*args, **kwargs):  # what torch.save says when the disk fills under it
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", short_write)
    with pytest.raises(OSError, match=f"the disk holding {re.escape(str(tmp_path))} is full") as error:
        _save(tmp_path, 2)
    assert isinstance(error.value.__cause__, checkpoint.CheckpointError)  # from the policy's rank0.pt
    assert list(tmp_path.iterdir()) == [older]
    assert checkpoints.damage(older) is None


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    older = _save(tmp_path, 1)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(OSError, match=f"not enough disk space for checkpoint step-000002 under "
                                      f"{re.escape(str(tmp_path))}: 1000 bytes free, it needs about "
                                      r"\d+\.\d KiB \(the size of step-000001\)") as error:
        _save(tmp_path, 2)
    assert error.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == [older]

    fresh = tmp_path / "fresh"
    with pytest.raises(OSError, match=r"1000 bytes free, it needs about 953\.7 MiB \(expected_bytes\)"):
        with checkpoints.writing(fresh, 1, expected_bytes=10**9):
            pass
    with checkpoints.writing(fresh, 1):  # nothing to go by: no check
        pass
    with pytest.raises(OSError, match=r"to save the checkpoint .*/policy: 0\.0 MiB free, the model's state "
                                      r"needs about 4\.0 MiB"):
        checkpoint.save(tmp_path / "policy", torch.nn.Linear(1024, 1024))
