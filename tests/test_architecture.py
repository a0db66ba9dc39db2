"""ARCHITECTURE.md is true of the code: every module it names exists, and the import rules it states hold."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from rlbench import models, quickstart

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "ARCHITECTURE.md").read_text()

GROUND = {"batch", "config", "runs", "algorithms", "models"}
WINGS = {"policy", "samplers", "rewards", "tasks", "agents"}
CONTROLLER = {"session", "workers", "__init__"}  # the package root imports the session, never the top floor
TOP = {"viz", "cli", "quickstart", "experiments"}
ALLOWED = {  # (importer, imported) across the rules, each stated on the page
    ("tasks", "rewards"),
    ("tasks", "agents"),
    ("agents", "rewards"),
    ("session", "viz"),  # s.plot() and s.dashboard() import viz when called, never when the session is imported
}


def test_every_module_the_page_names_exists():
    named = set(re.findall(r"rlbench/[\w/]+(?:\.py|/)", PAGE))
    assert len(named) > 20
    missing = [path for path in sorted(named) if not (ROOT / path).exists()]
    assert not missing, missing


def test_the_page_names_every_folder_and_each_folder_names_its_modules():
    folders = sorted(p.parent for p in (ROOT / "rlbench").glob("*/__init__.py"))
    assert {f.name for f in folders} >= {"session", "workers", "runs", "experiments", "models", "agents"}
    unnamed = [f.name for f in folders if f"rlbench/{f.name}/" not in PAGE]
    assert not unnamed, f"ARCHITECTURE.md names no folder {unnamed}"
    for folder in folders:
        said = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        assert said, f"rlbench/{folder.name}/__init__.py has no docstring saying what the folder holds"
        if folder.name in {"session", "workers", "runs", "experiments"}:  # the floors' own folders list every module
            modules = {m.name for m in folder.glob("*.py")} - {"__init__.py"}
            missing = sorted(m for m in modules if f"`{m}`" not in said)
            assert not missing, f"rlbench/{folder.name}/__init__.py does not name {missing}"


def test_workers_never_import_the_session():
    for module in (ROOT / "rlbench" / "workers").glob("*.py"):
        assert "session" not in _imports(module), f"{module.name} imports rlbench.session"


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
        assert home in GROUND | WINGS | CONTROLLER | TOP, f"{module.relative_to(ROOT)} is on no floor of the page"
        for imported in _imports(module) - {home}:
            lower = GROUND if home in GROUND | WINGS else GROUND | WINGS | CONTROLLER if home in CONTROLLER else None
            if lower is not None and imported not in lower and (home, imported) not in ALLOWED:
                broken.append(f"{module.relative_to(ROOT)} imports rlbench.{imported}")
    assert not broken, broken


def test_importing_rlbench_loads_nothing_of_the_top_floor():
    code = "import json, sys, rlbench; print(json.dumps(sorted(m for m in sys.modules if m.startswith('rlbench.'))))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       cwd=ROOT).stdout)
    assert {m.split(".")[1] for m in loaded} & TOP == set(), loaded
    assert "rlbench.session" in loaded  # the package root does load the controller


def test_a_built_in_model_trained_above_the_models_floor_is_found_when_first_asked_for():
    assert models.builder("tiny-arith-grpo") is quickstart.teacher
    assert quickstart.TEACHER in models.names()


def test_the_algorithms_import_no_distributed_ray_model_or_session():
    for module in (ROOT / "rlbench" / "algorithms").rglob("*.py"):
        text = module.read_text()
        for forbidden in ("torch.distributed", "import ray", "transformers", "rlbench.session"):
            assert forbidden not in text, (module.name, forbidden)


def test_the_readme_and_contributing_link_the_page():
    for doc in ("README.md", "CONTRIBUTING.md"):
        assert "ARCHITECTURE.md" in (ROOT / doc).read_text(), doc
