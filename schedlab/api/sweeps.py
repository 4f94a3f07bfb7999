"""``sweep``: every policy at every request rate and/or number of closed-loop clients, simulated
in worker processes; ``plot_sweep``: its latency-vs-load figure."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..errors import opt
from ._base import (
    PolicyLike,
    TraceLike,
    check_callable,
    check_seed,
    executor_errors,
    executor_name,
    fail,
    is_frame,
    option_map,
    out_dir,
    parse_formats,
    parse_slo,
    public,
    worker_count,
)
from .inputs import as_policy, as_trace
from .options import ClientOptions, ReplicaOptions, merged, parse_rate
from .profiles import ProfileLike, linear_model

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure

#: the sweep table's columns that count something (integers; NaN where absent)
_COUNTS = (
    "requests",
    "finished",
    "rejected",
    "max_concurrency",
    "peak_concurrency",
    "preemptions",
    "recomputed_tokens",
)


def parse_rates(rates: str | float | Sequence[float]) -> list[float]:
    """Request rates (req/s): ``"0.5,1,2"``, a number or a list; sorted, each once."""
    if isinstance(rates, (int, float)) and not isinstance(rates, bool):
        rates = [rates]
    items = rates.split(",") if isinstance(rates, str) else list(rates)
    out = []
    for item in items:
        if isinstance(item, str):
            item = item.strip()
            if not item:
                continue
            try:
                v = float(item)
            except ValueError:
                fail(f"{opt('rates')}: {item!r} is not a number", 2)
        elif isinstance(item, bool) or not isinstance(item, (int, float)):
            fail(f"{opt('rates')}: {item!r} is not a number", 2)
        else:
            v = float(item)
        if not (v > 0 and math.isfinite(v)):
            fail(f"{opt('rates')}: every rate must be a finite number > 0 (requests/s), got {item}", 2)
        out.append(v)
    if not out:
        fail(
            f"{opt('rates')} needs at least one rate, e.g. "
            f"{'--rates 0.5,1,2' if opt('rates') != 'rates' else 'rates=[0.5, 1, 2]'}",
            2,
        )
    return sorted(set(out))


def parse_concurrency(concurrency: str | int | Sequence[int]) -> list[int]:
    """Numbers of closed-loop clients: ``"1,2,4"``, an integer or a list; sorted, each once."""
    if isinstance(concurrency, int) and not isinstance(concurrency, bool):
        concurrency = [concurrency]
    items = concurrency.split(",") if isinstance(concurrency, str) else list(concurrency)
    out = []
    for item in items:
        if isinstance(item, str):
            item = item.strip()
            if not item:
                continue
            if not (item.isascii() and item.isdigit()) or int(item) < 1:
                fail(f"{opt('concurrency')}: every value must be an integer >= 1 (clients), got {item!r}", 2)
            item = int(item)
        elif isinstance(item, bool) or not isinstance(item, int) or item < 1:
            fail(f"{opt('concurrency')}: every value must be an integer >= 1 (clients), got {item!r}", 2)
        out.append(item)
    if not out:
        fail(
            f"{opt('concurrency')} needs at least one value, e.g. "
            f"{'--concurrency 1,2,4,8' if opt('concurrency') != 'concurrency' else 'concurrency=[1, 2, 4, 8]'}",
            2,
        )
    return sorted(set(out))


def sweep_rows(table: "pd.DataFrame") -> list[dict[str, Any]]:
    """The rows of a ``sweep`` table as dicts: None where a value is absent, counts as ints
    (what ``analysis.sweep``'s table and figure take)."""
    rows = table.astype(object).where(table.notna(), None).to_dict("records")
    for r in rows:
        for c in _COUNTS:
            if isinstance(r.get(c), float):
                r[c] = int(r[c])
    return rows


class _Built:
    """A policy object or class in an in-process sweep: ``run_job`` calls it for the policy."""

    def __init__(self, spec, options, label):
        self.spec, self.options, self.label = spec, options, label

    def __call__(self):
        return as_policy(self.spec, self.options if isinstance(self.spec, type) else None)

    def __str__(self) -> str:
        return self.label


@public
def sweep(
    policies: str | Sequence[PolicyLike],
    trace: TraceLike,
    rates: str | Sequence[float] | None = None,
    *,
    concurrency: str | int | Sequence[int] | None = None,
    options: Mapping[str, Any] | None = None,
    profile: ProfileLike = None,
    kv_tokens: int | None = None,
    block_size: int = 16,
    prefix_caching: bool = False,
    replica: ReplicaOptions | None = None,
    request_rate: float | str | None = None,
    burstiness: float | None = None,
    think_time: float | None = None,
    slo: str | Mapping[str, float] | None = None,
    attainment: float = 0.9,
    seed: int = 0,
    workers: int | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    out: str | Path | None = None,
    formats: str | Sequence[str] = ("png", "svg"),
    on_start: Callable[[int, int], None] | None = None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
) -> "pd.DataFrame":
    """Simulate every policy at every request rate (the trace's arrivals rescaled to it) and/or
    behind every number of closed-loop clients, in worker processes (the ``sweep`` command).
    Returns one row per (policy, rate, concurrency) with the latency percentiles, throughput,
    goodput and SLO attainment (``sweep.csv``'s columns; a row whose simulation failed has
    ``error``; ``sweep_rows(table)``: the rows as dicts). ``df.attrs["info"]`` holds what
    sweep.json holds besides the rows, ``max_sustained_rate`` among it when ``slo`` is given to a
    rate sweep.

    ``policies``: names or ``"file.py:Class"`` specs (a list, or ``"a,b"``); classes and
    objects run in this process (``workers`` 1); ``options``: for every policy; ``rates``:
    request rates (req/s; a list or ``"0.5,1,2"``); ``concurrency``: numbers of clients (at most
    that many requests in flight); with it, ``request_rate`` [+ ``burstiness``] sends the
    requests on ``vllm bench serve``'s schedule instead of the trace's times and ``think_time``
    pauses each client (see ``ClientOptions``); ``replica`` (or ``kv_tokens``, ``block_size``,
    ``prefix_caching``): the replica (see ``ReplicaOptions``); ``slo`` and ``attainment``: the
    highest rate each policy sustains; ``out``: also write sweep.csv, sweep.json and the
    latency-vs-load figure there. ``on_start(jobs, workers)`` and ``on_done(row)`` report
    progress."""

    from schedlab.analysis.sweep import max_sustained_rate, rescale
    from schedlab.analysis.sweep import sweep as run_sweep

    check_callable(on_start, "on_start")
    check_callable(on_done, "on_done")
    pols = _policy_list(policies)
    rate_list, conc_list, clients = _grid(rates, concurrency, request_rate, burstiness, think_time)
    rep = merged(
        ReplicaOptions, replica, "replica", kv_tokens=kv_tokens, block_size=block_size, prefix_caching=prefix_caching
    )
    fmts = parse_formats(formats)
    opts = option_map(options)
    slos = parse_slo(slo)
    _check_attainment(attainment)
    executor = executor_name(executor, ray_address)
    seed = check_seed(seed)
    in_process = any(not isinstance(p, str) for p in pols)
    labels = []
    for p in pols:  # bad names and options fail here, once, not in every worker
        pol = as_policy(p, opts if isinstance(p, (str, type)) else None)
        labels.append(p if isinstance(p, str) else getattr(pol, "name", type(pol).__name__))
    if len(set(labels)) != len(labels):
        fail(f"{opt('policy')}: a policy is given twice", 2)
    tr = as_trace(trace, seed=seed)
    if rate_list:
        rescale(tr, rate_list[0])  # a trace whose rate cannot be set fails here
    cost, capacity, profile_path = linear_model(profile, rep.kv_tokens)
    out = out_dir(out)
    n_jobs = len(pols) * len(rate_list or [None]) * len(conc_list or [None])
    n_workers = worker_count(in_process, workers, executor, n_jobs)
    jobs_pols = [p if isinstance(p, str) else _Built(p, opts, label) for p, label in zip(pols, labels)]
    settings = {
        "block_size": rep.block_size,
        "prefix_caching": rep.prefix_caching,
        "request_rate": clients.request_rate,
        "burstiness": clients.burstiness,
        "think_s": clients.think_time or 0.0,
        "seed": seed,
    }
    with executor_errors():
        rows = run_sweep(
            tr,
            jobs_pols,
            rate_list,
            cost,
            capacity,
            options=opts,
            slo=slos or None,
            workers=n_workers,
            on_done=on_done,
            on_start=on_start,
            concurrency=conc_list,
            settings=settings,
            executor=executor,
            ray_address=ray_address,
        )
    sustained = max_sustained_rate(rows, attainment) if slos and rate_list and not conc_list else None
    info = _info(tr, profile_path, capacity, seed, labels, rate_list, opts, slos, conc_list, rep, clients)
    if sustained is not None:
        info.update(_sustained(attainment, sustained))
    table = _table(rows, info, tr)
    files = _write(out, rows, info, table, fmts)
    table.attrs["files"] = files
    return table


def _policy_list(policies) -> list:
    """The policies, as a list: ``"a,b"`` split (each once), a list as it is, one policy alone."""
    if isinstance(policies, str):
        pols: list = list(dict.fromkeys(p.strip() for p in policies.split(",") if p.strip()))
    elif isinstance(policies, (list, tuple)):
        pols = list(policies)
    else:
        pols = [policies]
    if not pols:
        fail(f"{opt('policy')} needs at least one policy", 2)
    return pols


def _grid(rates, concurrency, request_rate, burstiness, think_time):
    """The rates and client counts swept, and the clients' options, checked together."""
    if rates is None and concurrency is None:
        fail(
            f"give {opt('rates')} (request rates to rescale the trace to) and/or {opt('concurrency')} "
            f"(numbers of clients)",
            2,
        )
    rate_list = parse_rates(rates) if rates is not None else None
    conc_list = parse_concurrency(concurrency) if concurrency is not None else None
    client_rate = parse_rate(request_rate)
    if (client_rate is not None or think_time is not None) and conc_list is None:
        fail(
            f"{opt('request_rate')} and {opt('think_time')} shape the clients of {opt('concurrency')}: "
            f"give {opt('concurrency')} too",
            2,
        )
    if client_rate is not None and rate_list is not None:
        fail(
            f"give either {opt('rates')} (rescale the trace) or {opt('request_rate')} (the clients' schedule), "
            f"not both",
            2,
        )
    clients = ClientOptions(conc_list[0] if conc_list else None, client_rate, burstiness, think_time)
    return rate_list, conc_list, clients


def _check_attainment(attainment: Any) -> None:
    if isinstance(attainment, bool) or not isinstance(attainment, (int, float)) or not 0 < attainment <= 1:
        fail(
            f"{opt('attainment')} must be in (0, 1], got {attainment:g}"
            if isinstance(attainment, (int, float))
            else f"{opt('attainment')} must be in (0, 1], got {attainment!r}",
            2,
        )


def _info(tr, profile_path, capacity, seed, labels, rate_list, opts, slos, conc_list, rep, clients) -> dict[str, Any]:
    """What sweep.json holds besides the rows."""
    from schedlab import traces

    return {
        "trace": tr.name,
        "trace_requests": len(tr),
        "trace_rate_rps": traces.mean_rate(tr),
        "rate_definition": "(requests - 1) / (last arrival - first arrival); arrivals rescaled with traces.to_rate",
        "profile": str(profile_path),
        "kv_tokens": capacity,
        "seed": seed,
        "policies": labels,
        "rates_rps": rate_list,
        "options": {k: v if isinstance(v, (str, int, float, bool)) else str(v) for k, v in opts.items()},
        "slo": slos or None,
        "concurrency": conc_list,
        "block_size": rep.block_size,
        "prefix_caching": rep.prefix_caching,
        "clients": {
            "request_rate": clients.request_rate,
            "burstiness": clients.burstiness,
            "think_s": clients.think_time or 0.0,
        }
        if conc_list
        else None,
    }


def _sustained(attainment: float, sustained: Any) -> dict[str, Any]:
    return {
        "attainment": attainment,
        "max_sustained_rate": sustained,
        "max_sustained_rate_definition": (
            f"largest swept rate r such that at r and at every lower swept rate at least {attainment:g} "
            f"of all requests finished and met every SLO (vllm bench serve --goodput rule)"
        ),
    }


def _table(rows: list[dict], info: dict, tr) -> "pd.DataFrame":
    """The rows as the returned table (absent numbers as NaN, as the CSV reads back)."""
    import pandas as pd

    from schedlab.analysis.sweep import ROW_FIELDS

    table = pd.DataFrame(rows, columns=list(ROW_FIELDS))
    for c in ("max_concurrency", "peak_concurrency", "preemptions", "recomputed_tokens", "prefix_hit_rate"):
        if c in table.columns:  # (absent values are NaN, as the CSV reads back)
            table[c] = pd.to_numeric(table[c], errors="coerce")
    table.attrs["info"] = info
    table.attrs["offered_tok_per_req"] = sum(r.output_tokens for r in tr.requests) / len(tr)
    return table


def _write(out: Path | None, rows, info, table, fmts) -> list[Path]:
    """sweep.csv, sweep.json and the latency-vs-load figure in ``out`` (None: nothing)."""
    if out is None:
        return []
    from schedlab.analysis.sweep import write_results

    try:
        return write_results(out, rows, info) + _sweep_figure(table, out, fmts)[1]
    except OSError as exc:
        fail(f"cannot write to {out}: {exc.strerror or exc}")


def _sweep_figure(table, out: Path | None, formats: Sequence[str]):
    from schedlab.analysis.sweep import plot_sweep as draw

    info = table.attrs.get("info") or {}
    profile = info.get("profile")
    blocks = f" in blocks of {info['block_size']}" if info.get("block_size") is not None else ""
    title = (
        (
            f"{info.get('trace')}: {info.get('trace_requests')} requests, KV {info.get('kv_tokens')} tokens{blocks}, "
            f"profile {Path(profile).name if profile else '-'}"
        )
        if info
        else ""
    )
    fig = draw(
        sweep_rows(table),
        out,
        slo=info.get("slo"),
        attainment=info.get("attainment", 0.9),
        sustained=info.get("max_sustained_rate"),
        offered_tok_per_req=table.attrs.get("offered_tok_per_req"),
        title=title,
        formats=formats,
    )
    return fig["figure"], fig["files"]


@public
def plot_sweep(
    table: "pd.DataFrame", *, out: str | Path | None = None, formats: str | Sequence[str] = ("png", "svg")
) -> "Figure":
    """The latency-vs-load figure of a ``sweep`` table (``out``: also write it there)."""
    if not is_frame(table) or "rate_rps" not in table.columns:
        fail("plot_sweep takes the DataFrame sweep() returns", 2)
    try:
        return _sweep_figure(table, out_dir(out), parse_formats(formats))[0]
    except OSError as exc:
        fail(f"cannot write to {out}: {exc.strerror or exc}")
