"""``simulate``: a policy over a trace on a simulated replica with a calibrated cost model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping

from ._base import PolicyLike, TraceLike, check_seed, parse_slo, policy_options, public
from .inputs import as_policy, as_trace
from .options import ClientOptions, ClusterOptions, ReplicaOptions, merged
from .profiles import ProfileLike, pick_cost
from .runs import Run


@public
def simulate(
    policy: PolicyLike,
    trace: TraceLike,
    *,
    options: Mapping[str, Any] | None = None,
    profile: ProfileLike = None,
    kv_tokens: int | None = None,
    hardware: str | None = None,
    model_config: str | Path | None = None,
    quant: int | None = None,
    cost: Any = None,
    seed: int = 0,
    slo: str | Mapping[str, float] | None = None,
    block_size: int = 16,
    prefix_caching: bool = False,
    max_concurrency: int | None = None,
    request_rate: float | str | None = None,
    burstiness: float | None = None,
    think_time: float | None = None,
    passes: bool = True,
    replica: ReplicaOptions | None = None,
    clients: ClientOptions | None = None,
    replicas: int = 1,
    router: Any = None,
    router_options: Mapping[str, Any] | None = None,
    router_delay: float = 0.0,
    cluster: ClusterOptions | None = None,
) -> Run:
    """Simulate ``policy`` on ``trace`` (the ``simulate`` command).

    ``options``: the policy's options (``-o``); ``profile``: a cost profile (default: the
    bundled measured one); ``hardware`` + ``model_config`` [+ ``quant``]: the analytic
    roofline model instead of a profile; ``cost``: any cost model object (``pass_seconds``,
    ``step_overhead_seconds``) or a ``CostModel``; ``seed``: the trace's randomness;
    ``slo``: goodput SLOs (``{"ttft_ms": 2000, "tpot_ms": 100}``); ``passes=False``: keep no
    pass log (no ``run.passes``, no passes.parquet; less memory and time on long traces, what
    ``simulate`` does without ``--passes``).

    The replica (``replica``, a ``ReplicaOptions``, or its fields ``kv_tokens``, ``block_size``,
    ``prefix_caching``) and the clients (``clients``, a ``ClientOptions``, or its fields
    ``max_concurrency``, ``request_rate``, ``burstiness``, ``think_time``): see those classes.

    Several replicas behind a router (``cluster``, a ``ClusterOptions``, or its fields
    ``replicas``, ``router``, ``router_options``, ``router_delay``): each replica its own copy of
    the policy, KV cache and backend, one arrival source, the router choosing at each arrival;
    ``run.summary`` gains ``cluster`` and ``replicas`` (one summary per replica) and
    ``run.requests`` a ``replica`` column when there is more than one replica."""
    from schedlab.sim import run as run_loop
    from schedlab.sim.gcpause import gc_paused
    from schedlab.sim.metrics import summarize

    seed = check_seed(seed)
    pol = as_policy(policy, options)
    slos = parse_slo(slo)
    tr = as_trace(trace, seed=seed)
    rep = merged(
        ReplicaOptions, replica, "replica", kv_tokens=kv_tokens, block_size=block_size, prefix_caching=prefix_caching
    )
    cl = merged(
        ClientOptions,
        clients,
        "clients",
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        think_time=think_time,
    )
    cu = merged(
        ClusterOptions,
        cluster,
        "cluster",
        replicas=replicas,
        router=router,
        router_options=router_options,
        router_delay=router_delay,
    )
    rt = cu.make_router() if cu.used else None
    arrivals = cl.arrivals(tr.requests, seed)
    model, capacity, cost_meta = pick_cost(profile, rep.kv_tokens, hardware, model_config, quant, cost)
    extra: dict[str, Any] = {}
    if rt is None:
        result = run_loop(
            arrivals,
            pol,
            model,
            kv_capacity=capacity,
            trace_name=tr.name,
            block_size=rep.block_size,
            prefix_caching=rep.prefix_caching,
            record_passes=bool(passes),
        )
    else:
        from schedlab.sim.cluster import run_cluster

        # each replica its own policy object (policies keep state between steps)
        fresh = isinstance(policy, (str, Path, type))
        pols = [pol] + [as_policy(policy, options) if fresh else copy.deepcopy(pol) for _ in range(cu.replicas - 1)]
        get = getattr(rt, "options", None)
        r_opts = get() if callable(get) else dict(cu.router_options or {})
        result = run_cluster(
            arrivals,
            pols,
            model,
            rt,
            kv_capacity=capacity,
            router_delay=cu.router_delay,
            trace_name=tr.name,
            block_size=rep.block_size,
            prefix_caching=rep.prefix_caching,
            record_passes=bool(passes),
            router_options=r_opts,
        )
        extra["cluster"] = dict(result.cluster)

    @gc_paused()
    def summary():  # when first needed (saving writes the large tables meanwhile)
        return summarize(result, slo=slos or None)

    return Run(
        result,
        summary,
        {
            **cost_meta,
            "kv_tokens": result.kv_capacity,
            "block_size": rep.block_size,
            "prefix_caching": rep.prefix_caching,
            "seed": seed,
            "policy_options": policy_options(pol),
            **extra,
        },
    )
