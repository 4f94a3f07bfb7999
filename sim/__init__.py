"""The simulator core: the replica loop, clocks, arrival sources, the request state machine,
the backend protocol and ``SimBackend``, the cost model, metrics and run outputs; several
replicas behind a router (``run_cluster``).

Never imports mlx: a simulation runs where MLX is absent.
"""

from .backend import Backend, SimBackend
from .clock import SimClock, WallClock
from .cluster import run_cluster
from .cost import LinearCostModel, ProfileError
from .loop import PolicyError, RunResult, run
from .sources import ArrivalSource, ClientSource, LiveSource, SourceClosed, TraceSource
from .metrics import format_summary, summarize
from .state import PlanError, ReplicaState, RequestState

__all__ = [
    "ArrivalSource",
    "ClientSource",
    "LiveSource",
    "SimClock",
    "SourceClosed",
    "TraceSource",
    "WallClock",
    "Backend",
    "LinearCostModel",
    "PlanError",
    "PolicyError",
    "ProfileError",
    "ReplicaState",
    "RequestState",
    "RunResult",
    "SimBackend",
    "format_summary",
    "run",
    "run_cluster",
    "summarize",
]
