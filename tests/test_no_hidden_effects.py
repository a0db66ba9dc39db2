"""Nothing happens behind the user's back: building a session, restoring one, importing rlbench and re-running
a stage leave the process and the session as they were."""

import inspect
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import rlbench as rl

SMALL = dict(model="tiny-arith", task="arithmetic", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8,
             cluster="inline", seed=0, log_dir=None)


def rng_draws() -> tuple:
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), random.random()


def test_building_stepping_and_restoring_a_session_leave_the_global_rngs_alone(tmp_path):
    for algorithm in ("grpo", "ppo"):  # ppo: a critic, whose value head is initialised from the seed
        torch.manual_seed(7), np.random.seed(7), random.seed(7)
        expected = rng_draws()
        torch.manual_seed(7), np.random.seed(7), random.seed(7)
        with rl.Session(**SMALL, algorithm=algorithm) as s:
            s.step()
            s.save(tmp_path / algorithm)
        assert rng_draws() == expected, algorithm
        torch.manual_seed(11), np.random.seed(11), random.seed(11)  # streams other than the saved session's
        expected = rng_draws()
        torch.manual_seed(11), np.random.seed(11), random.seed(11)
        with rl.Session.restore(tmp_path / algorithm) as s:
            s.step()
        assert rng_draws() == expected, algorithm


def test_the_inline_thread_count_is_the_users_unless_threads_is_set():
    torch.set_num_threads(1)
    with rl.Session(**SMALL):
        assert torch.get_num_threads() == 1
    with rl.Session(**SMALL, threads=2):
        assert torch.get_num_threads() == 2


def test_import_changes_no_environment_variable_and_loads_no_plotting():
    code = ("import os, sys, json; before = dict(os.environ); import rlbench; "
            "print(json.dumps({'env': dict(os.environ) == before, 'modules': [m for m in "
            "('matplotlib', 'pandas.plotting', 'ipywidgets', 'rlbench.viz') if m in sys.modules]}))")
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")}  # a clean one: nothing preset
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == {"env": True, "modules": []}
    plotted = subprocess.run([sys.executable, "-c", "import rlbench, sys; rlbench.viz; print('matplotlib' in sys.modules)"],
                             capture_output=True, text=True, env=env, check=True)
    assert plotted.stdout.strip() == "True"  # asked for: there it is


def test_rerunning_advantage_gives_the_same_batch_and_changes_no_state():
    # PPO with a critic, a reference and the KL in the reward with an adaptive β
    algorithm = rl.algorithms.get("ppo").replace(reward_kl_coef=0.05, reward_kl_target=0.01)
    with rl.Session(**SMALL, algorithm=algorithm) as s:
        scored = s.score(s.rollout())
        state, beta = s.state.to_dict(), s.state.reward_kl.coef
        first, second = s.advantage(scored), s.advantage(scored)
        assert s.state.to_dict() == state and s.state.reward_kl.coef == beta
        for name in first.tensors:
            assert torch.equal(first[name], second[name]), name
        assert first.meta == second.meta and first.meta["reward_kl_coef"] == beta
        s.update(first)
        assert s.state.reward_kl.coef != beta  # the update applies the batch's KL to β


def test_the_signature_and_help_show_every_config_field():
    parameters = inspect.signature(rl.Session).parameters
    assert list(parameters)[0] == "config"
    for field in rl.Config.fields():
        assert parameters[field].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[field].default == getattr(rl.Config(), field)
        assert f"{field} = " in rl.Session.__init__.__doc__
    assert "Peak learning rate of AdamW" in rl.Session.__init__.__doc__


def test_a_config_and_overrides():
    config = rl.Config(**{k: v for k, v in SMALL.items()}, lr=3e-4)
    with rl.Session(config, seed=5) as s:
        assert (s.config.lr, s.config.seed, config.seed) == (3e-4, 5, 0)
    with pytest.raises(TypeError, match="config must be an rl.Config"):
        rl.Session({"lr": 1e-3})
