"""The algorithm example in CONTRIBUTING.md is real: it registers, documents itself and trains."""

import importlib.util
import re
import sys
from pathlib import Path

import torch
from floats import assert_close

import rlbench as rl

ROOT = Path(__file__).resolve().parents[1]


def test_contributing_example_algorithm(tmp_path, tiny_dir):
    text = (ROOT / "CONTRIBUTING.md").read_text()
    example = re.search(r"```python\n(\"\"\"Vanilla importance.*?)```", text, re.S).group(1)
    path = tmp_path / "vanilla_pg.py"
    path.write_text(example)
    spec = importlib.util.spec_from_file_location("vanilla_pg", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))

    assert "vanilla_pg_rloo" in rl.algorithms.names()
    assert "arXiv:1707.06347" in rl.algorithms.describe("vanilla_pg")
    # hand-worked: A = [2, -1], r = e^{0.5}, e^{0} -> L = [-2e^{0.5}, 1]
    loss_fn = rl.algorithms.loss_fn("vanilla_pg")
    loss_B_T, _ = loss_fn(torch.tensor([[0.5], [0.0]]), torch.zeros(2, 1), torch.tensor([[2.0], [-1.0]]), torch.ones(2, 1))
    assert_close(loss_B_T, torch.tensor([[-2 * torch.e ** 0.5], [1.0]]))

    s = rl.Session(model="tiny-arith", algorithm="vanilla_pg_rloo", prompts_per_step=4, samples_per_prompt=4,
                   max_new_tokens=8, threads=1)
    metrics = s.run(steps=3, progress=False)
    assert metrics["ratio_mean"].notna().all() and metrics["skipped"].eq(0).all()


def test_every_module_of_the_zoo_is_imported():
    package = Path(rl.algorithms.__file__).parent
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
    assert all(f"rlbench.algorithms.{m}" in sys.modules for m in modules)
