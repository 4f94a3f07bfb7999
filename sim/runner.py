"""The one runner: ``run(deployment, arrivals) -> RunResult`` simulates any deployment.

One replica with no router is the plain replica loop (``loop.run_replica``); replicas behind a
router are a ``cluster.Cluster``; a prefill pool and a decode pool are ``disagg.run_disaggregated``
(each pool a cluster of its own). Every simulation the commands and the Python API start goes
through here; a real run drives the same replica loop with an MLX backend and a wall clock
(``loop.run_replica``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from schedlab.traces.schema import Request

from .cluster import Cluster
from .deployment import Deployment, DeploymentError
from .disagg import run_disaggregated
from .loop import RunResult, run_replica
from .sources import ArrivalSource


def run(
    deployment: Deployment,
    arrivals: Sequence[Request] | ArrivalSource,
    *,
    trace_name: str = "trace",
    record_steps: bool = True,
    record_passes: bool = True,
    token_keys: Callable[[Any], Sequence[int] | None] | None = None,
) -> RunResult:
    """Simulate ``deployment`` over ``arrivals`` (a trace's requests, or an arrival source such
    as closed-loop clients). ``record_steps=False``: keep no step log (``record_passes=False``:
    no pass log): less memory and time when only the requests' metrics are wanted;
    ``token_keys``: a request's prompt token ids for the prefix cache."""
    if not isinstance(deployment, Deployment):
        raise DeploymentError(f"run takes a Deployment, got {type(deployment).__name__}")
    if deployment.disaggregated:
        return run_disaggregated(deployment, arrivals, trace_name=trace_name)
    if deployment.router is None:
        g = deployment.groups[0]
        return run_replica(
            arrivals,
            g.policies[0],
            g.cost_model,
            kv_capacity=g.kv_capacity,
            trace_name=trace_name,
            record_steps=record_steps,
            block_size=deployment.block_size,
            prefix_caching=deployment.prefix_caching,
            token_keys=token_keys,
            record_passes=record_passes,
            acceptance=deployment.acceptance,
        )
    cluster = Cluster(
        deployment,
        arrivals,
        trace_name=trace_name,
        record_steps=record_steps,
        record_passes=record_passes,
        token_keys=token_keys,
    )
    return cluster.run()
