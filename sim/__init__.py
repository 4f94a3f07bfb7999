"""The simulator core: the replica loop, clocks, arrival sources, the request state machine,
the backend protocol and ``SimBackend``, the cost model, metrics and run outputs.

What runs is a ``Deployment`` (replica groups, router, faults, KV transfer; ``sim.deployment``)
and ``run(deployment, arrivals)`` simulates it: one replica, several behind a router
(``Cluster``), or prefill and decode on different replicas with the KV moved between them
(``KVTransfer``). ``run_replica`` drives one replica's loop with any backend and clock (the
real engine's runs).

Never imports mlx: a simulation runs where MLX is absent.
"""

from .backend import Backend, SimBackend
from .clock import SimClock, WallClock
from .cluster import Cluster
from .deployment import Deployment, DeploymentError, Group
from .disagg import DisaggError
from .cost import LinearCostModel, ProfileError
from .loop import PolicyError, RunResult, run_replica
from .runner import run
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
    "Cluster",
    "Deployment",
    "DeploymentError",
    "Group",
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
    "run_replica",
    "summarize",
]
