import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

import rlbench as rl  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir():
    """The built-in tiny model's directory (built once into the cache, then reused)."""
    return str(rl.models.resolve("tiny-arith"))


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(model, tokenizer) of the built-in tiny model."""
    return rl.models.load(tiny_dir)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tests share two cores with whatever else runs: one torch thread each, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Sessions write runs/<name>/metrics.jsonl under the working directory: keep it out of the checkout."""
    monkeypatch.chdir(tmp_path)
