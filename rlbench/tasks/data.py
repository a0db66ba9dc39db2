"""Tasks from files in verl's schema, and the task that holds any list of examples.

One row (one example) of a verl parquet / JSONL file, read unchanged:

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Natalia sold clips to 48 of her friends ..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}}

The reward defaults to verl's rule: the grader registered for each row's `data_source`
(`rlbench.rewards.DATA_SOURCES`); pass `reward=` for anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import final

from rlbench.models.chat import messages_of
from rlbench.rewards import DATA_SOURCES, by_data_source

Reward = Callable[[str, dict], "float | dict"]


@final
@dataclass(frozen=True, eq=False)
class DataTask:
    """A task over given examples: what `from_parquet` / `from_jsonl` return, and what `limit_prompt_tokens`
    returns for any task (its examples, its reward)."""

    name: str
    train: tuple[dict, ...] = field(repr=False)
    test: tuple[dict, ...] = field(repr=False)
    reward: Reward = field(default=by_data_source, repr=False)
    """`(completion, example) -> float | dict`; by default verl's grader of the example's data_source."""
    truncated_reward: float | None = None
    """Score of a completion cut at max_new_tokens (None: graded like any other)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Examples left out per split by `limit_prompt_tokens(..., on_long="drop")`."""

    def __repr__(self) -> str:
        return f"DataTask({self.name!r}, train={len(self.train)}, test={len(self.test)})"


def from_parquet(path: str | os.PathLike, *, test: str | os.PathLike | float | int | None = None,
                 reward: Reward | None = None, seed: int = 0, shuffle: bool = True, name: str | None = None,
                 truncated_reward: float | None = None) -> DataTask:
    """A task from a parquet file in verl's schema.

    `test`: another file of the same schema (verl's test.parquet), or a fraction (< 1) or a number of
    rows of `path` to hold out (drawn with `seed`), or None for no held-out set. Training rows are
    shuffled with `seed` when `shuffle`. Rows are validated; an error names the file and row.
    """
    return _from_files(path, test, reward=reward, seed=seed, shuffle=shuffle, name=name,
                       truncated_reward=truncated_reward)


def from_jsonl(path: str | os.PathLike, *, test: str | os.PathLike | float | int | None = None,
               reward: Reward | None = None, seed: int = 0, shuffle: bool = True, name: str | None = None,
               truncated_reward: float | None = None) -> DataTask:
    """`from_parquet` for a JSON-lines file (one verl row per line)."""
    return _from_files(path, test, reward=reward, seed=seed, shuffle=shuffle, name=name,
                       truncated_reward=truncated_reward)


def _from_files(path, test, *, reward, seed, shuffle, name, truncated_reward) -> DataTask:
    train = read_rows(path, check_reward=reward is None)
    if isinstance(test, (int, float)) and not isinstance(test, bool):
        train, held_out = split(train, test, seed=seed)
    else:
        held_out = read_rows(test, check_reward=reward is None) if test is not None else []
    return DataTask(name=name or Path(path).stem, train=tuple(shuffled(train, seed) if shuffle else train),
                    test=tuple(held_out), reward=reward or by_data_source, truncated_reward=truncated_reward)


def read_rows(path: str | os.PathLike, *, check_reward: bool = False) -> list[dict]:
    """The rows of a verl-schema `.parquet` or `.jsonl` file as plain dicts, validated (see `check_row`)."""
    rows = read_records(path)
    for i, row in enumerate(rows):
        try:
            check_row(row, check_reward=check_reward)
        except ValueError as e:
            raise ValueError(f"row {i} of {path}: {e}") from None
    return rows


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of a `.parquet`, `.jsonl` or `.json` file (a list, or one record), or of every `.json`
    file under a directory (sorted by path, e.g. MATH's train/algebra/1.json), as plain dicts, unvalidated."""
    path = Path(path)
    if path.is_dir():
        return [record for file in sorted(path.rglob("*.json")) for record in read_records(file)]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl":
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".json":
        records = json.loads(path.read_text())
        return records if isinstance(records, list) else [records]
    raise ValueError(f"{path}: expected a .parquet, .jsonl or .json file")


def write_rows(rows: Sequence[dict], path: str | os.PathLike) -> Path:
    """Write rows to `.parquet` (nested columns as parquet structs and lists) or `.jsonl`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        raise ValueError(f"{path}: expected a .parquet or .jsonl file")
    return path


def convert_files(convert: Callable[[dict, int, str], dict],
                  inputs: dict[str, str | os.PathLike | Sequence[dict] | None], out_dir: str | os.PathLike, *,
                  suffix: str = ".parquet") -> dict[str, Path]:
    """For each split with input records (a file, or the records): `convert(record, index, split)` on each,
    written to OUT_DIR/SPLIT.parquet (what the `datasets/prepare_*.py` scripts do). Returns the files."""
    written = {}
    for split_name, source in inputs.items():
        if source is None:
            continue
        records = read_records(source) if isinstance(source, (str, os.PathLike)) else source
        rows = [convert(record, i, split_name) for i, record in enumerate(records)]
        written[split_name] = write_rows(rows, Path(out_dir) / f"{split_name}{suffix}")
    return written


def convert_main(convert: Callable[[dict, int, str], dict], description: str, what: str,
                 argv: list[str] | None = None) -> None:
    """The command line of a `datasets/prepare_*.py` script that takes a train and a test file of `what` data set:
    --train, --test (either may be left out), --out; `convert_files` on them, printing each file written."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--train", help=f"{what} train file (.jsonl / .parquet)")
    parser.add_argument("--test", help=f"{what} test file (.jsonl / .parquet)")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    for split, path in convert_files(convert, {"train": args.train, "test": args.test}, args.out).items():
        print(f"{split}: {path}")


def check_row(row: dict, *, check_reward: bool = False) -> None:
    """Raise for a row that is not verl's schema: `prompt` chat messages (or a string) and a `data_source`;
    with `check_reward`, also a `reward_model.ground_truth` and a data_source with a built-in grader."""
    if "prompt" not in row:
        raise ValueError(f"no 'prompt' column (columns: {sorted(row)})")
    if not isinstance(row["prompt"], str):
        messages_of(row["prompt"])
    if not isinstance(row.get("data_source"), str):
        raise ValueError(f"'data_source' must be a string, got {row.get('data_source')!r}")
    if check_reward:
        if "ground_truth" not in (row.get("reward_model") or {}):
            raise ValueError("no 'reward_model.ground_truth' for the default reward (or pass reward=...)")
        if row["data_source"] not in DATA_SOURCES:
            raise ValueError(f"no built-in reward for data_source {row['data_source']!r}; known: "
                           f"{', '.join(DATA_SOURCES)} (pass reward=...)")


def split(examples: Sequence[dict], test_size: float | int, *, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, test): `test_size` examples (or that fraction, when < 1) drawn with `seed`, in file order."""
    n = round(test_size * len(examples)) if test_size < 1 else int(test_size)
    if not 0 <= n <= len(examples):
        raise ValueError(f"cannot hold out {test_size} of {len(examples)} examples")
    held = set(random.Random(seed).sample(range(len(examples)), n))
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])


def shuffled(examples: Sequence[dict], seed: int) -> list[dict]:
    """A copy of `examples` in an order that depends only on `seed` (and their number)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    return [examples[i] for i in order]
