"""CI: the quickstart's closing line is its JSON result, and the run learned (held-out greedy accuracy went up).

    python .ci/check_demo.py DEMO_LOG     # exit 1, saying what is wrong, otherwise one line with the numbers
"""

import json
import sys

KEYS = {"steps", "seed", "train_seconds", "accuracy_before", "accuracy_after", "sampled_accuracy_before",
        "sampled_accuracy_after", "reward_curve"}


def main(path: str) -> str:
    lines = open(path).read().strip().splitlines()
    if not lines:
        raise SystemExit(f"{path}: the quickstart printed nothing")
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise SystemExit(f"{path}: the quickstart's last line is not its JSON result: {lines[-1]!r}") from None
    if not isinstance(result, dict) or set(result) != KEYS:
        raise SystemExit(f"{path}: the quickstart's result has keys {sorted(result)}, expected {sorted(KEYS)}")
    if not result["accuracy_after"] > result["accuracy_before"]:
        raise SystemExit(f"the quickstart did not learn: greedy accuracy {result['accuracy_before']} -> "
                         f"{result['accuracy_after']} after {result['steps']} steps")
    return (f"quickstart: greedy accuracy {result['accuracy_before']} -> {result['accuracy_after']} after "
            f"{result['steps']} steps ({result['train_seconds']} s of training)")


if __name__ == "__main__":
    print(main(sys.argv[1]))
