"""How the built-in models were made: `python -m rlbench.models.build NAME [--seed S] [--ship]`.

Trains NAME's recipe on this machine into `$RLBENCH_CACHE/models/` (a build already cached there is reused: point
RLBENCH_CACHE at an empty folder for a fresh one) and prints its folder. Each recipe's warm start stops only in its
model's accuracy band, so a build that finishes is in band; another machine's build lands in the same band, not on
the same bytes (each CPU rounds its own way). `--ship` then puts the build in place of the folder that ships with
rlbench (`warm_start.SHIPPED`), which is how the shipped ones were made.
"""

from __future__ import annotations

import argparse
import shutil

from rlbench import models
from rlbench.models.warm_start import SHIPPED


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlbench.models.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=models.names())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ship", action="store_true", help="replace the shipped folder of this name with the build")
    args = parser.parse_args(argv)
    built = models.builder(args.name)(args.seed, shipped=False)
    if args.ship:
        shutil.rmtree(SHIPPED / built.name, ignore_errors=True)
        shutil.copytree(built, SHIPPED / built.name)
        built = SHIPPED / built.name
    print(built)


if __name__ == "__main__":
    main()
