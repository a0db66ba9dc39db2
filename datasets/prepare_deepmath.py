"""DeepMath-103K (He et al. 2025, arXiv:2504.11456) -> verl's schema, from the public files on this machine (no hub).

Input records are the data set's own (zwhe99/DeepMath-103K, data/*.parquet): {"question", "final_answer",
"difficulty", "topic", "r1_solution_1", "r1_solution_2", "r1_solution_3"}.

    python datasets/prepare_deepmath.py --train data/train-*.parquet --out data/deepmath   # the hub's shards

Each row: the question plus MATH's instruction (\\boxed{}) as one user message; ground truth = "final_answer";
difficulty and topic kept in extra_info (the R1 solutions are dropped: they are long and no grader reads them).
Graded by `rlbench.rewards.math_reward` (math-verify). The tool-integrated math recipe
(algorithms/grpo/tool-math-qwen2.5-math-1.5b.toml) trains on it and tests on MATH-500 (prepare_math.py).
"""

from __future__ import annotations

import argparse

from prepare_math import INSTRUCTION
from rlbench.tasks import convert_files, read_records

DATA_SOURCE = "zwhe99/DeepMath-103K"


def convert(record: dict, index: int, split: str) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{record['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(record["final_answer"])},
        "extra_info": {"split": split, "index": index, "difficulty": record.get("difficulty"),
                       "topic": record.get("topic")},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", nargs="+", required=True, help="DeepMath-103K files (.parquet or .jsonl), in order")
    parser.add_argument("--test", nargs="+", help="held-out files of the same format")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    inputs = {split: [r for path in paths for r in read_records(path)] if paths else None
              for split, paths in {"train": args.train, "test": args.test}.items()}
    for split, path in convert_files(convert, inputs, args.out).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
