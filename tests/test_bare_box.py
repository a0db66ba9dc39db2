"""rlbench on a machine without Ray, vLLM, ipywidgets and math-verify (a bare GPU image, benchmarks/gpu/README.md).

One fresh Python process hides those four packages (a wrapper around every `sys.meta_path` finder answers "not
found" for them, so `import ray` and `importlib.util.find_spec("ray")` behave as if it were not installed; nothing
is uninstalled), imports rlbench, trains a step inline with the HF sampler, and records what asking for Ray, vLLM and
math-verify gives. The tests below read that record.
"""

import json
import os
import subprocess
import sys

import pytest

HIDDEN = ("ray", "vllm", "ipywidgets", "math_verify")

SCRIPT = """
import json, math, sys

HIDDEN = set(sys.argv[1].split(","))
already = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)


class Hide:
    '''A meta-path finder that finds nothing under a hidden top-level name and defers to `finder` otherwise.'''

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [Hide(f) for f in sys.meta_path]

import rlbench as rl

out = {"already_imported": already}
with rl.Session(model="tiny-arith", sampler="hf", cluster="inline", prompts_per_step=2, samples_per_prompt=2,
                max_new_tokens=8, log_dir=None) as session:
    row = session.step()
out["step"] = {k: row[k] for k in ("loss", "grad_norm", "reward_errors")}
out["sampler"] = session.sampler.choice


def error(make):
    try:
        make()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return None


small = dict(model="tiny-arith", prompts_per_step=2, samples_per_prompt=2, log_dir=None)
out["ray"] = error(lambda: rl.Session(cluster="ray", **small))
out["Ray()"] = error(lambda: rl.Session(cluster=rl.Ray(), **small))
out["vllm"] = error(lambda: rl.Session(sampler="vllm", **small))
out["math_reward"] = error(lambda: rl.rewards.math_reward("\\\\boxed{2}", {"answer": "2"}))
out["gsm8k_reward"] = rl.rewards.gsm8k_reward("#### 2", {"answer": "2"})
out["loaded"] = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def bare(tiny_dir):
    """What the script above recorded, in a process of its own (tiny-arith already built by `tiny_dir`)."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    done = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(HIDDEN)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_nothing_hidden_was_loaded(bare):
    """The hidden packages were not imported before the finder went in, nor by anything after it."""
    assert bare["already_imported"] == [] and bare["loaded"] == []


def test_inline_step_without_ray_or_vllm(bare):
    """An inline session with the HF sampler trains a step; the arithmetic reward needs no math-verify."""
    assert bare["sampler"] == "hf"
    step = bare["step"]
    assert all(isinstance(step[k], float) for k in ("loss", "grad_norm"))
    assert abs(step["loss"]) < float("inf") and abs(step["grad_norm"]) < float("inf")  # json writes nan as NaN
    assert step["reward_errors"] == 0


@pytest.mark.parametrize("how", ["ray", "Ray()"])
def test_ray_missing_is_named(how, bare):
    """cluster='ray' and cluster=rl.Ray() say that the ray package is missing and how to install it."""
    assert bare[how]["type"] == "ModuleNotFoundError"
    assert "ray package" in bare[how]["message"] and "pip install 'ray" in bare[how]["message"]


def test_vllm_missing_is_named(bare):
    """sampler='vllm' says that vLLM is not installed and names the extras."""
    assert bare["vllm"]["type"] == "ValueError"
    assert "vLLM is not installed" in bare["vllm"]["message"] and "rlbench[vllm]" in bare["vllm"]["message"]


def test_math_verify_missing_is_named(bare):
    """MATH's grader (the reward of MATH / DAPO data sources) names math_verify; GSM8K's grader needs nothing."""
    assert bare["math_reward"]["type"] == "ModuleNotFoundError" and "math_verify" in bare["math_reward"]["message"]
    assert bare["gsm8k_reward"] == {"score": 1.0, "acc": 1.0}
