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
import hashlib
import json
import math
import os
import random
import reprlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import final

from rlbench.models.chat import messages_of
from rlbench.rewards import DATA_SOURCES, by_data_source, dapo_math_reward, geo3k_reward, gsm8k_reward, math_reward

Reward = Callable[[str, dict], "float | dict"]

ANSWER_GRADERS = (gsm8k_reward, math_reward, dapo_math_reward, geo3k_reward)
"""The built-in graders that compare a final answer with a reference: their ground truth is a string or a number."""
DUPLICATES = ("refuse", "drop", "keep")


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
                 truncated_reward: float | None = None, duplicates: str = "refuse") -> DataTask:
    """A task from a parquet file in verl's schema.

    `test`: another file of the same schema (verl's test.parquet), or a fraction (< 1) or a number of
    rows of `path` to hold out (drawn with `seed`), or None for no held-out set. Training rows are
    shuffled with `seed` when `shuffle`. Rows are validated; an error names the file and row.

    `duplicates`: what to do with rows whose prompt an earlier row of the file has, and with training rows whose
    prompt a test row has (a held-out prompt also trained on): "refuse" (a ValueError counting them and naming the
    first rows), "drop" (keep the first of each; drop from training what the test set holds) or "keep".
    """
    return _from_files(path, test, reward=reward, seed=seed, shuffle=shuffle, name=name,
                       truncated_reward=truncated_reward, duplicates=duplicates)


def from_jsonl(path: str | os.PathLike, *, test: str | os.PathLike | float | int | None = None,
               reward: Reward | None = None, seed: int = 0, shuffle: bool = True, name: str | None = None,
               truncated_reward: float | None = None, duplicates: str = "refuse") -> DataTask:
    """`from_parquet` for a JSON-lines file (one verl row per line)."""
    return _from_files(path, test, reward=reward, seed=seed, shuffle=shuffle, name=name,
                       truncated_reward=truncated_reward, duplicates=duplicates)


def _from_files(path, test, *, reward, seed, shuffle, name, truncated_reward, duplicates) -> DataTask:
    if duplicates not in DUPLICATES:
        raise ValueError(f"duplicates must be one of {', '.join(map(repr, DUPLICATES))}, got {duplicates!r}")
    train = unique_prompts(read_rows(path, check_reward=reward is None), duplicates, path)
    if isinstance(test, (int, float)) and not isinstance(test, bool):
        train, held_out = split(train, test, seed=seed)
    else:
        held_out = read_rows(test, check_reward=reward is None) if test is not None else []
        train = without_test_prompts(train, held_out, duplicates, path, test)
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


def _prompt_key(row: dict) -> str:
    """What makes two rows the same question: the prompt, and its pictures when it has any."""
    media = repr([row.get("images"), row.get("videos")]).encode()
    return json.dumps(row["prompt"], sort_keys=True) + hashlib.sha256(media).hexdigest()


def unique_prompts(rows: list[dict], duplicates: str, path) -> list[dict]:
    """`rows` without those whose prompt an earlier row has ("drop"), or as they are ("keep"); "refuse": ValueError
    counting them and naming the first few (row i repeats row j)."""
    first: dict[str, int] = {}
    repeats = [(i, first.setdefault(_prompt_key(row), i)) for i, row in enumerate(rows)]
    repeats = [(i, j) for i, j in repeats if i != j]
    if repeats and duplicates == "refuse":
        raise ValueError(f"{path}: {len(repeats)} of its {len(rows)} rows repeat an earlier row's prompt ("
                         + ", ".join(f"row {i} = row {j}" for i, j in repeats[:5]) + (", ..." if len(repeats) > 5 else "")
                         + "): they weigh double in training and, held out, are also trained on. Pass "
                           "duplicates='drop' (keep the first of each) or duplicates='keep'")
    dropped = {i for i, _ in repeats} if duplicates == "drop" else set()
    return [row for i, row in enumerate(rows) if i not in dropped]


def without_test_prompts(train: list[dict], test: list[dict], duplicates: str, path, test_path) -> list[dict]:
    """`train` without the rows whose prompt a `test` row has ("drop"), or as it is ("keep"); "refuse":
    ValueError counting them and naming the first few."""
    held = {_prompt_key(row): i for i, row in enumerate(test)}
    shared = [(i, held[_prompt_key(row)]) for i, row in enumerate(train) if _prompt_key(row) in held]
    if shared and duplicates == "refuse":
        raise ValueError(f"{path}: {len(shared)} of its {len(train)} rows have the prompt of a row of the test set "
                         f"{test_path} (" + ", ".join(f"row {i} = test row {j}" for i, j in shared[:5])
                         + (", ..." if len(shared) > 5 else "") + "): held-out accuracy would count prompts the "
                           "model trained on. Pass duplicates='drop' (drop them from training) or duplicates='keep'")
    dropped = {i for i, _ in shared} if duplicates == "drop" else set()
    return [row for i, row in enumerate(train) if i not in dropped]


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
        with open(path, "rb") as f:
            return [record for number, line in enumerate(f, 1) if line.strip()
                    for record in [_json(line.rstrip(b"\r\n"), f"{path}, line {number}")]]
    if path.suffix == ".json":
        records = _json(path.read_bytes(), str(path))
        return records if isinstance(records, list) else [records]
    raise ValueError(f"{path}: expected a .parquet, .jsonl or .json file")


def _json(data: bytes, where: str):
    """The JSON value of `data` (UTF-8); ValueError naming `where` (the file, and the line of a JSONL file)."""
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{where}: not UTF-8 text (byte {data[error.start:error.start + 1]!r} at column "
                         f"{error.start + 1})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg}: column {error.colno}, near "
                         f"{reprlib.repr(error.doc[max(0, error.pos - 20):error.pos + 20])})") from None


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
        _check_ground_truth(row["reward_model"]["ground_truth"], row["data_source"])


def _check_ground_truth(truth, data_source: str) -> None:
    """ValueError for a reference the default reward cannot grade against: none, NaN, empty, or for an answer
    grader (`ANSWER_GRADERS`) anything but a string or a number. Every completion would score 0, unsaid."""
    said = f"'reward_model.ground_truth' is {reprlib.repr(truth)}"
    if truth is None or (isinstance(truth, float) and not math.isfinite(truth)) or truth in ("", [], {}):
        raise ValueError(f"{said}: there is no reference answer to grade against (fix the row, or drop it)")
    answer = DATA_SOURCES[data_source] in ANSWER_GRADERS
    if answer and (isinstance(truth, bool) or not isinstance(truth, (str, int, float))):
        raise ValueError(f"{said} ({type(truth).__name__}): the {data_source} grader compares the final answer with "
                         f"a string or a number (pass reward=... to grade it otherwise)")


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
