"""ARCHITECTURE.md is true of the code: every module it names exists, and the import rules it states hold."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "ARCHITECTURE.md").read_text()

GROUND = {"batch", "config", "checkpoints", "runs", "algorithms", "models", "lora", "progress"}
WINGS = {"policy", "samplers", "rewards", "tasks", "agents"}
ALLOWED = {  # (importer, imported) across the rules, each stated on the page
    ("tasks", "rewards"),
    ("tasks", "agents"),
    ("agents", "rewards"),
}


def test_every_module_the_page_names_exists():
    named = set(re.findall(r"rlbench/[\w/]+(?:\.py|/)", PAGE))
    assert len(named) > 20
    missing = [path for path in sorted(named) if not (ROOT / path).exists()]
    assert not missing, missing


def _top_package(module: Path) -> str:
    parts = module.relative_to(ROOT / "rlbench").with_suffix("").parts
    return parts[0]


def _imports(module: Path) -> set[str]:
    """The rlbench top-level modules / packages a module imports."""
    found = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("rlbench"):
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level > 0 and node.module and module.parent.name == "rlbench":
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("rlbench.")}
    return found


def test_layers_import_only_what_the_page_allows():
    broken = []
    for module in sorted((ROOT / "rlbench").rglob("*.py")):
        home = _top_package(module)
        if home == "__init__":
            continue
        for imported in _imports(module) - {home}:
            lower = GROUND if home in GROUND else GROUND if home in WINGS else None
            if lower is not None and imported not in lower and (home, imported) not in ALLOWED:
                broken.append(f"{module.relative_to(ROOT)} imports rlbench.{imported}")
    assert not broken, broken


def test_the_algorithms_import_no_distributed_ray_model_or_session():
    for module in (ROOT / "rlbench" / "algorithms").glob("*.py"):
        text = module.read_text()
        for forbidden in ("torch.distributed", "import ray", "transformers", "rlbench.session"):
            assert forbidden not in text, (module.name, forbidden)


def test_the_readme_and_contributing_link_the_page():
    for doc in ("README.md", "CONTRIBUTING.md"):
        assert "ARCHITECTURE.md" in (ROOT / doc).read_text(), doc
