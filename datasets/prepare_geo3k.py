"""Geometry3K (hiyouga/geometry3k) -> verl's schema with images, from the public files on this machine (no hub).

Input records are the hub's parquet rows: {"images": [{"bytes": ..., "path": ...}], "problem": "<image>Find x.",
"answer": "3"} (the `<image>` mark says where the diagram goes), in `data/{train,validation,test}-*.parquet`.

    python datasets/prepare_geo3k.py --train train.parquet --test test.parquet --out data/geo3k
    # -> data/geo3k/train.parquet, data/geo3k/test.parquet

Each row: the problem plus verl's geo3k instruction (think, then a \\boxed{} answer) as one user message, the
diagrams kept as verl writes them (`images`: {bytes, path} records, read by `rl.models.vision.load_image`), ground
truth the answer. Graded by `rlbench.rewards.geo3k_reward` (0.9 x correct + 0.1 x format, as verl's example).
"""

from __future__ import annotations

from rlbench.models.vision import IMAGE_MARK
from rlbench.tasks import convert_main

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final "
               r"answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
               r"BE put in \boxed{}.")


def convert(record: dict, index: int, split: str) -> dict:
    images = list(record["images"])
    if record["problem"].count(IMAGE_MARK) not in (0, len(images)):
        raise ValueError(f"{split} record {index}: {record['problem'].count(IMAGE_MARK)} {IMAGE_MARK} mark(s) for "
                         f"{len(images)} image(s)")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{record['problem']} {INSTRUCTION}"}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(record["answer"])},
        "extra_info": {"split": split, "index": index, "problem": record["problem"], "answer": str(record["answer"])},
    }


def main(argv: list[str] | None = None) -> None:
    convert_main(convert, __doc__, "Geometry3K", argv)


if __name__ == "__main__":
    main()
