"""rlbench: reinforcement-learning post-training of language models, one inspectable step at a time.

Importing it changes nothing in the process (no environment variable, thread count, RNG or other library is
touched) and loads no plotting library: `rl.viz` (matplotlib, pandas) is imported on first use.
"""

import importlib

from rlbench import algorithms, interrupts, models, rewards, samplers, tasks, workers
from rlbench.batch import Batch
from rlbench.cluster import Ray
from rlbench.config import Config
from rlbench.session import Session

__all__ = ["Batch", "Config", "Ray", "Session", "algorithms", "interrupts", "models", "rewards", "samplers", "tasks", "viz", "workers"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "viz":  # plots and the dashboard: matplotlib and pandas load when first asked for
        return importlib.import_module("rlbench.viz")
    raise AttributeError(f"module 'rlbench' has no attribute {name!r}")
