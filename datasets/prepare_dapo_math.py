"""DAPO-Math-17k -> verl's schema (it already is): duplicates removed, rows renumbered. No hub.

The published file (BytedTsinghua-SIA/DAPO-Math-17k, data/dapo-math-17k.parquet) holds each of its ~17k
problems many times over. Input records are its rows: {"data_source": "math_dapo", "prompt": [one user
message asking for "Answer: $Answer" on the last line], "ability": "MATH", "reward_model":
{"ground_truth": "34", "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": "<uuid>"}}.

    python datasets/prepare_dapo_math.py --train dapo-math-17k.parquet --out data/dapo_math

Graded by `rlbench.rewards.dapo_math_reward` (score 1 / -1, as in DAPO). For a test set, DAPO uses
AIME 2024; prepare it with --test from a file of the same schema.
"""

from __future__ import annotations

import argparse

from rlbench.tasks import convert_files, read_records


def unique_by_prompt(records: list[dict]) -> list[dict]:
    """The first record of each distinct prompt text, in file order."""
    seen: dict[str, dict] = {}
    for record in records:
        seen.setdefault(record["prompt"][-1]["content"], record)
    return list(seen.values())


def convert(record: dict, index: int, split: str) -> dict:
    original = (record.get("extra_info") or {}).get("index")
    return {
        "data_source": record.get("data_source") or "math_dapo",
        "prompt": [{"role": m["role"], "content": m["content"]} for m in record["prompt"]],
        "ability": record.get("ability") or "MATH",
        "reward_model": {"style": (record.get("reward_model") or {}).get("style", "rule"),
                         "ground_truth": str(record["reward_model"]["ground_truth"])},
        "extra_info": {"split": split, "index": index, "original_index": original},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", required=True, help="dapo-math-17k.parquet (or .jsonl)")
    parser.add_argument("--test", help="a test file in the same schema (e.g. AIME 2024)")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    inputs = {split: unique_by_prompt(read_records(path)) if path else None
              for split, path in {"train": args.train, "test": args.test}.items()}
    for split, path in convert_files(convert, inputs, args.out).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
