"""``capacity``: for every configuration (policy x router x replicas, and cluster files), the
highest request rate at which the share of requests meeting every SLO stays at or above the
attainment (``analysis.capacity``: the definition, the search and its early stop).

``capacity`` returns one row per configuration: ``configuration``, ``policy``, ``router``, ``replicas``,
``gpus`` (the replicas' GPUs: a replica on ``PRESET:tp=N`` spans N, any other one), ``capacity_rps``,
``capacity_per_replica_rps``, ``capacity_per_gpu_rps`` (capacity_rps / gpus: DistServe's goodput
per GPU), ``price_usd_per_hour`` (of one replica:
given, else the preset's, else None), ``requests_per_usd`` (capacity_rps x 3600 / (replicas
x price): requests within the SLOs per dollar; None without a price or a capacity), ``limited``
(no failing rate found up to 2^10 x the start: the capacity is at least that, and so are its
requests per dollar), ``first_failing_rps``, ``binding`` (the SLO most requests missed at
the failing bound; ``unfinished``: requests never finished), ``attainment_at_capacity``, ``runs``, ``early_stops``, ``simulated_s`` (simulated seconds
of all its runs), ``saved_s_min`` (simulated seconds the early stops saved, at least),
``error``. ``df.attrs["points"]``: each configuration's search points (rate, attainment,
passed, stopped early, ...); ``df.attrs["info"]``: what capacity.json holds besides
(``price_source``: "preset NAME (URL)", "given" or None).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..errors import opt
from ._base import (
    PolicyLike,
    TraceLike,
    check_bool,
    check_callable,
    check_seed,
    executor_errors,
    executor_name,
    fail,
    option_map,
    out_dir,
    parse_formats,
    parse_slo,
    public,
    worker_count,
)
from .inputs import as_policy, as_trace
from .options import ClusterOptions, ReplicaOptions, merged

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

START_FACTOR = 2.0  # the default first rate per replica: this times the trace's own mean rate


@dataclass(frozen=True)
class _Config:
    """One configuration of the search: what a worker needs to build its runs."""

    label: str
    policy: Any  # a name or file.py:Class (in this process: also a class or an object)
    options: Mapping[str, Any]
    router: Any  # None: one replica without a router (the plain loop)
    router_options: Mapping[str, Any] | None
    replicas: int
    gpus: int  # GPUs of all its replicas (a replica on 'PRESET:tp=N' spans N)
    cluster: ClusterOptions | None  # a cluster file's (policy is then None)
    cost: tuple  # pick_cost's arguments: (profile, kv_tokens, hardware, model_config, quant, cost)
    start: float  # the first rate tried
    policy_names: str  # the table's policy column (a cluster file's: its groups' policies)


def _names(value: Any, what: str, example: str) -> list[Any]:
    """A comma-separated string or a list: its items, each once, in order; none is an error."""
    if isinstance(value, (str, Path)):
        items = [x.strip() for x in str(value).split(",") if x.strip()]
    elif isinstance(value, (list, tuple)):
        items = [x.strip() if isinstance(x, str) else x for x in value]
        items = [x for x in items if not (isinstance(x, str) and not x)]
    else:
        items = [value]
    out: list[Any] = []
    for x in items:
        if not any(x is y or (isinstance(x, (str, Path)) and x == y) for y in out):
            out.append(x)
    if not out:
        fail(f"{opt(what)} needs at least one {example}", 2)
    return out


def parse_replicas(replicas: int | str | Sequence[int]) -> list[int]:
    """Replica counts: ``"1,2,4"``, an integer or a list; each once, in order."""
    items = (
        replicas.split(",")
        if isinstance(replicas, str)
        else (list(replicas) if isinstance(replicas, (list, tuple)) else [replicas])
    )
    out: list[int] = []
    for item in items:
        if isinstance(item, str):
            item = item.strip()
            if not item:
                continue
            if not (item.isascii() and item.isdigit()):
                fail(f"{opt('replicas')}: every count must be an integer >= 1, got {item!r}", 2)
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int) or item < 1:
            fail(f"{opt('replicas')}: every count must be an integer >= 1, got {item!r}", 2)
        if item not in out:
            out.append(item)
    if not out:
        fail(f"{opt('replicas')} needs at least one count, e.g. 1,2,4", 2)
    return out


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        fail(f"{opt(name)} must be a number, got {value!r}", 2)
    return float(value)


def _as_float(value: Any) -> Any:
    """A string (``price_per_hour="2.5"``) as a float where it reads as one, else stripped (for
    the error message); anything else as it is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value.strip()
    return value


def _router_name(router: Any) -> str:
    """A router as the table names it (None: the default, round-robin)."""
    if router is None:
        return "round-robin"
    if isinstance(router, (str, Path)):
        return str(router)
    return str(getattr(router, "name", None) or getattr(router, "__name__", None) or type(router).__name__)


def _tp(hardware: Any) -> int:
    """GPUs per replica of a hardware spec (``a100-80gb-sxm:tp=2``: 2; None, a profile: 1)."""
    if hardware is None:
        return 1
    from schedlab.analysis.analytic.hardware import split_hardware

    return split_hardware(str(hardware))[1]


def _gpus(cu: ClusterOptions) -> int:
    """GPUs of a cluster: every group's count x its replicas' tensor-parallel degree."""
    if not cu.groups:
        return cu.replicas
    return sum(g.count * _tp(g.hardware) for g in cu.groups)


def _label(policy: str, router: Any, n: int) -> str:
    if router is None and n == 1:
        return policy
    return f"{policy} x{n} {_router_name(router)}"


@public
def capacity(
    policies: str | Sequence[PolicyLike] | None,
    trace: TraceLike,
    *,
    slo: str | Mapping[str, float],
    attainment: float = 0.99,
    tolerance: float = 0.02,
    routers: str | Sequence[Any] | None = None,
    replicas: int | str | Sequence[int] = 1,
    clusters: str | Path | ClusterOptions | Sequence[str | Path | ClusterOptions] | None = None,
    options: Mapping[str, Any] | None = None,
    router_options: Mapping[str, Any] | None = None,
    profile: Any = None,
    hardware: str | None = None,
    model_config: str | Path | None = None,
    quant: int | None = None,
    cost: Any = None,
    kv_tokens: int | None = None,
    block_size: int = 16,
    prefix_caching: bool = False,
    replica: ReplicaOptions | None = None,
    start_rps: float | None = None,
    price_per_hour: float | None = None,
    early_stop: bool = True,
    pd_splits: bool = False,
    seed: int = 0,
    workers: int | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    out: str | Path | None = None,
    formats: str | Sequence[str] = ("png", "svg"),
    on_start: Callable[[int, int], None] | None = None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
) -> "pd.DataFrame":
    """The SLO capacity of every configuration (the ``capacity`` command): the highest request
    rate (the trace's arrivals time-scaled to it, as ``sweep`` does) at which at least
    ``attainment`` of **all** requests finish and meet every SLO (``slo``: ``"ttft_ms=..,tpot_ms=.."``
    or a mapping; ``vllm bench serve --goodput``'s ``ttft``, ``tpot``, ``e2el`` too, in ms).

    Configurations: every ``policies`` x ``routers`` x ``replicas`` (a list or ``"a,b"``; no
    router and one replica: the plain single-replica loop; more replicas without a router:
    round-robin), and every cluster file in ``clusters`` (``ClusterOptions.from_file``; each with
    every router of ``routers`` when given, else its own). ``options``: every policy's;
    ``router_options``: every router's; ``profile`` or ``hardware`` + ``model_config``
    [+ ``quant``] or ``cost`` (a cost model object, as ``simulate`` takes), ``kv_tokens``,
    ``block_size``, ``prefix_caching`` (or ``replica``): the replicas of the policy
    configurations (a cluster file names its own). ``pd_splits``: every cluster file of one
    prefill group and one decode group stands for all of its prefill:decode splits of the same
    replicas (1:N-1 ... N-1:1; labelled ``STEM P:D``), the disaggregated configurations of N GPUs.

    The search (``schedlab.analysis.capacity``): from ``start_rps`` (default: twice the trace's
    mean rate) times the number of replicas, double or halve until one rate passes and one fails,
    then bisect geometrically until (hi - lo) / lo <= ``tolerance``; the passing bound is the
    capacity. A run that can no longer reach the attainment stops early (exact: it never changes
    a run's pass or fail; ``early_stop=False`` runs every run to its end). Configurations run in
    ``workers`` processes (default: min(CPU count, configurations)), each its search in order.

    Per dollar: ``price_per_hour`` is the hourly price in USD of ONE replica (a finite number
    > 0); it overrides the ``hardware`` preset's ``price_usd_per_hour`` (h100-sxm, a100-80gb-sxm
    and a100-40gb-sxm have one: one provider's on-demand price of one GPU, N times that for a
    replica of ``PRESET:tp=N``; quotes vary widely, so give yours) and is the only price a cluster
    file's configurations get.

    Returns one row per configuration (its columns: this module's docstring). ``out``: also
    write capacity.csv, capacity.json and the figures (capacity.png,
    attainment_vs_rate.png) there. A configuration for which no rate meets the SLOs has
    ``error`` "no rate meets the SLOs even at X req/s (the lowest tried): ..."; when every
    configuration has an error, that is raised instead (``SchedlabError``)."""

    from schedlab import traces
    from schedlab.analysis.capacity import requests_per_usd
    from schedlab.analysis.sweep import rescale

    check_callable(on_start, "on_start")
    check_callable(on_done, "on_done")
    check_bool(early_stop, "early_stop")
    check_bool(pd_splits, "pd_splits")
    slos, att, tol, price = _checked_search(slo, attainment, tolerance, start_rps, price_per_hour)
    executor, seed, fmts = executor_name(executor, ray_address), check_seed(seed), parse_formats(formats)
    rep = merged(
        ReplicaOptions, replica, "replica", kv_tokens=kv_tokens, block_size=block_size, prefix_caching=prefix_caching
    )
    own = (profile, hardware, model_config, quant, cost, kv_tokens, options)  # (the policy configurations')
    pols, rts, counts, files = _selection(policies, routers, replicas, clusters, router_options, own)
    opts = option_map(options)
    r_opts = option_map(router_options, "router") or None
    cost_spec = (profile, rep.kv_tokens, hardware, model_config, quant, cost)
    cost_meta = _cost_meta(cost_spec) if pols else {}  # (a bad profile or preset fails here, once)
    preset_price, price_source = _preset_price(price, hardware) if pols else (None, _given(price))
    tr = as_trace(trace, seed=seed)
    rescale(tr, 1.0)  # a trace whose rate cannot be set fails here
    # (default: one doubling above the trace's own rate: a passing run simulates the whole trace and
    # costs most at low rates, where batches are small; a failing one stops early)
    base = start_rps if start_rps is not None else START_FACTOR * traces.mean_rate(tr)

    configs = _policy_configs(pols, rts, counts, opts, r_opts, cost_spec, hardware, base)
    configs += _file_configs(files, rts, r_opts, pd_splits, base)
    n_workers = _workers(configs, workers, executor)
    out = out_dir(out)
    shared = {
        "trace": tr,
        "slo": slos,
        "attainment": att,
        "tolerance": tol,
        "early_stop": bool(early_stop),
        "block_size": rep.block_size,
        "prefix_caching": rep.prefix_caching,
    }
    rows = _search_all(configs, shared, n_workers, on_done, on_start, executor, ray_address)
    for cfg, row in zip(configs, rows):  # (a cluster file's configurations: only a given price)
        p = price if price is not None else (preset_price["value"] if preset_price and cfg.cluster is None else None)
        row.update(price_usd_per_hour=p, requests_per_usd=requests_per_usd(row.get("capacity_rps"), cfg.replicas, p))
    if all(r.get("error") for r in rows):  # nothing to report: the (first) reason, in one line
        first, rest = rows[0], [r["configuration"] for r in rows[1:]]
        more = f" (no capacity either: {', '.join(rest)})" if rest else ""
        fail(first["error"] if not rest else f"{first['configuration']}: {first['error']}{more}")
    info = _info(tr, slos, att, tol, bool(early_stop), base, price, preset_price, price_source, cost_meta, configs)
    info.update(block_size=rep.block_size, prefix_caching=rep.prefix_caching, seed=seed)
    table = _table(rows, info)
    table.attrs["files"] = _write(out, rows, info, f"{tr.name}: {len(tr)} requests", att, slos, fmts)
    return table


def _selection(policies, routers, replicas, clusters, router_options, own) -> tuple[list, list, list[int], list]:
    """The policies, routers (``[None]``: none given), replica counts and cluster files searched
    (``own``: the settings of the policy configurations, given only with policies)."""
    if policies is None and clusters is None:
        fail(f"give {opt('policy')} and/or {opt('cluster')} (the configurations to search)", 2)
    pols = _names(policies, "policy", "policy") if policies is not None else []
    if not pols and any(x is not None for x in own):
        fail(
            f"a cluster file names each group's policy, options, cost model and kv_tokens: {opt('profile')}, "
            f"{opt('hardware')}, {opt('kv_tokens')} and {opt('option')} go with {opt('policy')}",
            2,
        )
    if router_options and routers is None:
        fail(f"{opt('router_option')} goes with {opt('router')}: name the router too", 2)
    rts = _names(routers, "router", "router") if routers is not None else [None]
    files = _names(clusters, "cluster", "cluster file") if clusters is not None else []
    return pols, rts, parse_replicas(replicas), files


def _cost_meta(cost_spec: tuple) -> dict[str, Any]:
    """The policy configurations' cost model as capacity.json records it, with its KV capacity."""
    from .profiles import pick_cost

    _, kv_capacity, meta = pick_cost(*cost_spec)
    return {**meta, "kv_tokens": kv_capacity}


def _search_all(configs: list[_Config], shared: dict, n_workers, on_done, on_start, executor, ray_address) -> list:
    """Every configuration's search, in ``n_workers`` processes; the rows in the configurations' order."""
    from schedlab.analysis.executors import run_jobs

    # the largest deployments first (their runs are the longest): the workers finish together
    order = sorted(range(len(configs)), key=lambda i: -configs[i].replicas)
    with executor_errors():
        ran = run_jobs(
            _search_config, [configs[i] for i in order], shared, n_workers, on_done, on_start, executor, ray_address
        )
    return [row for _, row in sorted(zip(order, ran))]


def _workers(configs: list[_Config], workers: int | None, executor: str) -> int | None:
    """How many worker processes search the configurations; one line if a label is given twice."""
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        dup = next(x for x in labels if labels.count(x) > 1)
        fail(f"the configuration {dup!r} is given twice", 2)
    in_process = any(not isinstance(c.policy, (str, Path, type(None))) for c in configs)
    return worker_count(in_process, workers, executor, len(configs))


def _write(out: Path | None, rows, info, title: str, att: float, slos, fmts) -> list[Path]:
    """capacity.csv, capacity.json and the figures in ``out`` (None: nothing); the files written."""
    if out is None:
        return []
    from schedlab.analysis.capacity import plot_capacity, write_results

    try:
        written = write_results(out, rows, info)
        return written + plot_capacity(rows, out, attainment=att, slo=slos, title=title, formats=fmts)["files"]
    except OSError as exc:
        fail(f"cannot write to {out}: {exc.strerror or exc}")


def _checked_search(slo, attainment, tolerance, start_rps, price_per_hour) -> tuple:
    """The search's settings checked: (SLOs, attainment, tolerance, price per hour or None)."""
    slos = parse_slo(slo)
    if not slos:
        fail(f"give {opt('slo')}, e.g. ttft_ms=2000,tpot_ms=100 (the SLOs whose capacity is searched)", 2)
    att = _number(attainment, "attainment")
    if not 0 < att <= 1:
        fail(f"{opt('attainment')} must be in (0, 1], got {att:g}", 2)
    tol = _number(tolerance, "tolerance")
    if not (tol > 0 and math.isfinite(tol)):
        fail(f"{opt('tolerance')} must be a finite number > 0 (the search's relative precision), got {tol:g}", 2)
    if start_rps is not None:
        s0 = _number(start_rps, "start_rps")
        if not (s0 > 0 and math.isfinite(s0)):
            fail(f"{opt('start_rps')} must be a finite number > 0 (req/s), got {s0:g}", 2)
    price = None
    if price_per_hour is not None:
        price = _as_float(price_per_hour)
        if isinstance(price, bool) or not isinstance(price, (int, float)):
            fail(f"{opt('price_per_hour')} must be a number (USD per hour of one replica), got {price!r}", 2)
        price = float(price)
        if not (price > 0 and math.isfinite(price)):
            fail(
                f"{opt('price_per_hour')} must be a finite number > 0 (USD per hour of one replica), got {price:g}",
                2,
            )
    return slos, att, tol, price


def _given(price: float | None) -> str | None:
    return "given" if price is not None else None  # (capacity.json's info)


def _preset_price(price: float | None, hardware: Any) -> tuple[dict | None, str | None]:
    """The policy configurations' price from the ``hardware`` preset (one replica's: a replica of
    ``PRESET:tp=N`` costs N GPUs), when no price is given; and where the price comes from."""
    preset_price = None
    if price is None and hardware is not None:
        from schedlab.analysis.analytic.hardware import preset_price as read_price

        preset_price = read_price(hardware)
    price_source = _given(price)
    if preset_price:  # (one GPU's: a replica of PRESET:tp=N costs N times that)
        preset_price = {**preset_price, "value": preset_price["value"] * _tp(hardware)}
        urls = ", ".join(x["url"] for x in preset_price["sources"])
        price_source = f"preset {str(hardware).strip().lower()}" + (f" ({urls})" if urls else "")
    return preset_price, price_source


def _policy_configs(pols, rts, counts, opts, r_opts, cost_spec, hardware, base: float) -> list[_Config]:
    """Every policy x router x replica count (bad names and options fail here, at once)."""
    configs: list[_Config] = []
    for p in pols:
        pol = as_policy(p, opts if isinstance(p, (str, Path, type)) else None)  # bad names, options: here
        name = str(p) if isinstance(p, (str, Path)) else str(getattr(pol, "name", type(pol).__name__))
        for rt in rts:
            for n in counts:
                if rt is not None or n > 1:
                    ClusterOptions(replicas=n, router=rt, router_options=r_opts).make_router()
                gpus = n * _tp(hardware)
                configs.append(
                    _Config(_label(name, rt, n), p, opts, rt, r_opts, n, gpus, None, cost_spec, base * n, name)
                )
    return configs


def _file_configs(files, rts, r_opts, pd_splits: bool, base: float) -> list[_Config]:
    """Every cluster file (each prefill:decode split of it with ``pd_splits``) x router."""
    from .deployments import build

    configs: list[_Config] = []
    splits = []
    for f in files:
        cu = f if isinstance(f, ClusterOptions) else ClusterOptions.from_file(f)
        stem = Path(cu.file).stem if cu.file else "cluster"
        splits += [(s, f"{stem} {label}" if label else stem) for s, label in _pd_splits(cu, pd_splits, stem)]
    if pd_splits and not any(cu.disaggregated for cu, _ in splits):
        fail(f"{opt('pd_splits')} goes with a {opt('cluster')} file of prefill and decode pools", 2)
    for cu, stem in splits:
        for rt in rts:
            c = cu if rt is None else dataclasses.replace(cu, router=rt, router_options=r_opts)
            names = "+".join(
                dict.fromkeys(str(getattr(p, "name", type(p).__name__)) for p in build(None, None, cluster=c).policies)
            )
            label = stem if rt is None else f"{stem} {_router_name(rt)}"
            configs.append(
                _Config(
                    label,
                    None,
                    {},
                    c.router or "round-robin",
                    c.router_options,
                    c.replicas,
                    _gpus(c),
                    c,
                    (),
                    base * c.replicas,
                    names,
                )
            )
    return configs


def _info(tr, slos, att, tol, early_stop, base, price, preset_price, price_source, cost_meta, configs) -> dict:
    """What capacity.json holds besides the rows: the trace, the definitions, the prices."""
    from schedlab import traces

    return {
        "trace": tr.name,
        "trace_requests": len(tr),
        "trace_rate_rps": traces.mean_rate(tr),
        "rate_definition": "(requests - 1) / (last arrival - first arrival); arrivals rescaled with traces.to_rate",
        "slo": slos,
        "attainment": att,
        "tolerance": tol,
        "capacity_definition": (
            f"highest rate found at which at least {att:g} of all requests finished and met every SLO "
            f"(vllm bench serve --goodput rule); the passing bound of a bracket [capacity, first failing) "
            f"narrowed by geometric bisection until (hi - lo) / lo <= {tol:g}"
        ),
        "early_stop": early_stop,
        "early_stop_rule": (
            "a run stops once (N - certain misses) / N < attainment: a request is a certain miss when it "
            "finished or was refused and missed an SLO, has no first token more than the TTFT SLO after "
            "its arrival, or is unfinished more than the E2E SLO after it"
        ),
        "start_rps_per_replica": base,
        "price_usd_per_hour": price if price is not None else (preset_price or {}).get("value"),
        "price_source": price_source,
        "price_note": (preset_price or {}).get("note") or None,
        "requests_per_usd_definition": (
            "capacity_rps * 3600 / (replicas * price_usd_per_hour), price_usd_per_hour being one replica's "
            "(--price-per-hour, else the --hardware preset's; a cluster file's configurations: only a given one)"
        ),
        "cost": cost_meta or None,  # the policy configurations' (a cluster file names its own)
        "clusters": [str(c.cluster.file) for c in configs if c.cluster is not None and c.cluster.file] or None,
    }


def _table(rows: list[dict], info: dict) -> "pd.DataFrame":
    """The rows as the returned table (numbers as numbers), with its info and search points."""
    import pandas as pd

    from schedlab.analysis.capacity import TABLE_FIELDS

    table = pd.DataFrame([{k: r.get(k) for k in TABLE_FIELDS} for r in rows], columns=list(TABLE_FIELDS))
    for c in (
        "capacity_rps",
        "capacity_per_replica_rps",
        "capacity_per_gpu_rps",
        "price_usd_per_hour",
        "requests_per_usd",
        "first_failing_rps",
        "attainment_at_capacity",
    ):
        table[c] = pd.to_numeric(table[c], errors="coerce")
    table.attrs["info"] = info
    table.attrs["points"] = {r["configuration"]: r["points"] for r in rows}
    table.attrs["info"] = info
    table.attrs["points"] = {r["configuration"]: r["points"] for r in rows}
    return table


# ------------------------------------------------------------------------ in a worker


def _pd_splits(cu: ClusterOptions, wanted: bool, stem: str) -> list[tuple[ClusterOptions, str]]:
    """The cluster file as it is (``wanted`` False, or a file without pools), or every
    prefill:decode split of its replicas: (options, label ``P:D``)."""
    if not wanted or not cu.disaggregated:
        return [(cu, "")]
    if len(cu.groups) != 2:
        fail(
            f"{cu.file or stem}: {opt('pd_splits')} takes a file of one prefill group and one decode group, "
            f"got {len(cu.groups)} groups",
            2,
        )
    pre, dec = cu.groups
    n = pre.count + dec.count  # (>= 2: a pooled file has a group of each)
    return [
        (
            dataclasses.replace(
                cu, groups=(dataclasses.replace(pre, count=p), dataclasses.replace(dec, count=n - p)), replicas=n
            ),
            f"{p}:{n - p}",
        )
        for p in range(1, n)
    ]


def _runner(cfg: _Config, block_size: int, prefix_caching: bool):
    """``run_fn(arrivals, name)``: one simulation of the configuration, its deployment built
    afresh every run (policies and routers keep state)."""
    from schedlab.sim import run

    from .deployments import build
    from .profiles import pick_cost

    replica = ReplicaOptions(block_size=block_size, prefix_caching=prefix_caching)
    cu = cfg.cluster
    if cu is None and (cfg.router is not None or cfg.replicas > 1):
        cu = ClusterOptions(replicas=cfg.replicas, router=cfg.router, router_options=cfg.router_options)
    picked = pick_cost(*cfg.cost) if cfg.cluster is None else None  # (once: its model is the same every run)
    policy = cfg.policy

    fresh = isinstance(policy, (str, Path, type))

    def run_fn(arrivals, name):
        spec, opts = (policy, cfg.options) if fresh else (copy.deepcopy(policy), None)
        deployment = build(spec, opts, replica=replica, cluster=cu, picked=picked)
        if deployment.disaggregated:  # (the pools run in turn: on the whole trace, no early stop)
            arrivals = arrivals.requests if hasattr(arrivals, "process") else arrivals
        return run(deployment, arrivals, trace_name=name, record_steps=False, record_passes=False)

    return run_fn


def _search_config(cfg: _Config, shared: Mapping[str, Any]) -> dict[str, Any]:
    """One configuration's search, start to end (in a worker process, or here)."""
    from schedlab.analysis.capacity import evaluate, search

    trace, slo, att = shared["trace"], shared["slo"], shared["attainment"]
    row: dict[str, Any] = {
        "configuration": cfg.label,
        "policy": cfg.policy_names,
        "router": _router_name(cfg.router) if cfg.router is not None or cfg.replicas > 1 else None,
        "replicas": cfg.replicas,
        "gpus": cfg.gpus,
        "start_rps": cfg.start,
    }
    try:
        run_fn = _runner(cfg, shared["block_size"], shared["prefix_caching"])
        found = search(
            lambda rate: evaluate(trace, rate, run_fn, slo, att, shared["early_stop"]), cfg.start, shared["tolerance"]
        )
    except Exception as exc:  # a user's policy or router: this configuration's error, the others go on
        row.update({k: None for k in ("capacity_rps", "first_failing_rps", "binding", "attainment_at_capacity")})
        row.update(
            limited=False,
            points=[],
            runs=0,
            early_stops=0,
            simulated_s=0.0,
            saved_s_min=0.0,
            capacity_per_replica_rps=None,
            capacity_per_gpu_rps=None,
            error=f"{type(exc).__name__}: {' '.join(str(exc).split())}",
        )
        return row
    pts = found["points"]
    cap = found["capacity_rps"]
    row.update(
        capacity_rps=cap,
        capacity_per_replica_rps=cap / cfg.replicas if cap is not None else None,
        capacity_per_gpu_rps=cap / cfg.gpus if cap is not None else None,
        limited=found["limited"],
        first_failing_rps=found["first_failing_rps"],
        binding=found["binding"],
        attainment_at_capacity=found["attainment_at_capacity"],
        runs=len(pts),
        early_stops=sum(1 for p in pts if p["stopped_early"]),
        simulated_s=sum(p["simulated_s"] or 0.0 for p in pts),
        saved_s_min=sum(p["saved_s_min"] or 0.0 for p in pts),
        error=found["error"],
        points=pts,
    )
    return row
