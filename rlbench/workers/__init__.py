"""The session's workers: building them (`build.py`), the typed handles the session and custom loops call them through
(`handles.py`), and the ranks and Ray actors under the handles (`cluster.py`)."""

from rlbench.workers.build import Workers, start_workers
from rlbench.workers.handles import CriticHandle, EnvHandle, PolicyHandle, ReferenceHandle, SamplerHandle, ScorerHandle

__all__ = ["CriticHandle", "EnvHandle", "PolicyHandle", "ReferenceHandle", "SamplerHandle", "ScorerHandle", "Workers",
           "start_workers"]
