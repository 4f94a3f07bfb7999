"""``simulate``: a policy over a trace on a simulated replica with a calibrated cost model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ._base import PolicyLike, TraceLike, check_bool, check_seed, fail, parse_slo, public
from ..errors import SchedlabError, SchedlabWarning, opt
from .inputs import as_trace
from .options import ClientOptions, ClusterOptions, ReplicaOptions, merged
from .profiles import ProfileLike
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
    fail: Any = (),
    cluster: ClusterOptions | None = None,
    speculative: str | Mapping[str, Any] | None = None,
) -> Run:
    """Simulate ``policy`` on ``trace`` (the ``simulate`` command).

    ``options``: the policy's options (``-o``); ``profile``: a cost profile (default: the
    bundled measured one); ``hardware`` + ``model_config`` [+ ``quant``]: the analytic
    roofline model instead of a profile; ``cost``: any cost model object (``pass_seconds``,
    ``step_overhead_seconds``) or a ``ReplicaCostModel``; ``seed``: the trace's randomness;
    ``slo``: goodput SLOs (``{"ttft_ms": 2000, "tpot_ms": 100}``); ``passes=False``: keep no
    pass log (no ``run.passes``, no passes.parquet; less memory and time on long traces, what
    ``simulate`` does without ``--passes``).

    The replica (``replica``, a ``ReplicaOptions``, or its fields ``kv_tokens``, ``block_size``,
    ``prefix_caching``) and the clients (``clients``, a ``ClientOptions``, or its fields
    ``max_concurrency``, ``request_rate``, ``burstiness``, ``think_time``): see those classes.

    Several replicas behind a router (``cluster``, a ``ClusterOptions``, or its fields
    ``replicas``, ``router``, ``router_options``, ``router_delay``, ``fail``): each replica its own copy of
    the policy, KV cache and backend, one arrival source, the router choosing at each arrival;
    ``run.summary`` gains ``cluster`` and ``replicas`` (one summary per replica) and
    ``run.requests`` a ``replica`` column when there is more than one replica.

    A heterogeneous cluster: ``cluster=ClusterOptions(groups=[ReplicaGroup(...), ...])`` or
    ``ClusterOptions.from_file("cluster.toml")`` (``simulate --cluster``), each group its own
    policy, cost model and KV capacity; ``policy`` is then None and none of ``options``,
    ``profile``, ``hardware``, ``model_config``, ``quant``, ``cost``, ``kv_tokens`` is given.
    Each replica's summary names its group, policy, cost model and KV capacity, and meta.json's
    ``cluster.groups`` each group's.

    ``speculative``: speculative decoding (``"ngram:k=4,accept=0.8/0.6/0.4/0.3"``,
    ``"draft:model=tiny,k=3,accept=..."`` or a mapping of ``method``, ``k``, ``adaptive``,
    ``accept``, ``seed``, ``model``, ``draft_profile``; a draft model's passes are priced by its
    bundled profile or ``draft_profile``): every replica's policy lets its decode
    rows verify up to k draft tokens (``policies.speculative``), each row's accepted drafts drawn
    from the per-position acceptance ``accept`` (``P1/P2/...``, or a JSON file that holds one: a
    run's summary.json, a ``calibrate --speculative`` profile, a trace; without it, the trace's
    own ``speculative_acceptance``); ``run.summary["speculative"]`` counts them as vLLM's
    spec-decode metrics do."""
    from schedlab.sim import DisaggError, run
    from schedlab.sim.gcpause import gc_paused
    from schedlab.sim.metrics import summarize

    from .deployments import build, label_summary, parse_speculative, run_meta

    seed = check_seed(seed)
    check_bool(passes, "passes")
    cluster_options = merged(
        ClusterOptions,
        cluster,
        "cluster",
        replicas=replicas,
        router=router,
        router_options=router_options,
        router_delay=router_delay,
        fail=fail,
    )
    grouped = bool(cluster_options.groups)  # each group names its policy
    if grouped:
        _no_own_settings(policy, options, profile, hardware, model_config, quant, cost, kv_tokens, replica)
    replica_options = merged(
        ReplicaOptions, replica, "replica", kv_tokens=kv_tokens, block_size=block_size, prefix_caching=prefix_caching
    )
    cost_source = (profile, replica_options.kv_tokens, hardware, model_config, quant, cost)
    spec = parse_speculative(speculative)
    loaded_trace = _loaded(trace, seed, replica_options.prefix_caching)
    deployment = build(
        policy, options, cost_source, replica_options, cluster_options, speculative=trace_acceptance(spec, loaded_trace)
    )
    slos = parse_slo(slo)
    client_options = merged(
        ClientOptions,
        clients,
        "clients",
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        think_time=think_time,
    )
    arrivals = client_options.arrivals(loaded_trace.requests, seed)
    try:
        result = run(deployment, arrivals, trace_name=loaded_trace.name, record_passes=passes)
    except DisaggError as exc:
        where = f"{cluster_options.file}: " if cluster_options.file else ""
        raise SchedlabError(f"{where}{exc}", 2) from None  # (``fail`` is the failures here)
    several = deployment.router is not None

    @gc_paused()
    def summary():  # when first needed (saving writes the large tables meanwhile)
        s = summarize(result, slo=slos or None)
        return label_summary(s, deployment, result) if several else s

    return Run(result, summary, run_meta(deployment, result, grouped, seed))


def trace_acceptance(spec: dict[str, Any] | None, trace) -> dict[str, Any] | None:
    """``parse_speculative``'s ``spec`` with its acceptance profile: ``accept`` as given, else
    the trace's own ``speculative_acceptance``, else none (the deployment then says how to give
    one)."""
    if spec is None or spec.get("accept") is not None or trace.speculative_acceptance is None:
        return spec
    from schedlab.sim.speculation import Acceptance

    where = f"the speculative_acceptance of trace {trace.name}"
    return dict(spec, accept=Acceptance.from_entry(trace.speculative_acceptance, source=where, where=where))


def _no_own_settings(policy, options, profile, hardware, model_config, quant, cost, kv_tokens, replica) -> None:
    """A cluster of groups: each group names its policy, cost model and KV capacity, so the
    run itself is given none of them."""
    given = [
        name
        for name, v in (
            ("policy", policy),
            ("options", options),
            ("profile", profile),
            ("hardware", hardware),
            ("model_config", model_config),
            ("quant", quant),
            ("cost", cost),
            ("kv_tokens", kv_tokens if kv_tokens is not None else getattr(replica, "kv_tokens", None)),
        )
        if v is not None and not (isinstance(v, Mapping) and not v)
    ]
    if given:
        fail(
            f"the cluster's groups name each replica's policy, cost model and KV capacity: give {given[0]} in "
            f"a ReplicaGroup (or the cluster file's [[group]]), not beside them (policy=None)",
            2,
        )


def _loaded(trace: TraceLike, seed: int, prefix_caching: bool):
    """The trace, with a ``SchedlabWarning`` where prefix caching cannot see what its text prompts
    share: the simulator keys a prompt's blocks by its ``prefix_ids``; text it keys by token ids
    only where a model's tokenizer counts them (the real engine)."""
    import warnings

    trace = as_trace(trace, seed=seed)
    n = sum(1 for r in trace.requests if r.has_text and not r.prefix_ids) if prefix_caching else 0
    if n:
        warnings.warn(
            f"{opt('prefix_caching')}: {n} of {len(trace)} request(s) have text prompts and no prefix_ids: the "
            "simulated cache sees nothing they share (it keys text by the model's token ids, which the real "
            "engine has: run-real or validate --prefix-caching)",
            SchedlabWarning,
            stacklevel=3,
        )
    return trace
