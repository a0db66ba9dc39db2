"""GSM8K (openai/gsm8k) -> verl's schema, from the public files on this machine (no hub).

Input records are GSM8K's own: {"question": ..., "answer": "<worked solution>\\n#### 72"}, as in
grade-school-math's train.jsonl / test.jsonl or the hub's main/{train,test}-*.parquet.

    python datasets/prepare_gsm8k.py --train train.jsonl --test test.jsonl --out data/gsm8k
    # -> data/gsm8k/train.parquet, data/gsm8k/test.parquet

Each row: the question plus verl's instruction as one user message, ground truth = the number after
"####" without commas, the full solution kept in extra_info. Graded by `rlbench.rewards.gsm8k_reward`.
"""

from __future__ import annotations

from rlbench.tasks import convert_main

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def final_answer(solution: str) -> str:
    """The number after GSM8K's "####", commas removed ("#### 1,250" -> "1250")."""
    if "####" not in solution:
        raise ValueError(f"a GSM8K solution ends with '#### <answer>': {solution[-80:]!r}")
    return solution.split("####")[-1].strip().replace(",", "")


def convert(record: dict, index: int, split: str) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{record['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final_answer(record["answer"])},
        "extra_info": {"split": split, "index": index, "question": record["question"], "answer": record["answer"]},
    }


def main(argv: list[str] | None = None) -> None:
    convert_main(convert, __doc__, "GSM8K", argv)


if __name__ == "__main__":
    main()
