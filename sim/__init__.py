"""The SimPy simulator: replica loop, request state machine, cost models, metrics.

Never imports mlx: a simulation runs where MLX is absent.
"""

from .cost import LinearCostModel, ProfileError
from .loop import Backend, PolicyError, RunResult, SimBackend, run
from .metrics import format_summary, summarize
from .state import PlanError, ReplicaState, RequestState

__all__ = [
    "Backend", "LinearCostModel", "PlanError", "PolicyError", "ProfileError", "ReplicaState",
    "RequestState", "RunResult", "SimBackend", "format_summary", "run", "summarize",
]
