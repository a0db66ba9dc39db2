import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray clusters the tests start themselves (test_ray_nodes.py) stay on loopback: Ray reads this when imported, and
# otherwise connects to 127.0.0.1's cluster at the machine's address (rlbench's private instances set it too)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

import rlbench as rl  # noqa: E402
from rlbench.batch import left_pad  # noqa: E402
from rlbench.samplers import HFSampler, SamplingParams  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir():
    """The built-in tiny model's directory (built once into the cache, then reused)."""
    return str(rl.models.resolve("tiny-arith"))


@pytest.fixture(scope="session")
def chat_dir(tiny_dir, tmp_path_factory):
    """tiny-arith behind a chat template, with room for tool calls (`agent_games.chat_model`)."""
    from agent_games import chat_model

    return chat_model(tiny_dir, tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(model, tokenizer) of the built-in tiny model."""
    return rl.models.load(tiny_dir)


@pytest.fixture(scope="session")
def rollout(tiny):
    """16 sampled rollouts (4 prompts x 4) of the tiny model with prompts and seeded random advantages:
    the input of the policy's training tests."""
    model, tokenizer = tiny
    rows = [tokenizer.encode(p, add_special_tokens=False) for p in ["12+34=", "7+5=", "99+99=", "3+40="]]
    sampler = HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out = sampler.generate(rows, SamplingParams(n=4, max_new_tokens=8, seed=0))
    ids, mask = left_pad([r for r in rows for _ in range(4)], tokenizer.pad_token_id)
    advantages = torch.randn(len(out), 1, generator=torch.Generator().manual_seed(0)) * out["response_mask"]
    return out.with_columns(prompt_ids=ids, prompt_mask=mask, advantages=advantages)


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


LONGEST_FIRST = ["test_ray.py", "test_notebooks.py", "test_cli.py", "test_interrupts.py", "test_zoo_training.py",
                 "test_agents.py", "test_tiny_tools.py", "test_vllm.py", "test_benchmarks_scaling.py"]
"""The files that take longest (`--durations` of a whole run), collected first. Under `make test` pytest-xdist then
hands out files by their number of tests (its loadscope reorder, which keeps this order only among files with as many
tests); turning the reorder off to follow this list started two Ray clusters at once and timed out joining one."""


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_terminal_summary(terminalreporter):
    """Say which code-sandbox modes this machine has, when the run used the sandbox (tests/test_sandbox.py runs
    its attacks against every kernel mode available)."""
    from rlbench.rewards import sandbox

    if sandbox.sandbox_info.cache_info().currsize:
        info = sandbox.sandbox_info()
        missing = f"; missing: {'; '.join(info['missing'])}" if info["missing"] else ""
        terminalreporter.write_line(f"code sandbox: {info['mode']} mode (available: {', '.join(info['available'])}; "
                                    f"cgroup: {info['cgroup']}){missing}")
