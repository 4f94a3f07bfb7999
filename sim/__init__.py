"""The simulator core: the replica loop, clocks, arrival sources, the request state machine,
the backend protocol and ``SimBackend``, the cost model, metrics and run outputs; several
replicas behind a router (``run_cluster``); prefill and decode on different replicas, the KV moved
between them (``run_disaggregated``, ``KVTransfer``).

Never imports mlx: a simulation runs where MLX is absent.
"""

from .backend import Backend, SimBackend
from .clock import SimClock, WallClock
from .cluster import run_cluster
from .disagg import DisaggError, Pool, run_disaggregated
from .cost import LinearCostModel, ProfileError
from .loop import PolicyError, RunResult, run
from .sources import ArrivalSource, ClientSource, LiveSource, SourceClosed, TraceSource
from .metrics import format_summary, summarize
from .state import PlanError, ReplicaState, RequestState
from .transfer import KVTransfer, Link, TransferError

__all__ = [
    "ArrivalSource",
    "ClientSource",
    "LiveSource",
    "SimClock",
    "SourceClosed",
    "TraceSource",
    "WallClock",
    "Backend",
    "DisaggError",
    "KVTransfer",
    "Link",
    "Pool",
    "TransferError",
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
    "run_disaggregated",
    "summarize",
]
