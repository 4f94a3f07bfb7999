"""Metrics with the definitions of ``vllm bench serve`` (vllm/benchmarks/serve.py).

TTFT = first token - arrival. TPOT = (last - first) / (output - 1), over requests with more
than one output token. ITL = every gap between consecutive tokens of a request, pooled.
E2E = last token - arrival. Decode rate = (output - 1) / (last - first) tok/s per request.
Throughput = output tokens / makespan, makespan = last finish - first arrival.
Percentiles are numpy's linear interpolation, as vLLM computes them.
"""

from __future__ import annotations

from itertools import chain, compress
from operator import attrgetter, itemgetter
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)
_TOKEN_TIMES = attrgetter("token_times")


def dist(
    values: Sequence[float] | np.ndarray, percentiles: Iterable[float] = PERCENTILES, *, overwrite: bool = False
) -> dict[str, float | None]:
    """Mean and percentiles. ``overwrite``: ``values`` is a float array the caller no longer
    needs, partitioned in place (no copy of millions of ITLs)."""
    a = np.asarray(values, dtype=float)
    percentiles = tuple(percentiles)
    out: dict[str, float | None] = {"mean": float(a.mean()) if a.size else None}
    # one partition for all of them (the same values as one call each)
    at = (
        np.percentile(a, percentiles, overwrite_input=overwrite).tolist()
        if a.size and percentiles
        else [None] * len(percentiles)
    )
    for p, v in zip(percentiles, at):
        out[f"p{p:g}"] = v
    return out


REQUEST_COLUMNS = (
    "id",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "first_token_s",
    "finish_s",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "decode_rate_tok_s",
    "status",
    "preemptions",
    "recomputed_tokens",
    "cached_tokens",
    "scheduled_s",
)
_COL = {c: i for i, c in enumerate(REQUEST_COLUMNS)}
_STATUS = _COL["status"]


def several(result) -> bool:
    """A run of more than one replica (a cluster's: its tables say which replica served what)."""
    return bool(getattr(result, "several", False))


def request_columns(result) -> tuple[str, ...]:
    """requests.csv's columns for ``result``: ``REQUEST_COLUMNS``, and ``replica`` (the index of
    the replica that served it) after them for a run of more than one replica."""
    return REQUEST_COLUMNS + ("replica",) if several(result) else REQUEST_COLUMNS


def request_table(result) -> list[tuple]:
    """One row per request (``request_columns``: requests.csv's), in the run's request order:
    times in seconds and milliseconds, None where requests.csv has an empty cell (an unfinished
    or rejected request, a one-token output's TPOT and decode rate). ``scheduled_s``: when its
    client issued it (its arrival unless closed-loop clients held it back); ``replica``, for a
    run of several replicas: the one that served it."""
    out = _request_rows(result)
    if several(result):
        out = [row + (j,) for row, j in zip(out, result.replica)]
    return out


def _request_rows(result) -> list[tuple]:
    scheduled = getattr(result, "scheduled_s", None) or {}
    rejected = {r.id for r, _ in result.rejected}
    out = []
    for r in result.requests:
        a = r.arrival_s
        sched = scheduled.get(r.id, a) if scheduled else a
        if getattr(r, "cancelled_s", None) is not None:  # its client went away: no latency of its own counts
            out.append(
                (r.id, a, r.prompt_tokens, r.output_tokens, r.first_token_s, r.finish_s)
                + (None,) * 4
                + ("cancelled", r.preemptions, r.recomputed_tokens, r.cached_tokens, sched)
            )
        elif r.finish_s is not None:
            o = r.output_tokens
            f, e = r.first_token_s, r.finish_s
            span = e - f
            out.append(
                (
                    r.id,
                    a,
                    r.prompt_tokens,
                    o,
                    f,
                    e,
                    (f - a) * 1e3,
                    span / (o - 1) * 1e3 if o > 1 else None,
                    (e - a) * 1e3,
                    (o - 1) / span if o > 1 and span > 0 else None,
                    "finished",
                    r.preemptions,
                    r.recomputed_tokens,
                    r.cached_tokens,
                    sched,
                )
            )
        else:
            status = "rejected" if r.id in rejected else "unfinished"
            out.append(
                (r.id, a, r.prompt_tokens, r.output_tokens)
                + (None,) * 6
                + (status, r.preemptions, r.recomputed_tokens, r.cached_tokens, sched)
            )
    return out


def peak_concurrency(rows: Sequence[Mapping[str, Any]]) -> int:
    """Most requests in flight at once (sent, not finished), over half-open intervals
    [arrival, finish): ``vllm bench serve``'s "Peak concurrent requests" sweep."""
    events = sorted([(row["arrival_s"], 1) for row in rows] + [(row["finish_s"], -1) for row in rows])
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def token_times_flat(result) -> tuple[np.ndarray, np.ndarray]:
    """Every request's token times as one array in request order, and each request's count
    (``result.requests``); made once per run (the ITLs and tokens.parquet read them)."""
    requests = result.requests
    counts = np.fromiter(map(len, map(_TOKEN_TIMES, requests)), dtype=np.int64, count=len(requests))
    flat = getattr(result, "_token_flat", None)
    # token times are only ever appended: the same counts are the same times
    if flat is None or not np.array_equal(flat[0], counts):
        times = np.fromiter(chain.from_iterable(map(_TOKEN_TIMES, requests)), dtype=np.float64, count=int(counts.sum()))
        flat = (counts, times)
        try:
            result._token_flat = flat
        except AttributeError:  # (an object that takes no new attributes: made each time)
            pass
    return flat


def _gaps(
    counts: np.ndarray, times: np.ndarray, finished: np.ndarray, scale: float = 1.0, chunks: bool = False
) -> np.ndarray:
    """Every gap between consecutive tokens of each finished request, times ``scale``, pooled
    in request order (one diff over all times at once; the gaps across two requests, and an
    unfinished request's, dropped). Scaled in place before they are picked: two arrays of
    millions fewer to make on an hour of traffic, the same values. ``chunks``: the gaps between
    the chunks a client receives, not the tokens (speculative decoding yields several tokens at
    one pass's end: vLLM records one inter-token latency per step's output, so the tokens of one
    chunk add no zero gaps)."""
    if times.size < 2:
        return np.empty(0)
    gaps = np.diff(times)
    if scale != 1.0:
        gaps *= scale
    keep = np.ones(times.size - 1, dtype=bool)
    ends = np.cumsum(counts)
    first = ends[:-1]  # index of each request's first token after the first request
    keep[first[(first > 0) & (first < times.size)] - 1] = False
    for i in np.flatnonzero(~finished).tolist():  # (only a run that stopped early has any)
        keep[max(ends[i] - counts[i] - 1, 0) : max(ends[i] - 1, 0)] = False
    if chunks:
        keep &= gaps != 0
    return gaps[keep]


def summarize(
    result, percentiles: Iterable[float] = PERCENTILES, slo: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """summary.json for a run (see issue: keys as `vllm bench serve --save-result`)."""
    percentiles = tuple(percentiles)
    table = request_table(result)
    done = np.fromiter((row[_STATUS] == "finished" for row in table), dtype=bool, count=len(table))
    finished = list(compress(result.requests, done))
    fin_rows = list(compress(table, done))
    spec = getattr(result, "speculative", None)
    itl_ms = _gaps(*token_times_flat(result), done, 1e3, chunks=bool(spec))
    arrivals = [r.arrival_s for r in result.requests]
    start = min(arrivals) if arrivals else 0.0
    end = max((r.finish_s for r in finished), default=start)
    makespan = end - start
    out_tokens = sum(r.output_tokens for r in finished)
    in_tokens = sum(r.prompt_tokens for r in finished)

    def col(key):
        return [v for v in map(itemgetter(_COL[key]), fin_rows) if v is not None]

    rows = None
    if getattr(result, "source", None) or slo:  # (the finished requests' rows by column name)
        rows = [dict(zip(REQUEST_COLUMNS, row)) for row in fin_rows]

    rates = col("decode_rate_tok_s")
    summary: dict[str, Any] = {
        "policy": result.policy,
        "mode": result.mode,
        "trace": result.trace,
        "requests": len(result.requests),
        "finished": len(finished),
        "rejected": len(result.rejected),
        "makespan_s": makespan,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "output_throughput_tok_s": out_tokens / makespan if makespan > 0 else None,
        "request_throughput_rps": len(finished) / makespan if makespan > 0 else None,
        "ttft_ms": dist(col("ttft_ms"), percentiles),
        "tpot_ms": dist(col("tpot_ms"), percentiles),
        "itl_ms": dist(itl_ms, percentiles, overwrite=True),
        "e2e_ms": dist(col("e2e_ms"), percentiles),
        "decode_rate_tok_s": {
            "min": float(min(rates)) if rates else None,
            "p50": float(np.percentile(rates, 50)) if rates else None,
            "max": float(max(rates)) if rates else None,
        },
        "steps": len(result.steps),
        "wall_s": result.wall_s,
    }
    # what only some runs have: keys appear when there is something to report
    cancelled = sum(1 for row in table if row[_STATUS] == "cancelled")
    if cancelled:
        summary["cancelled"] = cancelled
    preempted = [r for r in result.requests if r.preemptions]
    if preempted:
        summary["preemptions"] = sum(r.preemptions for r in preempted)
        summary["preempted_requests"] = len(preempted)
        summary["recomputed_tokens"] = sum(r.recomputed_tokens for r in preempted)
    if getattr(result, "prefix_cache", None):
        summary["prefix_cache"] = dict(result.prefix_cache)
    if getattr(result, "source", None):
        clients = dict(result.source)
        clients["peak_concurrency"] = peak_concurrency(rows)
        clients["client_queue_ms"] = dist([(row["arrival_s"] - row["scheduled_s"]) * 1e3 for row in rows], percentiles)
        summary["clients"] = clients
    if slo:
        summary["slo"] = dict(slo)
        good = sum(1 for row in rows if meets_slo(row, slo))
        summary["goodput_rps"] = good / makespan if makespan > 0 else None
        summary["slo_attainment"] = good / len(result.requests) if result.requests else None
    if several(result):  # the cluster, and each replica's own summary
        summary["cluster"] = dict(result.cluster or {})
        summary["replicas"] = [
            {"replica": i, **{k: v for k, v in summarize(part, percentiles, slo).items() if k not in _CLUSTER_WIDE}}
            for i, part in enumerate(result.replicas)
        ]
    if spec:
        summary["speculative"] = dict(spec)
    if result.error:
        summary["error"] = result.error
    if result.meta:
        summary["meta"] = result.meta
    return summary


# what a replica's own summary leaves out: the cluster's summary says it once
_CLUSTER_WIDE = ("policy", "mode", "trace", "wall_s", "meta", "error")

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


def meets_slo(row: Mapping[str, Any], slo: Mapping[str, float]) -> bool:
    """vllm bench serve --goodput: a request is good when every given SLO holds."""
    for key, limit in slo.items():
        value = row.get(key)
        if value is None:
            if key == "tpot_ms":  # one-token outputs have no TPOT: nothing to violate
                continue
            return False
        if value > limit:
            return False
    return True


def format_summary(s: Mapping[str, Any]) -> str:
    """The printed summary in the layout of ``vllm bench serve``."""
    w = 50
    lines = [" Serving Benchmark Result ".center(w, "=")]

    def kv(label, value, fmt="{:.2f}"):
        if value is None:
            text = "n/a"
        elif isinstance(value, str):
            text = value
        elif isinstance(value, int):
            text = str(value)
        else:
            text = fmt.format(value)
        lines.append(f"{label:<40} {text:<10}")

    kv("Policy:", s["policy"])
    kv("Mode:", "simulated" if s["mode"] == "sim" else "real (MLX)")
    kv("Trace:", s["trace"])
    cluster = s.get("cluster")
    if cluster:
        if cluster.get("disaggregated"):
            kv("Replicas (prefill + decode):", f"{cluster['prefill']['replicas']} + {cluster['decode']['replicas']}")
        else:
            kv("Replicas:", cluster["replicas"])
        kv("Router:", cluster["router"])
        if cluster.get("transfer"):
            t = cluster["transfer"]
            kv("KV transfer:", f"{t['mode']} over {t['link']} ({t['bandwidth_gbs']:g} GB/s)")
        if cluster.get("router_delay"):
            kv("Router delay (s):", cluster["router_delay"], "{:g}")
    kv("Successful requests:", s["finished"])
    if s.get("rejected"):
        kv("Rejected requests:", s["rejected"])
    if s.get("cancelled"):
        kv("Cancelled requests:", s["cancelled"])
    clients = s.get("clients")
    if clients:
        if clients.get("max_concurrency") is not None:
            kv("Maximum request concurrency:", clients["max_concurrency"])
        if clients.get("request_rate") is not None:
            kv("Request rate configured (RPS):", clients["request_rate"])
        kv("Peak concurrent requests:", clients["peak_concurrency"])
    kv("Benchmark duration (s):", s["makespan_s"])
    kv("Total input tokens:", s["total_input_tokens"])
    kv("Total generated tokens:", s["total_output_tokens"])
    kv("Request throughput (req/s):", s["request_throughput_rps"])
    kv("Output token throughput (tok/s):", s["output_throughput_tok_s"])
    if "goodput_rps" in s:
        kv("Request goodput (req/s):", s["goodput_rps"])
    for key, title, short in (
        ("ttft_ms", "Time to First Token", "TTFT"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl_ms", "Inter-token Latency", "ITL"),
        ("e2e_ms", "End-to-end Latency", "E2EL"),
    ):
        lines.append(f"{title}".center(w, "-"))
        d = s[key]
        kv(f"Mean {short} (ms):", d["mean"])
        kv(f"Median {short} (ms):", d["p50"])
        for p in [k for k in d if k.startswith("p") and k != "p50"]:
            kv(f"{p.upper()} {short} (ms):", d[p])
    lines.append("Per-request decode rate".center(w, "-"))
    rate = s["decode_rate_tok_s"]
    kv("Min decode rate (tok/s):", rate["min"])
    kv("Median decode rate (tok/s):", rate["p50"])
    kv("Max decode rate (tok/s):", rate["max"])
    if "preemptions" in s or "prefix_cache" in s:
        lines.append("KV cache".center(w, "-"))
    if "preemptions" in s:
        kv("Preemptions:", s["preemptions"])
        kv("Preempted requests:", s["preempted_requests"])
        kv("Recomputed tokens:", s["recomputed_tokens"])
    pc = s.get("prefix_cache")
    if pc:
        kv("Prefix cache hit rate (prompt tokens):", pc["hit_rate"], "{:.2%}")
        kv("Prefill tokens saved:", pc["saved_prefill_tokens"])
    spec = s.get("speculative")
    if spec:
        lines.append("Speculative decoding".center(w, "-"))
        kv("Drafts (verify rows):", spec["drafts"])
        kv("Draft tokens:", spec["draft_tokens"])
        kv("Accepted draft tokens:", spec["accepted_tokens"])
        kv("Acceptance rate:", spec["acceptance_rate"], "{:.2%}")
        kv("Mean acceptance length:", spec["mean_acceptance_length"])
    if s.get("replicas"):
        lines.append("Per replica".center(w, "-"))
        groups = len({part.get("group") for part in s["replicas"]}) > 1  # a heterogeneous cluster's
        for part in s["replicas"]:
            i = part["replica"]
            pool = part.get("pool")
            if groups:
                kv(
                    f"Replica {i} group:",
                    f"{part['group']}: {pool + ', ' if pool else ''}{part['policy']}, {part['cost']}",
                )
            kv(f"Replica {i} successful requests:", part["finished"])
            if pool == "decode":  # its requests arrive with their KV: their first token here is the second
                kv(f"Replica {i} median KV to token (ms):", part["ttft_ms"]["p50"])
            else:
                kv(f"Replica {i} median TTFT (ms):", part["ttft_ms"]["p50"])
            kv(f"Replica {i} output throughput (tok/s):", part["output_throughput_tok_s"])
        for f in (s.get("cluster") or {}).get("failures") or ():
            kv(f"Replica {f['replica']} failed at (s):", f["at_s"])
            kv("  its requests sent elsewhere / refused:", f"{f['retried']} / {f['refused']}")
    lines.append("=" * w)
    return "\n".join(lines)
