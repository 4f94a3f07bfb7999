"""SLO capacity: the highest request rate at which a configuration still meets its SLOs.

Definition
----------
A request is *good* when it finished and meets every SLO given (``sim.metrics.meets_slo``,
the rule of ``vllm bench serve --goodput``). A run's *attainment* is good requests / **all**
requests of the trace (rejected, cancelled and unfinished requests are misses), exactly
``summarize``'s ``slo_attainment``. A rate *passes* when the trace, its arrivals time-scaled to
that mean rate (``traces.to_rate``, as ``sweep`` does), reaches at least the target attainment.
A configuration's *capacity* is the highest passing rate the search finds.

Search
------
From a start rate r0 (twice the trace's own mean rate times the number of replicas, unless given):
bracket by doubling (r0 passes) or halving (r0 fails) until one rate passes and one fails (at
most ``MAX_STEPS`` times each way), then bisect the bracket **geometrically** (the midpoint of
lo and hi is sqrt(lo x hi)) until (hi - lo) / lo <= tolerance. Every rate tried is r0 x 2^e for
a dyadic exponent e kept exactly, so two searches from the same r0 try the very same rates as
long as their answers agree, and with a predicate monotone in the rate the result is the largest
passing rate of the grid r0 x 2^(j / 2^m) fixed by the tolerance. The passing bound ``lo`` is
reported; the true capacity lies in [lo, hi) when attainment falls monotonically with load.

Per dollar
----------
A configuration's *price* (``price_usd_per_hour``) is the hourly price of ONE replica: the one
given (``--price-per-hour``), else its ``--hardware`` preset's ``price_usd_per_hour`` (one
provider's on-demand price of one GPU; most presets have none), else none; a cluster file's
configurations have one only when given. Its *requests per dollar* is
``capacity_rps * 3600 / (replicas * price)`` (``requests_per_usd``, :func:`requests_per_usd`):
requests served within the SLOs per dollar of replica time at the capacity; none without a price
or a capacity, and a lower bound where the capacity is one (``limited``).

Early stop
----------
A run that can no longer reach the target stops as soon as that is certain (``SLOWatch``): the
requests *certain* to miss are counted as the run goes, and once (N - misses) / N < target
(the final attainment can only be lower) the run raises a private exception that ends it. A
request is certain to miss when it finished or was refused and misses an SLO (its numbers
computed exactly as the request table computes them); when it has no first token yet more than
the TTFT SLO after its arrival (its first token can only come later); or when it is unfinished
more than the E2E SLO after its arrival. Only certain misses count, so a stop never changes a
pass into a fail or back: the answer of every run is the full run's. Checks happen at each
arrival, at each finish and, after the last arrival, at the moments a request in flight would
cross its TTFT or E2E limit (the source reports them as its next arrivals so that the replica
hands control to SimPy then). Runs that do not use it are untouched: the watch is an arrival
source of its own, given only to the capacity search's runs.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

DEFAULT_ATTAINMENT = 0.99
DEFAULT_TOLERANCE = 0.02
MAX_STEPS = 10  # doublings (or halvings) of the start rate while bracketing

#: the capacity table's columns
TABLE_FIELDS = (
    "configuration",
    "policy",
    "router",
    "replicas",
    "gpus",
    "capacity_rps",
    "capacity_per_replica_rps",
    "capacity_per_gpu_rps",
    "price_usd_per_hour",
    "requests_per_usd",
    "limited",
    "first_failing_rps",
    "binding",
    "attainment_at_capacity",
    "runs",
    "early_stops",
    "simulated_s",
    "saved_s_min",
    "error",
)

# a request's flags in SLOWatch
_KEY_BIT = {"ttft_ms": 1, "tpot_ms": 2, "e2e_ms": 4, "unfinished": 8}
_MISS = 16  # counted among the misses
_DONE = 32  # finished, refused or cancelled: its outcome is counted in full


class _Stop(Exception):
    """Ends a run that can no longer reach the attainment (raised from the watch, caught by
    ``evaluate``; never seen outside this module)."""


def miss_budget(n: int, attainment: float) -> int:
    """The fewest misses m with (n - m) / n < attainment: with that many certain misses a run
    of n requests fails (the same float comparison as the final check)."""
    m = max(0, min(n, math.floor((1 - attainment) * n) - 2))
    while m <= n and (n - m) / n >= attainment:
        m += 1
    return m


class SLOWatch:
    """An arrival source replaying ``requests`` at their arrival times (``sim.sources.TraceSource``)
    that counts the requests certain to miss ``slo`` and ends the run (``_Stop``) once the
    attainment is out of reach (module docstring). ``misses``, ``by_key`` and ``stopped_at_s``
    say what it saw."""

    def __init__(self, requests: Sequence[Any], slo: Mapping[str, float], attainment: float) -> None:
        from schedlab.sim.sources import TraceSource

        self.requests = list(requests)
        self._inner = TraceSource(self.requests)
        n = self.n = len(self.requests)
        self._slo = dict(slo)
        self._index = {id(r): i for i, r in enumerate(self.requests)}
        self._state: list[Any] = [None] * n
        self._flags = bytearray(n)
        self.misses = 0
        self.by_key: dict[str, int] = dict.fromkeys((*self._slo, "unfinished"), 0)
        self.budget = miss_budget(n, attainment)
        self.stopped_at_s: float | None = None
        order = sorted(range(n), key=lambda i: self.requests[i].arrival_s)
        self._order = order
        self._arr = [self.requests[i].arrival_s for i in order]
        self._ttft = self._slo.get("ttft_ms")
        self._e2e = self._slo.get("e2e_ms")
        self._pt = 0 if self._ttft is not None else n  # next request (in arrival order) to pass its TTFT limit
        self._pe = 0 if self._e2e is not None else n  # ... its E2E limit
        self._due: float | None = None  # the watch's next check after the last arrival

    # ------------------------------------------------------------ the source protocol

    def process(self, env, deliver):
        index, state = self._index, self._state

        def watched(req):
            r = deliver(req)
            i = index.get(id(req))
            if i is not None and r is not None:
                state[i] = r
            self._advance(env.now)
            return r

        yield from self._inner.process(env, watched)
        if self._pt < self.n or self._pe < self.n:
            env.process(self._watch(env))

    def next_arrival_s(self) -> float | None:
        t = self._inner.next_arrival_s()
        return t if t is not None else self._due

    def finished(self, r, t: float) -> None:
        i = self._index.get(id(getattr(r, "request", None)))
        if i is None or self._flags[i] & _DONE:
            return
        self._flags[i] |= _DONE
        slo = self._slo
        a = r.arrival_s
        if getattr(r, "cancelled_s", None) is not None or r.finish_s is None:
            self._miss(i, "unfinished", t)
            return
        # the request table's numbers, computed the same way (sim.metrics._request_rows)
        f, e, o = r.first_token_s, r.finish_s, r.output_tokens
        values = {
            "ttft_ms": (f - a) * 1e3,
            "tpot_ms": (e - f) / (o - 1) * 1e3 if o > 1 else None,
            "e2e_ms": (e - a) * 1e3,
        }
        for key, limit in slo.items():
            v = values.get(key)
            if v is None:
                if key != "tpot_ms":
                    self._miss(i, key, t)
            elif v > limit:
                self._miss(i, key, t)

    # ------------------------------------------------------------ counting

    def _miss(self, i: int, key: str, t: float) -> None:
        flags = self._flags
        bit = _KEY_BIT[key]
        if not flags[i] & bit:
            flags[i] |= bit
            self.by_key[key] += 1
        if not flags[i] & _MISS:
            flags[i] |= _MISS
            self.misses += 1
            if self.misses >= self.budget:
                self.stopped_at_s = t
                raise _Stop()

    def _advance(self, t: float) -> None:
        """Count the requests that have crossed their TTFT or E2E limit by ``t`` (SimPy's now:
        every replica's passes still to come end at or after it) unanswered."""
        n, order, arr, flags, state = self.n, self._order, self._arr, self._flags, self._state
        limit = self._ttft
        pt = self._pt
        while pt < n and (t - arr[pt]) * 1e3 > limit:
            i = order[pt]
            pt += 1
            self._pt = pt
            if flags[i] & (_DONE | 1):
                continue
            r = state[i]
            if r is None:  # not known here: nothing certain
                continue
            f = r.first_token_s
            if f is None or (f - r.arrival_s) * 1e3 > limit:
                self._miss(i, "ttft_ms", t)
        limit = self._e2e
        pe = self._pe
        while pe < n and (t - arr[pe]) * 1e3 > limit:
            i = order[pe]
            pe += 1
            self._pe = pe
            if not flags[i] & _DONE:  # (delivered, since it arrived before t, and unfinished)
                self._miss(i, "e2e_ms", t)

    def _next_due(self, now: float) -> float | None:
        """When the next request in flight crosses a limit (None: none left to watch)."""
        n, order, arr, flags = self.n, self._order, self._arr, self._flags
        due = None
        for attr, limit in (("_pt", self._ttft), ("_pe", self._e2e)):
            p = getattr(self, attr)
            while p < n and flags[order[p]] & _DONE:
                p += 1
            setattr(self, attr, p)
            if p >= n:
                continue
            a = arr[p]
            c = a + limit / 1e3
            while (c - a) * 1e3 <= limit:
                c = math.nextafter(c, math.inf)
            due = c if due is None else min(due, c)
        if due is not None and due <= now:
            due = math.nextafter(now, math.inf)
        return due

    def _watch(self, env):
        """After the last arrival: check again whenever a request in flight crosses a limit."""
        while True:
            self._advance(env.now)
            due = self._next_due(env.now)
            self._due = due
            if due is None:
                return
            yield env.timeout(due - env.now)


# ------------------------------------------------------------------------ one rate


def attainment_of(result, slo: Mapping[str, float]) -> tuple[float, dict[str, int]]:
    """A finished run's attainment (``summarize``'s ``slo_attainment``) and how many requests
    missed each SLO (``unfinished``: rejected, cancelled or never finished)."""
    from schedlab.sim.metrics import REQUEST_COLUMNS, meets_slo, request_table

    cols = {c: i for i, c in enumerate(REQUEST_COLUMNS)}
    status = cols["status"]
    by_key = dict.fromkeys((*slo, "unfinished"), 0)
    good = 0
    table = request_table(result)
    for row in table:
        if row[status] != "finished":
            by_key["unfinished"] += 1
            continue
        d = {k: row[cols[k]] for k in slo}
        if meets_slo(d, slo):
            good += 1
            continue
        for k, limit in slo.items():
            v = d[k]
            if (v is None and k != "tpot_ms") or (v is not None and v > limit):
                by_key[k] += 1
    return (good / len(table) if table else 0.0), by_key


def evaluate(
    trace,
    rate: float,
    run_fn: Callable[[Any, str], Any],
    slo: Mapping[str, float],
    attainment: float,
    early_stop: bool = True,
) -> dict[str, Any]:
    """One search point: ``trace`` rescaled to ``rate`` and run by ``run_fn(arrivals, name)``
    (a request list, or an ``SLOWatch`` when ``early_stop``). Returns rate, attainment (None when
    stopped early; ``attainment_max`` bounds it then), passed, stopped_early, misses by SLO,
    simulated seconds, the simulated seconds the stop saved at least (the trace's last arrival
    minus the stop time), and error."""
    from schedlab.traces import to_rate

    tr = to_rate(trace, rate)
    reqs = tr.requests
    n = len(reqs)
    last = max((r.arrival_s for r in reqs), default=0.0)
    first = min((r.arrival_s for r in reqs), default=0.0)
    point: dict[str, Any] = {
        "rate_rps": rate,
        "attainment": None,
        "attainment_max": None,
        "passed": False,
        "stopped_early": False,
        "misses": None,
        "simulated_s": None,
        "saved_s_min": 0.0,
        "error": None,
    }
    if early_stop:
        watch = SLOWatch(reqs, slo, attainment)
        try:
            result = run_fn(watch, tr.name)
        except _Stop:
            at = watch.stopped_at_s if watch.stopped_at_s is not None else last
            point.update(
                attainment_max=(n - watch.misses) / n,
                stopped_early=True,
                misses=dict(watch.by_key),
                simulated_s=at - first,
                saved_s_min=max(0.0, last - at),
            )
            return point
    else:
        result = run_fn(reqs, tr.name)
    if result.error:
        point["error"] = result.error
        return point
    a, by_key = attainment_of(result, slo)
    end = max((r.finish_s for r in result.requests if r.finish_s is not None), default=first)
    point.update(attainment=a, attainment_max=a, passed=a >= attainment, misses=by_key, simulated_s=end - first)
    return point


# ------------------------------------------------------------------------ the search


def search(
    evaluate_at: Callable[[float], dict[str, Any]],
    start: float,
    tolerance: float = DEFAULT_TOLERANCE,
    max_steps: int = MAX_STEPS,
) -> dict[str, Any]:
    """Bracket then bisect (module docstring) with ``evaluate_at(rate) -> point``. Returns
    capacity_rps (the passing bound; None when no rate passed), first_failing_rps (the failing
    bound; None when none failed: ``limited``, the capacity is at least capacity_rps), binding
    (the SLO most requests missed at the failing bound), the points in the order tried, and
    error (a run's error, or why no rate passed)."""
    points: list[dict[str, Any]] = []

    def at(e: Fraction) -> dict[str, Any]:
        p = evaluate_at(start * 2.0 ** float(e))
        p["exponent"] = str(e)
        points.append(p)
        return p

    out: dict[str, Any] = {
        "capacity_rps": None,
        "first_failing_rps": None,
        "limited": False,
        "binding": None,
        "attainment_at_capacity": None,
        "points": points,
        "error": None,
    }
    lo = hi = None
    lo_p = hi_p = None
    p = at(Fraction(0))
    if p["error"]:
        out["error"] = p["error"]
        return out
    if p["passed"]:
        lo, lo_p = Fraction(0), p
        for k in range(1, max_steps + 1):
            p = at(Fraction(k))
            if p["error"]:
                out["error"] = p["error"]
                return out
            if not p["passed"]:
                hi, hi_p = Fraction(k), p
                break
            lo, lo_p = Fraction(k), p
    else:
        hi, hi_p = Fraction(0), p
        for k in range(1, max_steps + 1):
            p = at(Fraction(-k))
            if p["error"]:
                out["error"] = p["error"]
                return out
            if p["passed"]:
                lo, lo_p = Fraction(-k), p
                break
            hi, hi_p = Fraction(-k), p
    if lo is None:
        out["first_failing_rps"] = hi_p["rate_rps"]
        out["binding"] = binding(hi_p)
        out["error"] = no_rate_message(hi_p)
        return out
    if hi is not None:
        while 2.0 ** float(hi - lo) - 1 > tolerance:
            mid = (lo + hi) / 2
            p = at(mid)
            if p["error"]:
                out["error"] = p["error"]
                return out
            if p["passed"]:
                lo, lo_p = mid, p
            else:
                hi, hi_p = mid, p
    out["capacity_rps"] = lo_p["rate_rps"]
    out["attainment_at_capacity"] = lo_p["attainment"]
    if hi_p is None:
        out["limited"] = True
    else:
        out["first_failing_rps"] = hi_p["rate_rps"]
        out["binding"] = binding(hi_p)
    return out


def binding(point: Mapping[str, Any]) -> str | None:
    """The SLO most requests missed at ``point`` (``unfinished``: requests that never finished)."""
    misses = point.get("misses") or {}
    if not misses or not any(misses.values()):
        return None
    return max(misses, key=lambda k: misses[k])


def no_rate_message(point: Mapping[str, Any]) -> str:
    rate = point["rate_rps"]
    misses = point.get("misses") or {}
    detail = ", ".join(f"{v} missed {k}" for k, v in misses.items() if v)
    seen = (
        f"at most {point['attainment_max']:.1%} of the requests meet every SLO there (stopped early)"
        if point.get("stopped_early")
        else f"{point['attainment']:.1%} of the requests meet every SLO there"
    )
    return f"no rate meets the SLOs even at {rate:.4g} req/s (the lowest tried): {seen}" + (
        f"; {detail}" if detail else ""
    )


# ------------------------------------------------------------------------ table, files, figures


def requests_per_usd(capacity_rps: float | None, replicas: int, price_usd_per_hour: float | None) -> float | None:
    """Requests served per dollar at the capacity: capacity_rps x 3600 / (replicas x price of one
    replica per hour); None without a capacity or a price."""
    if capacity_rps is None or price_usd_per_hour is None or not replicas:
        return None
    return capacity_rps * 3600.0 / (replicas * price_usd_per_hour)


def _per_usd(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:,.0f}" if v >= 1000 else f"{v:.4g}"


def _num(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return fmt.format(v)


def table_cells(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The printed table: its header and one line of cells per configuration (a ``req/$`` column,
    requests per dollar, only when some configuration has a price; a ``per GPU`` column only when
    some configuration's replicas span several GPUs, tensor parallelism)."""
    priced = any(r.get("price_usd_per_hour") is not None for r in rows)
    per_gpu = any(r.get("gpus") not in (None, r.get("replicas")) for r in rows)
    head = ["configuration", "capacity req/s", "per replica", *(["per GPU"] if per_gpu else [])]
    head += ["req/$"] if priced else []
    head += ["binds", "runs", "early stops"]
    lines = []
    for r in rows:
        cap = r.get("capacity_rps")
        if r.get("error") and cap is None:
            cap_text = "none"
        else:
            cap_text = (">= " if r.get("limited") else "") + _num(cap, "{:.4g}")
        per_usd = _per_usd(r.get("requests_per_usd"))
        if r.get("limited") and per_usd != "-":
            per_usd = ">= " + per_usd
        lines.append(
            [
                str(r["configuration"]),
                cap_text,
                _num(r.get("capacity_per_replica_rps"), "{:.4g}"),
                *([_num(r.get("capacity_per_gpu_rps"), "{:.4g}")] if per_gpu else []),
                *([per_usd] if priced else []),
                str(r.get("binding") or "-"),
                str(r.get("runs", 0)),
                str(r.get("early_stops", 0)),
            ]
        )
    return head, lines


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head, lines = table_cells(rows)
    cells = [head, *lines]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    out = []
    for j, c in enumerate(cells):
        out.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_results(out_dir, rows: Sequence[Mapping[str, Any]], info: Mapping[str, Any]) -> list:
    """capacity.csv (the table) and capacity.json (``info``, and every configuration with its
    search's points)."""
    from schedlab.analysis.sweep import write_table

    return write_table(out_dir, "capacity", TABLE_FIELDS, rows, info, "configurations")


def plot_capacity(
    rows: Sequence[Mapping[str, Any]],
    out_dir,
    *,
    attainment: float,
    slo: Mapping[str, float],
    title: str = "",
    formats: Sequence[str] = ("png", "svg"),
) -> dict[str, Any]:
    """Two figures: capacity per configuration (bars; a hatched bar is a lower bound, the search
    found no failing rate), and attainment against rate with every point each search tried
    (a hollow marker: stopped early, drawn at the most it could have reached) and the target."""
    import numpy as np

    from .plots import _new_figure, _plain_log_axis, _style, save

    names = [str(r["configuration"]) for r in rows]
    color = {n: f"C{i % 10}" for i, n in enumerate(names)}
    slo_text = ", ".join(f"{k} ≤ {v:g}" for k, v in slo.items())

    fig1 = _new_figure(max(7.5, 1.1 * len(rows) + 3.0), 4.8)
    ax = fig1.subplots()
    caps = [r.get("capacity_rps") or 0.0 for r in rows]
    bars = ax.bar(range(len(rows)), caps, color=[color[n] for n in names])
    for b, r in zip(bars, rows):
        if r.get("limited"):
            b.set_hatch("//")
        cap = r.get("capacity_rps")
        text = "none" if cap is None else ((">= " if r.get("limited") else "") + f"{cap:.4g}")
        if r.get("binding"):
            text += f"\n{r['binding']}"
        ax.annotate(
            text,
            (b.get_x() + b.get_width() / 2, b.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
    ax.set_xticks(
        range(len(rows)), names, rotation=20 if len(rows) > 3 else 0, ha="right" if len(rows) > 3 else "center"
    )
    ax.set_ylabel("capacity (req/s)")
    ax.set_ylim(0, max(caps + [1e-9]) * 1.25)
    ax.set_title(
        f"SLO capacity: the highest rate at which ≥ {attainment:.4g} of all requests meet every SLO\n"
        f"({slo_text}; label: the SLO missed most just above it; hatched: at least this)",
        fontsize=10,
    )
    _style(ax)
    if title:
        fig1.suptitle(title, fontsize=11)

    fig2 = _new_figure(8.5, 5.2)
    ax = fig2.subplots()
    all_rates: list[float] = []
    all_y: list[float] = [attainment * 100]
    for r in rows:
        pts = sorted(r.get("points") or [], key=lambda p: p["rate_rps"])
        full = [p for p in pts if p.get("attainment") is not None]
        early = [p for p in pts if p.get("stopped_early")]
        c = color[str(r["configuration"])]
        if full:
            x = np.array([p["rate_rps"] for p in full])
            y = np.array([p["attainment"] * 100 for p in full])
            ax.plot(x, y, marker="o", markersize=5, color=c, linewidth=1.4, label=str(r["configuration"]))
            all_rates += list(x)
            all_y += list(y)
        if early:
            x = np.array([p["rate_rps"] for p in early])
            y = np.array([p["attainment_max"] * 100 for p in early])
            ax.plot(x, y, linestyle="none", marker="v", markersize=6, markerfacecolor="white", color=c)
            all_rates += list(x)
            all_y += list(y)
        if r.get("capacity_rps") is not None:
            ax.axvline(r["capacity_rps"], color=c, linestyle=":", linewidth=1.1)
    ax.axhline(attainment * 100, color="#444444", linestyle="--", linewidth=1)
    ax.text(
        0.99,
        attainment * 100,
        f"target {attainment:.0%}",
        transform=ax.get_yaxis_transform(),
        va="bottom",
        ha="right",
        fontsize=8,
        color="#444444",
    )
    if all_rates and max(all_rates) / min(all_rates) > 20:
        _plain_log_axis(ax.xaxis)
    ax.set_xlabel("request rate (req/s; the trace time-scaled)")
    ax.set_ylabel("requests meeting every SLO (%)")
    ax.set_ylim(max(-3.0, min(all_y) - 8), 101.5)
    ax.set_title(
        f"Attainment against rate: the search's points (▽: stopped early, at most this); {slo_text}", fontsize=10
    )
    ax.legend(fontsize=8, frameon=False, loc="lower left")
    _style(ax)
    if title:
        fig2.suptitle(title, fontsize=11)
    files = save(fig1, out_dir, "capacity", formats) + save(fig2, out_dir, "attainment_vs_rate", formats)
    return {"figures": [fig1, fig2], "files": files}
