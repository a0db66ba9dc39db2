"""Where metrics rows go besides `session.metrics`: a JSONL file per run (more sinks plug in the same way).

A sink has `write(row: dict)` and `close()`. Rows are flat dicts of numbers (one per step).
"""

from __future__ import annotations

import json
from pathlib import Path


class JsonlSink:
    """One JSON object per line, flushed per step, so a crashed run keeps every finished step."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()  # later chdir()s do not move the log
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None

    def write(self, row: dict) -> None:
        if self._file is None:
            self._file = self.path.open("a")
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl(path: str | Path):
    """A metrics DataFrame from a run's JSONL file (what `session.metrics` was)."""
    import pandas as pd

    return pd.DataFrame([json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()])
