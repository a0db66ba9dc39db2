"""rlbench: reinforcement-learning post-training of language models, one inspectable step at a time."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads must not spin

from rlbench import algorithms, models, rewards, tasks, viz  # noqa: E402
from rlbench.batch import Batch  # noqa: E402
from rlbench.cluster import Ray  # noqa: E402
from rlbench.config import Config  # noqa: E402
from rlbench.session import Session  # noqa: E402

__all__ = ["Batch", "Config", "Ray", "Session", "algorithms", "models", "rewards", "tasks", "viz"]
__version__ = "0.1.0"
