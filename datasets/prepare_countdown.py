"""Countdown (TinyZero's Countdown-Tasks-3to4) -> verl's schema, from a local file (no hub).

Input records: {"target": 24, "nums": [3, 7, 8, 2]}, as in the hub's Countdown-Tasks-3to4 parquet.
TinyZero has no separate test file: `--test-size` rows of the input are held out (the last ones,
as TinyZero does).

    python datasets/prepare_countdown.py --input countdown.parquet --out data/countdown --test-size 1024

Each row: TinyZero's instruction (<think> reasoning, the equation in <answer> tags) as one user
message; ground truth = {"target", "numbers"}. Graded by `rlbench.rewards.countdown_reward`.
"""

from __future__ import annotations

import argparse

from rlbench.tasks import convert_files, read_records

DATA_SOURCE = "countdown"
INSTRUCTION = ("Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
               "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> "
               "tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 "
               "</answer>.")


def convert(record: dict, index: int, split: str) -> dict:
    numbers, target = [int(n) for n in record["nums"]], int(record["target"])
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": INSTRUCTION.format(nums=numbers, target=target)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": target, "numbers": numbers}},
        "extra_info": {"split": split, "index": index},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="Countdown records (.parquet / .jsonl)")
    parser.add_argument("--test-size", type=int, default=1024, help="last rows held out as the test split")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    records = read_records(args.input)
    if not 0 <= args.test_size < len(records):
        parser.error(f"--test-size {args.test_size} leaves no training rows of {len(records)}")
    cut = len(records) - args.test_size
    inputs = {"train": records[:cut], "test": records[cut:] or None}
    for split, path in convert_files(convert, inputs, args.out).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
