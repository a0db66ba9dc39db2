"""Session(sandbox=...): the code sandbox's mode of the worker that runs model-written code (a task's reward, an
agent's tools), given to it on Ray as RLBENCH_SANDBOX; checked against this machine before any worker starts; the
driver's own environment left alone."""

import os

import pytest

import rlbench as rl
from rlbench.rewards import sandbox_info
from rlbench.workers import build

SMALL = dict(model="tiny-arith", prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4, seed=0, log_dir=None)


@pytest.mark.slow
def test_the_ray_reward_worker_runs_code_in_the_session_s_mode(tiny_dir, monkeypatch):
    if "bwrap" not in sandbox_info()["available"]:
        pytest.skip(f"no 'bwrap' sandbox here: this machine lacks {sandbox_info()['why_not']['bwrap']}")
    monkeypatch.delenv("RLBENCH_SANDBOX", raising=False)

    def reward(completion, example):  # defined here: Ray ships it by value
        from rlbench.rewards import run_python

        run = run_python("print(1)")  # no mode=: the worker's RLBENCH_SANDBOX decides
        return {"score": 0.0, "bwrap": float(run.isolation["mode"] == "bwrap")}

    arithmetic = rl.tasks.get("arithmetic")
    task = rl.tasks.DataTask("sandboxed", train=arithmetic.train[:4], test=arithmetic.test[:2], reward=reward)
    with rl.Session(**SMALL, task=task, cluster="ray", sandbox="bwrap") as s:
        batch = s.score(s.rollout())
    assert batch["bwrap"].tolist() == [1.0] * 4  # every sample's program ran under bubblewrap
    assert "RLBENCH_SANDBOX" not in os.environ  # the driver's environment is as it was


def test_a_mode_that_is_no_mode_or_not_available_here_is_named_before_any_work(monkeypatch):
    monkeypatch.setattr(rl.models, "resolve", lambda *a, **k: pytest.fail("a model was resolved before the check"))
    with pytest.raises(ValueError, match=r"^sandbox='nonsense' is not one of: None, 'namespaces', 'bwrap', 'rlimits'"):
        rl.Session(**SMALL, sandbox="nonsense")
    weak = {"mode": "rlimits", "available": ["rlimits"], "why_not": {"namespaces": "root", "bwrap": "bubblewrap"}}
    monkeypatch.setattr(build, "sandbox_info", lambda: weak)  # a machine without either
    with pytest.raises(ValueError, match=r"^sandbox='bwrap' is not available on this machine, which lacks bubblewrap; "
                                         r"available: 'rlimits'$"):
        rl.Session(**SMALL, cluster="ray", sandbox="bwrap")


def test_inline_the_mode_must_be_this_process_s_own(monkeypatch):
    """Inline, the code runs in this process, whose environment a session does not change: `sandbox=` has to agree
    with its RLBENCH_SANDBOX."""
    monkeypatch.setattr(rl.models, "resolve", lambda *a, **k: pytest.fail("a model was resolved before the check"))
    monkeypatch.setattr(build, "sandbox_info", lambda: {"mode": "bwrap", "available": ["bwrap", "rlimits"]})
    monkeypatch.delenv("RLBENCH_SANDBOX", raising=False)
    with pytest.raises(ValueError, match=r"^sandbox='rlimits' goes to the worker that scores code and runs tools, and "
                                         r"inline that is this process, .* \(its RLBENCH_SANDBOX is None\): use "
                                         r"cluster='ray', or set os.environ\['RLBENCH_SANDBOX'\] = 'rlimits' yourself"):
        rl.Session(**SMALL, sandbox="rlimits")
    monkeypatch.setenv("RLBENCH_SANDBOX", "rlimits")
    build.check_sandbox("rlimits", "inline")  # passes: the process says the same
