"""Where metrics rows go besides `session.metrics`: a JSONL file per run, TensorBoard, Weights & Biases.

A sink has `write(row: dict)`, `resume(rows)` (a restored session goes on from these rows; nothing on disk changes
before its next row) and `close()`. Rows are flat dicts of numbers, one per step, with a "step".
JSONL is on by default; TensorBoard and wandb are optional packages, off unless asked for (`make_sinks`).
"""

from __future__ import annotations

import json
import numbers
import os
import warnings
from pathlib import Path


class JsonlSink:
    """One JSON object per line, written per step, so a crashed run keeps every finished step.

    A write that fails (a full disk) leaves no part of its line in the file: the row is kept and written before the
    next one (or when the sink closes), so that once there is room again the file has every step, in order."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()  # later chdir()s do not move the log
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._pending: list[dict] = []
        self._resumed: list[dict] | None = None  # the rows a restored session goes on from, until its first new row

    @property
    def superseded(self) -> Path:
        """Where rows that a restored run redoes are kept: `metrics.superseded.jsonl` beside the log."""
        return self.path.with_name(f"{self.path.stem}.superseded.jsonl")

    def write(self, row: dict) -> None:
        """Append `row` (after any kept from a failed write); OSError naming the file and the steps kept when the
        write fails."""
        if self._resumed is not None:
            self._go_on_from(self._resumed)
        self._pending.append(row)
        self._flush()

    def _flush(self) -> None:
        data = "".join(json.dumps(row) + "\n" for row in self._pending).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.fstat(fd).st_size
            try:
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
            except OSError as error:
                os.ftruncate(fd, start)  # never half a line
                steps = [row.get("step") for row in self._pending]
                raise OSError(error.errno, f"{self.path}: the metrics row(s) of step {', '.join(map(str, steps))} "
                                           f"could not be written ({error.strerror}); they are kept and written "
                                           f"before the next row, or when the sink closes") from error
            self._pending.clear()
        finally:
            os.close(fd)

    def resume(self, rows: list[dict]) -> None:
        """Go on from `rows` (a checkpoint's metrics). The file is left as it is until the next row: a session
        restored only to look changes nothing. Then it holds `rows` and the new row; the lines it held past `rows`
        (steps logged after that checkpoint by a run that stopped, about to be redone) move to `superseded`,
        appended, never lost."""
        self._pending.clear()
        self._resumed = list(rows)

    def _go_on_from(self, rows: list[dict]) -> None:
        held = self.path.read_text().splitlines(keepends=True) if self.path.exists() else []
        if held[len(rows):]:
            with open(self.superseded, "a") as file:
                file.writelines(held[len(rows):])
        partial = self.path.with_suffix(".jsonl.partial")
        partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
        os.replace(partial, self.path)
        self._resumed = None

    def close(self) -> None:
        """Write the rows kept from failed writes (a warning names them if it fails again)."""
        if self._pending:
            try:
                self._flush()
            except OSError as error:
                warnings.warn(f"{self.path}: the metrics row(s) of step {', '.join(str(r.get('step')) for r in self._pending)} "
                              f"could not be written at close ({error.__cause__.strerror}): the file lacks them",
                              stacklevel=2)


def read_jsonl(path: str | Path):
    """A metrics DataFrame from a run's JSONL file (what `session.metrics` was)."""
    import pandas as pd

    return pd.DataFrame([json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()])


class TensorBoardSink:
    """Every number of a row as a TensorBoard scalar (tag = the metrics column) at its "step".

    Needs the `tensorboard` package (`pip install 'rlbench[tensorboard]'`); view with
    `tensorboard --logdir LOG_DIR`.
    """

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError("the TensorBoard sink needs the tensorboard package: "
                              "pip install 'rlbench[tensorboard]'") from error
        self.log_dir = Path(log_dir).resolve()
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, row: dict) -> None:
        for name, value in _numbers(row).items():
            self._writer.add_scalar(name, value, global_step=int(row["step"]))
        self._writer.flush()  # a step is seconds of work: make it visible at once

    def resume(self, rows: list[dict]) -> None:
        """Nothing to rewrite: redone steps are written again, and TensorBoard shows the latest value per step."""

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Every number of a row logged to a Weights & Biases run at its "step".

    Needs the `wandb` package (`pip install 'rlbench[wandb]'`) and `wandb login`, or WANDB_MODE=offline.
    `config` (e.g. the session's `Config.to_dict()`) is recorded with the run; objects become their name.
    """

    def __init__(self, project: str, name: str, *, config: dict | None = None, directory: str | Path | None = None,
                 **init_kwargs):
        try:
            import wandb
        except ImportError as error:
            raise ImportError("the wandb sink needs the wandb package: pip install 'rlbench[wandb]'") from error
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, name=name, config=_plain(config or {}),
                               dir=None if directory is None else str(directory), **init_kwargs)

    def write(self, row: dict) -> None:
        self._run.log(_numbers(row), step=int(row["step"]))

    def resume(self, rows: list[dict]) -> None:
        """Nothing to rewrite: wandb takes only increasing steps, so it logs again from past the last step it has."""

    def close(self) -> None:
        self._run.finish()


def make_sinks(log_dir: str | Path | None, run_name: str, *, tensorboard: bool = False,
               wandb_project: str | None = None, config: dict | None = None) -> list:
    """The sinks of a run: JSONL at LOG_DIR/RUN_NAME/metrics.jsonl when log_dir is set, TensorBoard events in
    the same folder when `tensorboard`, a wandb run named RUN_NAME in `wandb_project` when set."""
    if tensorboard and log_dir is None:
        raise ValueError("tensorboard=True writes its event files under log_dir: set log_dir")
    folder = None if log_dir is None else Path(log_dir) / run_name
    sinks: list = []
    if folder is not None:
        sinks.append(JsonlSink(folder / "metrics.jsonl"))
    if tensorboard:
        sinks.append(TensorBoardSink(folder))
    if wandb_project:
        sinks.append(WandbSink(wandb_project, run_name, config=config, directory=folder))
    return sinks


def _numbers(row: dict) -> dict[str, float]:
    """The numbers of a row (NaN and inf included: a diverging loss must show), except its step."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, numbers.Real)}


def _plain(value):
    """A config value wandb can store: numbers, strings and lists as they are; other objects by name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "name", None) or repr(value)
