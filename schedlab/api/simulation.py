"""``simulate``: a policy over a trace on a simulated replica with a calibrated cost model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping

from ._base import PolicyLike, TraceLike, check_seed, fail, parse_slo, policy_options, public
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
    fail: Any = (),
    cluster: ClusterOptions | None = None,
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
    ``cluster.groups`` each group's."""
    from schedlab.sim import run as run_loop
    from schedlab.sim.gcpause import gc_paused
    from schedlab.sim.metrics import summarize

    seed = check_seed(seed)
    grouped = isinstance(cluster, ClusterOptions) and bool(cluster.groups)  # each group names its policy
    if grouped:
        _no_own_settings(policy, options, profile, hardware, model_config, quant, cost, kv_tokens, replica)
    policy_object = None if grouped else as_policy(policy, options)
    slos = parse_slo(slo)
    loaded_trace = as_trace(trace, seed=seed)
    replica_options = merged(
        ReplicaOptions, replica, "replica", kv_tokens=kv_tokens, block_size=block_size, prefix_caching=prefix_caching
    )
    client_options = merged(
        ClientOptions,
        clients,
        "clients",
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        think_time=think_time,
    )
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
    router_object = cluster_options.make_router() if cluster_options.used else None
    arrivals = client_options.arrivals(loaded_trace.requests, seed)
    if grouped:
        groups = _build_groups(cluster_options)
        model, capacity = groups.costs, groups.capacities
        cost_meta = groups.common_meta()
    else:
        groups = None
        model, capacity, cost_meta = pick_cost(profile, replica_options.kv_tokens, hardware, model_config, quant, cost)
    extra: dict[str, Any] = {}
    if grouped and cluster_options.disaggregated:
        result = _disaggregated(
            cluster_options,
            groups,
            arrivals,
            loaded_trace.name,
            replica_options.block_size,
            replica_options.prefix_caching,
        )
        extra["cluster"] = {**dict(result.cluster), **groups.meta(cluster_options.file)}
    elif router_object is None:
        result = run_loop(
            arrivals,
            policy_object,
            model,
            kv_capacity=capacity,
            trace_name=loaded_trace.name,
            block_size=replica_options.block_size,
            prefix_caching=replica_options.prefix_caching,
            record_passes=bool(passes),
        )
    else:
        from schedlab.sim.cluster import run_cluster

        # each replica its own policy object (policies keep state between steps)
        fresh = isinstance(policy, (str, Path, type))
        if groups is not None:
            policy_objects = groups.policies
        else:
            policy_objects = [policy_object] + [
                as_policy(policy, options) if fresh else copy.deepcopy(policy_object)
                for _ in range(cluster_options.replicas - 1)
            ]
            groups = _Groups.plain(policy_objects, model, capacity, cost_meta)
        get = getattr(router_object, "options", None)
        built_router_options = get() if callable(get) else dict(cluster_options.router_options or {})
        result = run_cluster(
            arrivals,
            policy_objects,
            model,
            router_object,
            kv_capacity=capacity,
            router_delay=cluster_options.router_delay,
            trace_name=loaded_trace.name,
            block_size=replica_options.block_size,
            prefix_caching=replica_options.prefix_caching,
            record_passes=bool(passes),
            router_options=built_router_options,
            fail=cluster_options.fail,
        )
        extra["cluster"] = dict(result.cluster)
        if grouped:  # (a plain --replicas cluster: one group, the run's policy and cost model)
            extra["cluster"].update(groups.meta(cluster_options.file))

    @gc_paused()
    def summary():  # when first needed (saving writes the large tables meanwhile)
        s = summarize(result, slo=slos or None)
        s = groups.label(s, result) if groups is not None else s
        pools = (result.cluster or {}).get("prefill") if (result.cluster or {}).get("disaggregated") else None
        for part in s.get("replicas") or () if pools else ():
            part["pool"] = "prefill" if part["replica"] < pools["replicas"] else "decode"
        return s

    return Run(
        result,
        summary,
        {
            **cost_meta,
            "kv_tokens": result.kv_capacity if groups is None else groups.kv_tokens(result),
            "block_size": replica_options.block_size,
            "prefix_caching": replica_options.prefix_caching,
            "seed": seed,
            "policy_options": policy_options(policy_object) if policy_object is not None else groups.common_options(),
            **extra,
        },
    )


def _disaggregated(
    cu: ClusterOptions, groups: "_Groups", arrivals, trace_name: str, block_size: int, prefix_caching: bool
):
    """A cluster of a prefill pool and a decode pool (the groups' ``pool``), the KV moved between
    them as its ``transfer`` table says (``sim.disagg.run_disaggregated``)."""
    from schedlab.sim.disagg import DisaggError, Pool, run_disaggregated

    where = f"{cu.file}: " if cu.file else ""
    if prefix_caching:
        fail(f"{where}a disaggregated cluster has no prefix cache yet: drop prefix caching", 2)
    n_p = sum(g.count for g in cu.groups if g.pool == "prefill")
    transfer = _transfer(cu, where)

    def pool(lo: int, hi: int | None) -> Pool:
        rt = cu.make_router()
        get = getattr(rt, "options", None)
        r_opts = get() if callable(get) else dict(cu.router_options or {})
        return Pool(groups.policies[lo:hi], groups.costs[lo:hi], rt, groups.capacities[lo:hi], r_opts)

    try:
        return run_disaggregated(
            arrivals,
            pool(0, n_p),
            pool(n_p, None),
            transfer,
            trace_name=trace_name,
            block_size=block_size,
            router_delay=cu.router_delay,
        )
    except DisaggError as exc:
        fail(f"{where}{exc}", 2)


def _transfer(cu: ClusterOptions, where: str):
    """The ``KVTransfer`` of a disaggregated cluster's ``transfer`` table: its link (a preset, the
    groups' one hardware preset's own, or a bandwidth and latency) and the KV bytes of its model
    config (given, or the groups' one model config)."""
    from schedlab.analysis.analytic import AnalyticError, kv_transfer, link_preset, split_hardware
    from schedlab.sim.transfer import KVTransfer, Link, TransferError

    t = dict(cu.transfer or {})
    link = t.get("link")
    if link is None and t.get("bandwidth_gbs") is None:
        try:  # (the presets, not their ':tp=N': a TP-2 prefill and a TP-1 decode group share one link)
            hws = {split_hardware(str(g.hardware))[0] for g in cu.groups if g.hardware is not None}
        except AnalyticError as exc:
            fail(f"{where}transfer: {exc}", 2)
        if len(hws) != 1:
            fail(
                f"{where}transfer: give link (a preset: nvlink4, pcie5-x16, ib-ndr-400, ...) or bandwidth_gbs; "
                f"the groups name no one hardware preset whose link it would be",
                2,
            )
        link = hws.pop()
    mode = t.get("mode", "layerwise")
    try:
        lk = (
            link_preset(link, t.get("latency_s"))
            if link
            else Link(t["bandwidth_gbs"], t.get("latency_s", 0.0), "given")
        )
        if t.get("kv_bytes_per_token") is not None:  # (a model with no config: its KV's size given)
            return KVTransfer(t["kv_bytes_per_token"], t.get("layers", 1), lk, mode)
        mc = t.get("model_config")
        if mc is None:
            mcs = {str(g.model_config) for g in cu.groups if g.model_config is not None}
            if len(mcs) != 1:
                fail(
                    f"{where}transfer: give model_config (the model whose KV moves) or kv_bytes_per_token: the groups "
                    "name no one model config",
                    2,
                )
            mc = mcs.pop()
        return kv_transfer(mc, lk, mode, kv_bits=t.get("kv_bits", 16))
    except (AnalyticError, TransferError) as exc:
        fail(f"{where}transfer: {exc}", 2)


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


def _cost_label(meta: Mapping[str, Any]) -> str:
    """A cost model in a few words, as each replica's summary names it."""
    if "profile" in meta:
        return Path(meta["profile"]).name
    a = meta.get("analytic")
    if isinstance(a, Mapping):
        bits = a.get("quant_bits")
        return " ".join(
            str(x) for x in (a.get("hardware"), a.get("model_config"), f"{bits}-bit" if bits else None) if x
        )
    return str(meta.get("cost_model", "cost model"))


class _Groups:
    """A cluster's replicas group by group: each replica's policy object, cost model, KV
    capacity (as asked) and group; what the summary and meta.json say of them."""

    def __init__(self) -> None:
        self.policies: list[Any] = []
        self.costs: list[Any] = []
        self.capacities: list[int] = []
        self.group_of: list[int] = []  # each replica's group, counted from 1
        self.cost_metas: list[dict[str, Any]] = []  # per group
        self.options: list[dict[str, Any]] = []  # per replica

    def add(self, pols: list[Any], cost: Any, capacity: int, cost_meta: Mapping[str, Any]) -> None:
        self.cost_metas.append(dict(cost_meta))
        k = len(self.cost_metas)
        for pol in pols:
            self.policies.append(pol)
            self.costs.append(cost)
            self.capacities.append(capacity)
            self.group_of.append(k)
            self.options.append(policy_options(pol))

    @classmethod
    def plain(cls, pols: list[Any], cost: Any, capacity: int, cost_meta: Mapping[str, Any]) -> "_Groups":
        """``--replicas N``: one group of N replicas alike."""
        g = cls()
        g.add(pols, cost, capacity, cost_meta)
        return g

    def names(self) -> list[str]:
        return [str(getattr(p, "name", type(p).__name__)) for p in self.policies]

    def common_meta(self) -> dict[str, Any]:
        """The cost model's meta when every group has the same one, else none (meta.json's
        ``cluster.groups`` has each group's)."""
        first = self.cost_metas[0]
        return dict(first) if all(m == first for m in self.cost_metas) else {}

    def common_options(self) -> dict[str, Any] | None:
        """The policies' options when every replica runs the same policy alike, else None
        (meta.json's ``cluster.groups`` has each group's)."""
        names = self.names()
        same = all(o == self.options[0] and n == names[0] for o, n in zip(self.options, names))
        return dict(self.options[0]) if same else None

    def kv_tokens(self, result) -> int | list[int]:
        """The KV capacity: one number, or one per replica when they differ."""
        caps = [p.kv_capacity for p in result.replicas or ()] or [result.kv_capacity]
        return caps[0] if len(set(caps)) == 1 else caps

    def meta(self, file: str | None) -> dict[str, Any]:
        """meta.json's ``cluster`` additions: the file, and each group's replicas (first, last),
        policy, its options, cost model and KV capacity."""
        names = self.names()
        out: list[dict[str, Any]] = []
        for k, cm in enumerate(self.cost_metas, 1):
            idx = [i for i, g in enumerate(self.group_of) if g == k]
            i = idx[0]
            out.append(
                {
                    "group": k,
                    "replicas": [i, idx[-1]],
                    "count": len(idx),
                    "policy": names[i],
                    "policy_options": self.options[i],
                    **cm,
                    "kv_tokens": self.capacities[i],
                }
            )
        return {**({"file": file} if file else {}), "groups": out}

    def label(self, s: dict[str, Any], result) -> dict[str, Any]:
        """The summary with each replica's group, policy, cost model and KV capacity in its own
        summary, and the policies' names joined when they differ."""
        names = self.names()
        parts = s.get("replicas")
        if parts:
            caps = [p.kv_capacity for p in result.replicas]
            s["replicas"] = [
                {
                    "replica": p["replica"],
                    "group": self.group_of[p["replica"]],
                    "policy": names[p["replica"]],
                    "cost": _cost_label(self.cost_metas[self.group_of[p["replica"]] - 1]),
                    "kv_tokens": caps[p["replica"]],
                    **{k: v for k, v in p.items() if k != "replica"},
                }
                for p in parts
            ]
        distinct = list(dict.fromkeys(names))
        if len(distinct) > 1:
            s["policy"] = "+".join(distinct)
        return s


def _build_groups(cu: ClusterOptions) -> _Groups:
    """Each group's policy objects (one per replica) and cost model; a name that is not found
    is one line naming the file and the group."""
    from ..errors import _CLI, SchedlabError, user_error_types

    out = _Groups()
    where = f"{cu.file}: " if cu.file else ""
    token = _CLI.set(False)  # the groups' keys, not the command's flags
    try:
        for k, g in enumerate(cu.groups, 1):
            try:
                spec = g.policy
                fresh = isinstance(spec, (str, Path, type))
                pols = [as_policy(spec if fresh else copy.deepcopy(spec), g.options) for _ in range(g.count)]
                model, capacity, cost_meta = pick_cost(
                    g.profile, g.kv_tokens, g.hardware, g.model_config, g.quant, g.cost
                )
            except user_error_types() as exc:
                raise SchedlabError(f"{where}group {k}: {exc}", getattr(exc, "code", 1)) from None
            out.add(pols, model, capacity, cost_meta)
    finally:
        _CLI.reset(token)
    return out
