"""Rewrite docs/algorithms.md from the registry: `python -m rlbench.algorithms.reference [PATH]`."""

import argparse
from pathlib import Path

from . import reference_markdown

PAGE = Path(__file__).resolve().parents[3] / "docs" / "algorithms.md"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlbench.algorithms.reference", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=PAGE,
                        help="where to write the page (default: docs/algorithms.md of this checkout)")
    path = parser.parse_args(argv).path
    if not path.parent.is_dir():
        parser.error(f"no folder {path.parent} (not a source checkout?): pass the page's path")
    path.write_text(reference_markdown(builtin=True))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
