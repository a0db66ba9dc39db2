"""MATH (Hendrycks et al.) and MATH-500 -> verl's schema, from the public files on this machine (no hub).

Input records are MATH's own: {"problem", "solution" (with a final \\boxed{...}), "level", "type"}, as in
the original archive's MATH/{train,test}/<subject>/<id>.json (give the directory) or the hub's
MATH-lighteval parquet files; or MATH-500's test.jsonl, whose records also carry "answer", "subject"
and "unique_id" (`--subset math500`).

    python datasets/prepare_math.py --train MATH/train --test MATH/test --out data/math
    python datasets/prepare_math.py --subset math500 --test math500/test.jsonl --out data/math500

Each row: the problem plus verl's instruction as one user message; ground truth = the record's
"answer" when it has one, else the content of the solution's last \\boxed{}. Graded by
`rlbench.rewards.math_reward` (math-verify).
"""

from __future__ import annotations

import argparse
import functools

from rlbench.tasks import convert_files

DATA_SOURCES = {"math": "DigitalLearningGmbH/MATH-lighteval", "math500": "HuggingFaceH4/MATH-500"}
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def last_boxed(solution: str) -> str:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces matched:
    "\\boxed{\\frac{1}{2}}" -> "\\frac{1}{2}"."""
    start = max(solution.rfind("\\boxed{"), solution.rfind("\\fbox{"))
    if start < 0:
        raise ValueError(f"no \\boxed{{}} answer in the solution: {solution[-80:]!r}")
    depth, begin = 0, solution.index("{", start)
    for i in range(begin, len(solution)):
        depth += {"{": 1, "}": -1}.get(solution[i], 0)
        if depth == 0:
            return solution[begin + 1:i]
    raise ValueError(f"unbalanced braces after \\boxed: {solution[start:start + 80]!r}")


def convert(record: dict, index: int, split: str, *, subset: str = "math") -> dict:
    answer = record.get("answer") or last_boxed(record["solution"])
    info = {"split": split, "index": index, "level": record.get("level"),
            "type": record.get("type") or record.get("subject"), "solution": record.get("solution")}
    if "unique_id" in record:
        info["unique_id"] = record["unique_id"]
    return {
        "data_source": DATA_SOURCES[subset],
        "prompt": [{"role": "user", "content": f"{record['problem']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": info,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subset", choices=sorted(DATA_SOURCES), default="math")
    parser.add_argument("--train", help="train records (directory of .json, .jsonl or .parquet)")
    parser.add_argument("--test", help="test records (directory of .json, .jsonl or .parquet)")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    convert_subset = functools.partial(convert, subset=args.subset)
    for split, path in convert_files(convert_subset, {"train": args.train, "test": args.test}, args.out).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
