"""What a cluster writes: its summary as the front measured it (``cluster_summary``),
``cluster.json`` (``cluster_json``) and ``trace.json``, the requests as they arrived at the front
(``write_served_trace``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from .front import Front, Record
from .replicas import Replica


def _served_by(rec: Record, r: Replica) -> bool:
    """Whether replica ``r`` served ``rec`` (the last replica it went to; a prefill replica, the one
    that made its first token)."""
    if r.pool == "prefill":
        return len(rec.replicas) > (rec.kv is not None) and rec.replicas[-2 if rec.kv is not None else -1] == r.index
    return rec.replica == r.index


def _finished(rec: Record) -> bool:
    return rec.finish is not None and rec.failed is None


class _View(NamedTuple):
    """A request as one replica (or the whole cluster) served it, in front time: when it came
    there, the pieces of text made there, when that part ended, its tokens and prompt tokens."""

    arrival: float
    times: list[float]
    finish: float | None
    tokens: int
    prompt_tokens: int
    finished: bool


def _whole(rec: Record) -> _View:
    n = rec.completion_tokens if rec.completion_tokens is not None else len(rec.times)
    return _View(rec.arrival, rec.times, rec.finish, n, rec.prompt_tokens, _finished(rec))


def _share(rec: Record, r: Replica) -> _View:
    """``rec`` as replica ``r`` served it: the whole request, but where prefill and decode ran apart
    (its KV handed on) the prefill replica's part (from its arrival to its first token, one token)
    and the decode replica's (from the front's hand-off of its KV, the second token on), as the
    simulator counts each pool's replicas."""
    whole = _whole(rec)
    if rec.kv is None or r.pool is None:
        return whole
    if r.pool == "prefill":
        first = rec.times[0] if rec.times else None
        return _View(rec.arrival, rec.times[:1], first, 1, rec.prompt_tokens, first is not None and rec.failed is None)
    return _View(
        rec.kv["at_s"], rec.times[1:], rec.finish, max(whole.tokens - 1, 0), rec.prompt_tokens + 1, whole.finished
    )


def cluster_summary(front: Front) -> dict[str, Any]:
    """The summary (``vllm bench serve``'s metrics) as the front measured them: a request's
    arrival at the front, each piece of its text as it came from its replica, its end."""
    import numpy as np

    from schedlab.sim.metrics import dist

    def part(views: list[_View], start: float | None = None) -> dict[str, Any]:
        done = [v for v in views if v.finished]
        ttft, tpot, e2e, itl, rates = [], [], [], [], []
        for v in done:
            n = v.tokens
            first = v.times[0] if v.times else v.finish
            ttft.append((first - v.arrival) * 1e3)
            e2e.append((v.finish - v.arrival) * 1e3)
            if n > 1 and v.finish > first:
                tpot.append((v.finish - first) / (n - 1) * 1e3)
                rates.append((n - 1) / (v.finish - first))
            itl.extend((np.diff(v.times) * 1e3).tolist())
        arrivals = [v.arrival for v in views]
        t0 = start if start is not None else (min(arrivals) if arrivals else 0.0)
        end = max((v.finish for v in done), default=t0)
        makespan = end - t0
        out_tokens = sum(v.tokens for v in done)
        return {
            "requests": len(views),
            "finished": len(done),
            "rejected": 0,
            "makespan_s": makespan,
            "total_input_tokens": sum(v.prompt_tokens for v in done),
            "total_output_tokens": out_tokens,
            "output_throughput_tok_s": out_tokens / makespan if makespan > 0 else None,
            "request_throughput_rps": len(done) / makespan if makespan > 0 else None,
            "ttft_ms": dist(ttft),
            "tpot_ms": dist(tpot),
            "itl_ms": dist(itl),
            "e2e_ms": dist(e2e),
            "decode_rate_tok_s": {
                "min": float(min(rates)) if rates else None,
                "p50": float(np.percentile(rates, 50)) if rates else None,
                "max": float(max(rates)) if rates else None,
            },
        }

    records = [r for r in front.records if r.replica is not None]
    start = min((r.arrival for r in records), default=0.0)
    failures = [  # as the simulator's summary lists a --fail
        {
            "replica": r.index,
            "at_s": r.down_s - start,
            "retried": sum(1 for x in records if r.index in x.replicas[:-1]),
            "refused": sum(1 for x in records if x.failed and x.replica == r.index),
        }
        for r in front.replicas
        if r.failed and r.down_s is not None
    ]
    summary = {
        "policy": front.policy,
        "mode": "real",
        "trace": front.trace_name,
        **part([_whole(x) for x in records]),
        "steps": 0,
        "measured_at": "the front (arrival, each piece of text relayed, end)",
        "cluster": {
            "replicas": len(front.replicas),
            "router": front.router_name,
            "router_options": front.router_options,
            "retries": front.retries,
            "failed_requests": front.failures,
            **({"failures": failures} if failures else {}),
        },
        "replicas": [
            {
                "replica": r.index,
                **({"pool": r.pool} if r.pool else {}),
                **part([_share(x, r) for x in records if _served_by(x, r)], start),
            }
            for r in front.replicas
        ],
    }
    failed = sum(1 for r in records if r.failed)
    if failed:
        summary["failed"] = failed
    return summary


def cluster_json(front: Front, summary: dict[str, Any]) -> dict[str, Any]:
    recs = [r for r in front.records if r.replica is not None]
    return {
        "replicas": len(front.replicas),
        "router": front.router_name,
        "router_options": front.router_options,
        "policy": front.policy,
        "model": front.model_name,
        "requests": len(recs),
        "finished": sum(1 for r in recs if _finished(r)),
        "retries": front.retries,
        "failures": front.failures,
        "router_errors": front.route_errors,
        "per_replica": [
            {
                "index": r.index,
                "pid": r.pid,
                "url": r.url,
                "cpus": r.cpus,
                **({"pool": r.pool} if r.pool else {}),
                "requests": sum(1 for x in recs if _served_by(x, r)),
                "routed": r.routed,
                "failed_requests": sum(1 for x in recs if x.replica == r.index and x.failed),
                "exit_status": r.exit_status,
                "failed": r.failed,
                "down_s": r.down_s,
                "down_reason": r.down_reason,
                "run_dir": f"replica-{r.index}" if r.owned else None,  # (one at a URL writes where it was told)
            }
            for r in front.replicas
        ],
        "summary": summary,
    }


def write_served_trace(path: Path, front: Front) -> None:
    """trace.json: the requests as they arrived at the front (times from the first arrival), as
    single-replica serve writes it, plus each request's ``replica`` (the last it was sent to),
    ``retried`` when it was sent to a second one and ``failed`` (why) when it ended in an error.
    A finished request's output_tokens are the tokens it generated; any other keeps its max_tokens."""
    from schedlab.traces.schema import Trace

    recs = [r for r in front.records if r.replica is not None]
    t0 = min((r.arrival for r in recs), default=0.0)
    reqs = []
    extra: dict[str, dict[str, Any]] = {}
    for r in recs:
        made = r.completion_tokens if _finished(r) and r.completion_tokens else r.max_tokens
        if r.cancelled and r.times:
            made = len(r.times)  # (about: the pieces of text its client had before it went away)
        req = r.request(round(r.arrival - t0, 6))
        from dataclasses import replace

        reqs.append(replace(req, output_tokens=int(made)))
        e: dict[str, Any] = {"replica": r.replica}
        if r.retried:
            e["retried"] = True
            e["replicas"] = list(r.replicas)
        if r.failed:
            e["failed"] = r.failed
        if r.cancelled:
            e["cancelled"] = True
        if r.kv is not None:  # prefill and decode apart: its two replicas, the KV handed between them
            e["replicas"] = list(r.replicas)
            e["kv"] = {
                k: r.kv[k] for k in ("tokens", "bytes", "export_s", "notice_s", "handoff_s", "exposed_s") if k in r.kv
            }
        extra[r.id] = e
    trace = Trace(
        name="served",
        description=f"requests served by schedlab serve --replicas {len(front.replicas)} (router {front.router_name}, "
        f"policy {front.policy}, model {front.model_name}); arrival_s at the front from the first arrival; "
        f"output_tokens: the tokens each generated; replica: the replica that served it",
        requests=reqs,
    )
    data = trace.to_json()
    data["requests"] = [{**row, **extra[row["id"]]} for row in data["requests"]]
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n")
