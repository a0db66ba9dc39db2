"""rlbench: reinforcement-learning post-training of language models, one inspectable step at a time.

Importing it changes nothing in the process (no environment variable, thread count, RNG or other library is
touched), loads no plotting library and nothing of the top floor: `rl.viz` (matplotlib, pandas), `rl.sweep` /
`rl.Sweep` (pandas) and `rl.quickstart` are imported on first use.
"""

import importlib
import os

_environment = dict(os.environ)

from rlbench import agents, algorithms, models, rewards, samplers, tasks, workers  # noqa: E402
from rlbench.agents import Env, Game, tool  # noqa: E402
from rlbench.batch import Batch  # noqa: E402
from rlbench.config import VLLM, Config, RewardRunner  # noqa: E402
from rlbench.models.lora import LoRA  # noqa: E402
from rlbench.session import Session, interrupts  # noqa: E402
from rlbench.session.sources import Async, Overlap, RolloutMode, RolloutSource, Sync  # noqa: E402
from rlbench.workers.cluster import Ray  # noqa: E402

# torch._dynamo, imported with transformers' model classes, writes TORCHINDUCTOR_CACHE_DIR into the environment
# when first imported: put the environment back as it was (torch sets the variable again if it compiles)
for _name in set(os.environ) - set(_environment):
    del os.environ[_name]
os.environ.update(_environment)
del _environment

__all__ = ["Async", "Batch", "Config", "Env", "Game", "LoRA", "Overlap", "Ray", "RewardRunner", "RolloutMode",
           "RolloutSource", "Session", "Sweep", "Sync", "VLLM", "agents", "algorithms", "interrupts", "models",
           "quickstart", "rewards", "samplers", "sweep", "tasks", "tool", "viz", "workers"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "viz":  # plots and the dashboard: matplotlib and pandas load when first asked for
        return importlib.import_module("rlbench.viz")
    if name == "quickstart":  # the top floor loads when first asked for (`python -m rlbench.quickstart` runs it alone)
        return importlib.import_module("rlbench.quickstart")
    if name in ("sweep", "Sweep"):  # rlbench.experiments.sweeps: pandas loads when first asked for
        return getattr(importlib.import_module("rlbench.experiments.sweeps"), name)
    raise AttributeError(f"module 'rlbench' has no attribute {name!r}")
