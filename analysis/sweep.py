"""Load sweeps: one trace at several request rates and/or client concurrencies, every
(policy, rate, concurrency) simulated.

The trace's arrival times are rescaled (``traces.to_rate``) so that its mean rate,
(requests - 1) / (last arrival - first arrival), equals each swept rate; the shape of the
arrival pattern and every request's lengths are kept. A swept concurrency C puts closed-loop
clients in front of the replica (``sim.sources.clients``): requests issued in trace order
at the trace's (rescaled) times, or at a ``request_rate`` schedule, each sent once fewer
than C are in flight (``vllm bench serve --max-concurrency``). Each (policy, rate,
concurrency) is one ``sim.run`` plus ``summarize`` -- a job; jobs run in worker processes.

Highest sustained rate
----------------------
With SLOs, a request is *good* when it finished and meets every SLO given
(``sim.metrics.meets_slo``, the rule of ``vllm bench serve --goodput``); a run's SLO
attainment is good requests / all requests of the trace (rejected and unfinished requests
count as misses). A policy *sustains* a swept rate r when its attainment is at least the
threshold (default 0.9) at r **and at every lower swept rate**; its highest sustained rate
is the largest such r, or none when the lowest swept rate already fails. Requiring every
lower rate too keeps one lucky point past the knee (attainment is not always monotone in
load) from being reported. When the highest swept rate is sustained, the true limit may be
higher: ``limited_by_sweep`` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .executors import default_workers, run_jobs

ROW_FIELDS = (
    "policy",
    "rate_rps",
    "requests",
    "finished",
    "rejected",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tpot_p50_ms",
    "e2e_p50_ms",
    "output_throughput_tok_s",
    "request_throughput_rps",
    "goodput_rps",
    "slo_attainment",
    "makespan_s",
    "error",
    "max_concurrency",
    "peak_concurrency",
    "preemptions",
    "recomputed_tokens",
    "prefix_hit_rate",
)
DEFAULT_ATTAINMENT = 0.9


def rescale(trace, rps: float):
    """The trace with arrival times scaled so its mean rate is ``rps`` (first arrival at 0)."""
    from schedlab.traces import to_rate

    return to_rate(trace, rps)


@dataclass(frozen=True)
class Job:
    index: int
    policy: Any  # as the user gave it: a bundled name or file.py:Class (in-process: a callable making the policy)
    options: Mapping[str, str]
    rate: float | None  # None: the trace's own times
    concurrency: int | None = None  # None: no client limit


def row_from_summary(
    policy: str, rate: float | None, s: Mapping[str, Any], concurrency: int | None = None
) -> dict[str, Any]:
    """One table row from a summary (summarize()'s dict)."""
    clients = s.get("clients") or {}
    return {
        "policy": policy,
        "rate_rps": rate,
        "requests": s["requests"],
        "finished": s["finished"],
        "rejected": s["rejected"],
        "ttft_p50_ms": s["ttft_ms"].get("p50"),
        "ttft_p99_ms": s["ttft_ms"].get("p99"),
        "itl_p50_ms": s["itl_ms"].get("p50"),
        "itl_p99_ms": s["itl_ms"].get("p99"),
        "tpot_p50_ms": s["tpot_ms"].get("p50"),
        "e2e_p50_ms": s["e2e_ms"].get("p50"),
        "output_throughput_tok_s": s["output_throughput_tok_s"],
        "request_throughput_rps": s["request_throughput_rps"],
        "goodput_rps": s.get("goodput_rps"),
        "slo_attainment": s.get("slo_attainment"),
        "makespan_s": s["makespan_s"],
        "error": s.get("error"),
        "max_concurrency": concurrency,
        "peak_concurrency": clients.get("peak_concurrency"),
        "preemptions": s.get("preemptions", 0),
        "recomputed_tokens": s.get("recomputed_tokens", 0),
        "prefix_hit_rate": (s.get("prefix_cache") or {}).get("hit_rate"),
    }


#: How every job runs, besides its policy, rate and concurrency (``sweep(settings=...)``).
DEFAULT_SETTINGS = {
    "block_size": 1,
    "prefix_caching": False,
    "request_rate": None,
    "burstiness": None,
    "think_s": 0.0,
    "seed": 0,
}


def run_job(
    job: Job,
    trace,
    cost_model,
    kv_capacity: int,
    slo: Mapping[str, float] | None,
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Simulate one (policy, rate, concurrency); any failure becomes the row's ``error`` (one line)."""
    from schedlab.policies import make_policy

    from schedlab.sim import Deployment, run
    from schedlab.sim.metrics import summarize
    from schedlab.sim.sources import clients

    st = {**DEFAULT_SETTINGS, **(settings or {})}
    label = job.policy if isinstance(job.policy, str) else str(job.policy)
    try:
        tr = rescale(trace, job.rate) if job.rate is not None else trace
        pol = make_policy(job.policy, dict(job.options)) if isinstance(job.policy, str) else job.policy()
        arrivals = clients(
            tr.requests, job.concurrency, st["request_rate"], st["burstiness"], st["think_s"], st["seed"]
        )
        deployment = Deployment.one(
            pol, cost_model, kv_capacity=kv_capacity, block_size=st["block_size"], prefix_caching=st["prefix_caching"]
        )
        result = run(deployment, arrivals, trace_name=tr.name, record_steps=False)
        row = row_from_summary(label, job.rate, summarize(result, slo=slo or None), job.concurrency)
    except Exception as exc:  # a user's policy or a bad option: keep the other jobs going
        row = {k: None for k in ROW_FIELDS}
        row.update(
            policy=label,
            rate_rps=job.rate,
            max_concurrency=job.concurrency,
            error=f"{type(exc).__name__}: {' '.join(str(exc).split())}",
        )
    row["index"] = job.index
    return row


def _sweep_job(job: Job, shared: tuple) -> dict[str, Any]:
    return run_job(job, *shared)


def sweep(
    trace,
    policies: Sequence[Any],  # names or file.py:Class specs (in-process: callables making the policy)
    rates: Sequence[float | None] | None,
    cost_model,
    kv_capacity: int,
    *,
    options: Mapping[str, str] | None = None,
    slo: Mapping[str, float] | None = None,
    workers: int | None = None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    concurrency: Sequence[int | None] | None = None,
    settings: Mapping[str, Any] | None = None,
    executor: str = "local",
    ray_address: str | None = None,
) -> list[dict[str, Any]]:
    """Every (policy, rate, concurrency), rows in that order. ``rates`` None: the trace's own
    times; ``concurrency`` None: no client limit. ``settings``: block size, prefix caching and
    the clients' schedule (``DEFAULT_SETTINGS``). ``workers`` 1 runs in-process; ``executor``
    and ``ray_address``: where the jobs run (``analysis.executors``).

    ``on_start(jobs, workers)`` is called once the jobs are queued (and the worker processes
    started); ``on_done(row)`` after each job. Ctrl-C (KeyboardInterrupt) cancels jobs not
    started, stops the workers and re-raises.
    """
    rate_list = [None if r is None else float(r) for r in (rates or [None])]
    conc_list = list(concurrency or [None])
    jobs = [
        Job(i, p, dict(options or {}), r, c)
        for i, (p, r, c) in enumerate((p, r, c) for p in policies for r in rate_list for c in conc_list)
    ]
    n = workers if workers is not None or executor == "ray" else default_workers(len(jobs))
    shared = (trace, cost_model, kv_capacity, slo, settings)
    rows = run_jobs(_sweep_job, jobs, shared, n, on_done, on_start, executor, ray_address)
    rows.sort(key=lambda r: r["index"])
    for r in rows:
        r.pop("index", None)
    return rows


# ------------------------------------------------------------------------ analysis


def max_sustained_rate(
    rows: Sequence[Mapping[str, Any]], attainment: float = DEFAULT_ATTAINMENT
) -> dict[str, dict[str, Any]]:
    """Per policy: the highest sustained rate (module docstring) and whether the sweep limited it."""
    out: dict[str, dict[str, Any]] = {}
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for pol in policies:
        mine = sorted((r for r in rows if r["policy"] == pol), key=lambda r: r["rate_rps"])
        best = None
        failed_at = None
        for r in mine:
            a = r.get("slo_attainment")
            if r.get("error") or a is None or a < attainment:
                failed_at = r["rate_rps"]
                break
            best = r["rate_rps"]
        out[pol] = {
            "rate_rps": best,
            "first_failing_rate_rps": failed_at,
            "limited_by_sweep": best is not None and failed_at is None,
        }
    return out


def _num(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return fmt.format(v)


def format_table(rows: Sequence[Mapping[str, Any]], slo: bool = False) -> str:
    cols = [("policy", "policy", "{}")]
    if any(r.get("rate_rps") is not None for r in rows):
        cols.append(("rate_rps", "rate/s", "{:g}"))
    if any(r.get("max_concurrency") is not None for r in rows):
        cols.append(("max_concurrency", "clients", "{:d}"))
    cols += [
        ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
        ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
        ("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
        ("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
        ("output_throughput_tok_s", "tok/s", "{:.1f}"),
        ("request_throughput_rps", "req/s", "{:.2f}"),
    ]
    if any(r.get("preemptions") for r in rows):
        cols.append(("preemptions", "preempted", "{:d}"))
    if any(r.get("prefix_hit_rate") is not None for r in rows):
        cols.append(("prefix_hit_rate", "prefix hits", "{:.0%}"))
    if slo:
        cols += [("goodput_rps", "goodput req/s", "{:.2f}"), ("slo_attainment", "SLO met", "{:.0%}")]
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        line = [_num(r.get(k), f) if k != "policy" else str(r[k]) for k, _, f in cols]
        if r.get("error"):
            line[next(i for i, (k, _, _) in enumerate(cols) if k == "ttft_p50_ms")] = "error"
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    out = []
    for j, c in enumerate(cells):
        out.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_results(out_dir, rows, info: Mapping[str, Any]) -> list:
    return write_table(out_dir, "sweep", ROW_FIELDS, rows, info, "rows")


def write_table(out_dir, name: str, fields, rows, info: Mapping[str, Any], key: str) -> list:
    """NAME.csv (``fields`` of every row; floats as repr, None empty) and NAME.json (``info`` and
    the rows under ``key``) in ``out_dir``: a sweep's or a capacity search's files."""
    import csv
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(fields)
        for r in rows:
            w.writerow(["" if r.get(k) is None else (repr(r[k]) if isinstance(r[k], float) else r[k]) for k in fields])
    (out / f"{name}.json").write_text(json.dumps({**info, key: list(rows)}, indent=2) + "\n")
    return [out / f"{name}.csv", out / f"{name}.json"]


# ------------------------------------------------------------------------ figure


def plot_sweep(
    rows,
    out_dir,
    *,
    slo: Mapping[str, float] | None = None,
    attainment: float = DEFAULT_ATTAINMENT,
    sustained: Mapping[str, Mapping[str, Any]] | None = None,
    offered_tok_per_req: float | None = None,
    title: str = "",
    formats: Sequence[str] = ("png", "svg"),
) -> dict[str, Any]:
    """Latency against load: p50/p99 TTFT and ITL vs request rate (or, for a sweep of client
    concurrency at one rate, vs the number of clients), one colour per policy (per policy and
    concurrency when both vary)."""
    from .plots import _new_figure, _style, save

    rates_seen = {r.get("rate_rps") for r in rows}
    concs_seen = {r.get("max_concurrency") for r in rows}
    by_clients = len(rates_seen) == 1 and len(concs_seen) > 1
    if by_clients:  # x is the number of clients; "rate_rps" stands for it below
        rows = [{**r, "rate_rps": r.get("max_concurrency")} for r in rows]
        offered_tok_per_req = None
    elif len(concs_seen) > 1:  # a grid: one line per (policy, concurrency)
        rows = [{**r, "policy": f"{r['policy']} C={r.get('max_concurrency')}"} for r in rows]
    fig = _new_figure(12.5, 8.6)
    axes = fig.subplots(2, 2)
    panels = _SweepPanels(rows)
    for ax, metric, name in ((axes[0, 0], "ttft", "Time to first token"), (axes[0, 1], "itl", "Inter-token latency")):
        panels.latency(ax, metric, name, (slo or {}).get("ttft_ms" if metric == "ttft" else "tpot_ms"))
    panels.output_throughput(axes[1, 0], offered_tok_per_req)
    if slo:
        panels.attainment(axes[1, 1], slo, attainment, sustained)
    else:
        panels.request_throughput(axes[1, 1], by_clients)
    xlabel = "clients (max concurrency)" if by_clients else "offered request rate (req/s)"
    for ax in axes.flat:
        ax.set_xlabel(xlabel)
        _style(ax)
    panels.legend(fig)
    if title:
        fig.suptitle(title, fontsize=12)
    files = save(fig, out_dir, "latency_vs_load", formats)
    return {"files": files, "figure": fig, "series": panels.data}


class _SweepPanels:
    """The panels of the sweep figure: one line per policy (x: ``rate_rps``), each series drawn
    kept in ``data`` under ``POLICY/COLUMN``."""

    def __init__(self, rows: Sequence[Mapping[str, Any]]):
        self.rows = rows
        self.policies = list(dict.fromkeys(r["policy"] for r in rows))
        self.color = {p: f"C{i % 10}" for i, p in enumerate(self.policies)}
        self.data: dict[str, Any] = {}

    def series(self, pol: str, key: str):
        import numpy as np

        mine = sorted((r for r in self.rows if r["policy"] == pol and not r.get("error")), key=lambda r: r["rate_rps"])
        x = np.array([r["rate_rps"] for r in mine], dtype=float)
        y = np.array([np.nan if r.get(key) is None else r[key] for r in mine], dtype=float)
        return x, y

    def _line(self, ax, pol: str, key: str, scale: float = 1) -> None:
        """Column ``key`` of one policy's rows (drawn times ``scale``)."""
        x, y = self.series(pol, key)
        ax.plot(x, y * scale if scale != 1 else y, marker="o", markersize=4.5, color=self.color[pol], linewidth=1.6)
        self.data[f"{pol}/{key}"] = (x, y)

    def _lines(self, ax, key: str) -> None:
        for pol in self.policies:
            self._line(ax, pol, key)

    def _offered(self, ax, per_request: float, label: str) -> None:
        """The offered load: each rate swept times ``per_request``, dotted grey."""
        import numpy as np

        rates = np.array(sorted({r["rate_rps"] for r in self.rows}), dtype=float)
        ax.plot(
            rates,
            rates * per_request,
            color="#888888",
            linestyle=":",
            linewidth=1.2,
            label=label,
        )
        ax.legend(loc="upper left", fontsize=8, frameon=False)

    def latency(self, ax, metric: str, name: str, limit: float | None) -> None:
        """p50 (solid) and p99 (dashed) of ``metric``, with the SLO's ``limit`` as a line."""
        import numpy as np

        from .plots import _plain_log_axis, _wide

        ys = []
        for pol in self.policies:
            for p, ls, mk in (("p50", "-", "o"), ("p99", "--", "s")):
                x, y = self.series(pol, f"{metric}_{p}_ms")
                ax.plot(x, y, linestyle=ls, marker=mk, markersize=4.5, color=self.color[pol], linewidth=1.6)
                self.data[f"{pol}/{metric}_{p}_ms"] = (x, y)
                ys.append(y[np.isfinite(y)])
        if limit is not None:
            ax.axhline(limit, color="#444444", linestyle=":", linewidth=1.2)
            _line_label(ax, limit, f"SLO: {'TTFT' if metric == 'ttft' else 'TPOT'} ≤ {limit:g} ms")
        allv = np.concatenate(ys) if ys else np.array([])
        if _wide(allv, 20):
            _plain_log_axis(ax.yaxis)
        ax.set_title(f"{name} (ms) vs load: p50 solid, p99 dashed", fontsize=10.5)
        ax.set_ylabel(f"{metric.upper()} (ms)" + (", log scale" if ax.get_yscale() == "log" else ""))

    def output_throughput(self, ax, offered_tok_per_req: float | None) -> None:
        self._lines(ax, "output_throughput_tok_s")
        if offered_tok_per_req:
            self._offered(ax, offered_tok_per_req, "offered: rate × mean output tokens")
        ax.set_title("Output token throughput vs load", fontsize=10.5)
        ax.set_ylabel("output throughput (tok/s)")
        ax.set_ylim(bottom=0)

    def attainment(
        self,
        ax,
        slo: Mapping[str, float],
        attainment: float,
        sustained: Mapping[str, Mapping[str, Any]] | None,
    ) -> None:
        """The share of requests meeting every SLO, the threshold, each policy's highest
        sustained rate (a dotted line, and listed in a box)."""
        for pol in self.policies:
            self._line(ax, pol, "slo_attainment", scale=100)
            best = (sustained or {}).get(pol, {}).get("rate_rps")
            if best is not None:
                ax.axvline(best, color=self.color[pol], linestyle=":", linewidth=1.2)
        ax.axhline(attainment * 100, color="#444444", linestyle="--", linewidth=1)
        _line_label(ax, attainment * 100, f"threshold {attainment:.0%}")
        ax.set_ylim(-3, 103)
        slo_text = ", ".join(f"{k} ≤ {v:g}" for k, v in slo.items())
        ax.set_title(f"SLO attainment ({slo_text})", fontsize=10.5)
        if sustained:
            lines = ["highest sustained rate (dotted):"]
            for pol in self.policies:
                s_ = sustained.get(pol, {})
                r_ = s_.get("rate_rps")
                sweep_max = " (sweep max)" if s_.get("limited_by_sweep") else ""
                lines.append(f"{pol}: " + ("none" if r_ is None else f"{r_:g} req/s{sweep_max}"))
            ax.text(
                0.02,
                0.03,
                "\n".join(lines),
                transform=ax.transAxes,
                ha="left",
                va="bottom",
                fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "#bbbbbb", "boxstyle": "round,pad=0.3"},
                zorder=6,
            )
        ax.set_ylabel("requests meeting every SLO (%)")

    def request_throughput(self, ax, by_clients: bool) -> None:
        self._lines(ax, "request_throughput_rps")
        if not by_clients:
            self._offered(ax, 1, "offered rate (y = x)")
        ax.set_title(
            "Completed requests/s vs " + ("clients" if by_clients else "offered rate") + " (give --slo for attainment)",
            fontsize=10.5,
        )
        ax.set_ylabel("request throughput (req/s)")
        ax.set_ylim(bottom=0)

    def legend(self, fig) -> None:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=self.color[p], linewidth=2, label=p) for p in self.policies]
        handles += [
            Line2D([], [], color="black", linestyle="-", marker="o", markersize=4, label="p50"),
            Line2D([], [], color="black", linestyle="--", marker="s", markersize=4, label="p99"),
        ]
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6), fontsize=9, frameon=False)


def _line_label(ax, y: float, text: str) -> None:
    """A boxed label at the right end of a horizontal line at ``y``."""
    ax.text(
        0.99,
        y,
        text,
        transform=ax.get_yaxis_transform(),
        va="center",
        ha="right",
        fontsize=8,
        color="#444444",
        zorder=6,
        bbox={"facecolor": "white", "edgecolor": "#bbbbbb", "boxstyle": "round,pad=0.2"},
    )
