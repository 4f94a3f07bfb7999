"""Prefill and decode on different replicas (disaggregated serving), simulated.

A request is prefilled in the **prefill pool** (its replica produces the first token, as
DistServe, Splitwise and vLLM's disaggregated prefill do), its KV is moved to a replica of the
**decode pool** (``sim.transfer``: the link's latency and bandwidth, whole or layer by layer
overlapped with the prefill), and decoded there. Each pool is a cluster of its own (``sim.cluster``:
its replicas' policies, cost model, KV capacity and router). TTFT is the prefill's first token;
the transfer shows in the second token's gap.

On the decode replica the request arrives with its prompt's KV (``kv_transferred``): its prompt
is the original prompt plus the first token, of which only that token is left to compute; the
policy plans it as any prompt with one token left (a one-token chunk that yields the next token,
or mlx-lm's hand-off into the decode batch). A request of one output token ends in the prefill
pool.

The pools run one after the other: the prefill pool over the trace, then the decode pool over the
transferred requests at their arrival times. That is exact for a trace's arrivals (open loop):
nothing the decode pool does reaches the prefill pool. Closed-loop clients (a finish frees a
client's slot) would need both pools in one clock, and are refused here, as are a prefix cache
(a transferred prompt's KV is no cached prefix) and cancellations.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from schedlab.traces.schema import Request

from .cluster import Cluster, merged_passes, merged_steps
from .deployment import Deployment, DeploymentError
from .loop import RunResult
from .state import RequestState
from .transfer import KVTransfer


class DisaggError(DeploymentError):
    """A disaggregated run that cannot be made: its message is one line for a user."""


@dataclass(frozen=True)
class TransferredRequest(Request):
    """A request as the decode pool receives it: ``kv_transferred`` of its prompt tokens' KV came
    with it (the rest, one token, is computed there)."""

    kv_transferred: int = 0


def _partial(req: Request, index: int, p: RequestState) -> RequestState:
    """A request that did not finish: as its client saw it, its first token at most."""
    if p.first_token_s is None:
        return RequestState(req, index)
    return RequestState.as_seen(req, index, p.admitted_s, [p.first_token_s])


def _merged(req: Request, index: int, p: RequestState, d: RequestState | None) -> RequestState:
    """One request as its client saw it: admitted and first token from the prefill pool, every
    later token from the decode pool."""
    times = [p.first_token_s] + (d.token_times if d is not None else [])
    return RequestState.as_seen(
        req,
        index,
        p.admitted_s,
        times,
        d.finish_s if d is not None else p.finish_s,
        p.preemptions + (d.preemptions if d is not None else 0),
        p.recomputed_tokens + (d.recomputed_tokens if d is not None else 0),
    )


def run_disaggregated(
    deployment: Deployment, arrivals: Sequence[Request] | Any, *, trace_name: str = "trace"
) -> RunResult:
    """Simulate ``arrivals`` on ``deployment``'s prefill pool and decode pool (its groups'
    ``pool``; each pool behind its own copy of the deployment's router) with its ``transfer``
    between them (None: a free move). The result is the whole run's, every request as its client
    saw it (in arrival order; ``replica``: the decode replica that finished it, numbered after the
    prefill pool's, or its prefill replica when it had one output token); ``replicas``: the
    prefill pool's results, then the decode pool's; ``cluster["transfer_s"]``: each request's
    exposed transfer seconds."""
    if hasattr(arrivals, "process"):
        raise DisaggError("a disaggregated run replays a trace's arrivals; closed-loop clients are not supported yet")
    reqs = list(arrivals)
    if any(r.cancel_after_s is not None for r in reqs):
        raise DisaggError("a disaggregated run does not support cancellations (cancel_after_s) yet")
    transfer = deployment.transfer
    if transfer is not None and not isinstance(transfer, KVTransfer):
        raise DisaggError(f"transfer must be a KVTransfer or None, got {type(transfer).__name__}")
    # each pool its own router object (routers keep state), both as the deployment's was made
    prefill = deployment.pool("prefill", copy.deepcopy(deployment.router))
    decode = deployment.pool("decode", copy.deepcopy(deployment.router))
    router_delay = deployment.router_delay

    def pool_run(pool: Deployment, trace: list[Request]) -> RunResult:
        return Cluster(pool, trace, trace_name=trace_name).run()

    first = pool_run(prefill, [dataclasses.replace(r, output_tokens=1) for r in reqs])
    by_p = {r.id: r for r in first.requests}
    p_replica = dict(zip((r.id for r in first.requests), first.replica or [0] * len(first.requests)))
    transfer_s: dict[str, float] = {}
    moved: list[TransferredRequest] = []
    for r in reqs:
        p = by_p[r.id]
        if r.output_tokens <= 1 or p.first_token_s is None:
            continue
        exposed = 0.0
        if transfer is not None:
            exposed = transfer.exposed_seconds(r.prompt_tokens, p.first_token_s - p.admitted_s)
        transfer_s[r.id] = exposed
        moved.append(
            TransferredRequest(
                r.id,
                p.first_token_s + exposed,
                r.prompt_tokens + 1,
                r.output_tokens - 1,
                kv_transferred=r.prompt_tokens,
            )
        )
    moved.sort(key=lambda m: m.arrival_s)  # (stable: ties keep the trace's order)
    second = pool_run(decode, moved) if moved else None
    by_d = {r.id: r for r in second.requests} if second is not None else {}
    d_replica = dict(zip((r.id for r in second.requests), second.replica)) if second is not None else {}
    n_p = prefill.replicas
    why = {r.id: w for r, w in first.rejected}
    if second is not None:
        why.update({r.id: w for r, w in second.rejected})
    requests, replica, rejected = [], [], []
    for i, r in enumerate(reqs):
        p, d = by_p[r.id], by_d.get(r.id)
        done = p.first_token_s is not None and (r.output_tokens <= 1 or (d is not None and d.finish_s is not None))
        if done and r.id not in why:
            requests.append(_merged(r, i, p, d))
        else:  # refused by either pool, or left unfinished by an error: what its client got
            st = _partial(r, i, p)
            requests.append(st)
            if r.id in why:
                rejected.append((st, why[r.id]))
        replica.append(n_p + d_replica[r.id] if d is not None else p_replica[r.id])
    parts = list(first.replicas or [first]) + (list(second.replicas or [second]) if second is not None else [])
    return RunResult(
        policy=f"{first.policy}+{second.policy}" if second is not None else first.policy,
        mode="sim",
        trace=trace_name,
        requests=requests,
        rejected=rejected,
        steps=merged_steps([x.steps for x in parts]),
        passes=merged_passes([x.passes for x in parts]),
        wall_s=first.wall_s + (second.wall_s if second is not None else 0.0),
        meta=first.meta,
        error=first.error or (second.error if second is not None else None),
        kv_capacity=first.kv_capacity,
        block_size=deployment.block_size,
        replica=replica,
        replicas=parts,
        speculative=second.speculative if second is not None else None,
        cluster={
            "replicas": len(parts),
            "router": (first.cluster or {}).get("router"),
            "disaggregated": True,
            "prefill": {"replicas": n_p, "router": (first.cluster or {}).get("router")},
            "decode": {
                "replicas": decode.replicas,
                "router": (second.cluster or {}).get("router") if second is not None else None,
            },
            "transfer": None
            if transfer is None
            else {
                "mode": transfer.mode,
                "link": transfer.link.name,
                "bandwidth_gbs": transfer.link.bandwidth_gbs,
                "latency_s": transfer.link.latency_s,
                "bytes_per_token": transfer.bytes_per_token,
            },
            "transfer_s": transfer_s,
            "router_delay": router_delay,
        },
    )
