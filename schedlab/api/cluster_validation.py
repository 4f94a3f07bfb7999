"""``validate --served DIR``: a real cluster's runs (``serve --replicas N --out DIR`` or
``run-real --replicas N --out DIR``) against the simulation of the same traffic, the same number
of replicas, the same router, policy and cost model.

A real cluster's directory holds ``cluster.json`` (replicas, router, its options), ``trace.json``
(the requests as they arrived at the front, each with the replica that served it) and one run
directory per replica (``replica-<i>``: its requests, token times, steps, meta). Each replica kept
its own clock; its times are put on the front's by the median difference between the front's
arrival time of each of its requests and its own (a few milliseconds of HTTP between them), so
the cluster's makespan and throughput are over one clock; latencies need no clock.

Compared: the whole cluster (``analysis.validation.tables_summary`` over every replica's tables,
the metrics ``validate`` compares for one replica), each replica (its own summary.json against the
simulated replica of the same index), and the routing (the share of requests each replica served,
and how many requests the simulated router sent where the real one did). With several
directories (repeats), the measured value is their median with their spread, as ``validate``
reports for one replica.
"""

from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path
from typing import Any, Sequence

from ..errors import SchedlabError
from ._base import out_dir, public

__all__ = ["validate_served"]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SchedlabError(
            f"{path.parent}: no {path.name}: not a real cluster's run directory "
            "(serve --replicas N --out DIR, or run-real --replicas N --out DIR)"
        ) from None
    except (OSError, ValueError) as exc:
        raise SchedlabError(f"cannot read {path}: {exc}") from None


class _Served:
    """One real cluster run directory, read."""

    def __init__(self, path: Path):
        import pandas as pd

        self.path = path
        if path.exists() and not path.is_dir():
            raise SchedlabError(
                f"--served {path} is a file, not a real cluster's run directory "
                "(serve --replicas N --out DIR, or run-real --replicas N --out DIR)"
            )
        if not path.is_dir():
            raise SchedlabError(f"--served {path}: no such directory")
        self.cluster = _read_json(path / "cluster.json")
        self.trace = _read_json(path / "trace.json")
        self.n = int(self.cluster["replicas"])
        reqs, toks, self.summaries, self.metas = [], [], [], []
        self.missing = []  # replicas that wrote no run directory (killed: a process that dies writes nothing)
        for i in range(self.n):
            d = path / f"replica-{i}"
            if not d.is_dir() and i > 0:
                self.missing.append(i)
                self.summaries.append(None)
                self.metas.append(None)
                continue
            self.summaries.append(_read_json(d / "summary.json"))
            self.metas.append(_read_json(d / "meta.json"))
            try:
                r = pd.read_csv(d / "requests.csv", dtype={"id": str})
                t = pd.read_parquet(d / "tokens.parquet")
            except (OSError, ValueError) as exc:
                raise SchedlabError(f"cannot read {d}: {exc}") from None
            r["replica"] = i
            t["replica"] = i
            reqs.append(r)
            toks.append(t)
        self.requests = pd.concat(reqs, ignore_index=True)
        self.tokens = pd.concat(toks, ignore_index=True)
        # prefill and decode apart (serve --prefill P --decode D): each replica's pool
        self.pools = [r.get("pool") for r in self.cluster.get("per_replica", [])] if "link" in self.cluster else []
        front = {row["id"]: float(row["arrival_s"]) for row in self.trace["requests"]}
        self.front_replica = {row["id"]: row.get("replica") for row in self.trace["requests"]}
        self.shifts = {}
        for i in range(self.n):
            mine = self.requests[self.requests["replica"] == i]
            diffs = [front[k] - a for k, a in zip(mine["id"], mine["arrival_s"]) if k in front]
            self.shifts[i] = statistics.median(diffs) if diffs else 0.0

    @functools.cached_property
    def step_ratio(self) -> float | None:
        """The median over every replica's steps of measured / predicted seconds: how fast the
        machine ran against the profile during this run (1: as calibrated)."""
        import pandas as pd

        ratios = []
        for i in range(self.n):
            f = self.path / f"replica-{i}" / "steps.parquet"
            if f.exists():
                s = pd.read_parquet(f, columns=["predicted_s", "measured_s"]).dropna()
                ratios += (s["measured_s"] / s["predicted_s"]).tolist()
        return float(statistics.median(ratios)) if ratios else None

    def total(self) -> dict[str, Any]:
        from schedlab.analysis.validation import tables_summary

        # (a request retried after a failure is in two replicas' tables: it counts where it ended)
        req = self.requests
        keep = [self.front_replica.get(k, i) == i for k, i in zip(req["id"], req["replica"])]
        return tables_summary(req[keep], self.tokens, self.shifts)


@public
def validate_served(
    served: str | Path | Sequence[str | Path],
    *,
    trace: str | Path | None = None,
    profile: str | Path | None = None,
    out: str | Path | None = None,
) -> dict[str, Any]:
    """Compare real cluster runs (directories written by ``serve --replicas N --out DIR`` or
    ``run-real --replicas N --out DIR``) with the simulation of their traffic on as many
    replicas behind the same router, with the policy, options and cost profile the replicas ran
    (``profile``: another one). ``trace``: the trace to simulate (default: the first
    directory's served trace, the requests as they arrived). Returns what validation.json holds
    (``total``, ``replicas``, ``routing``); ``out``: write it there with the simulated run."""
    from schedlab.analysis.validation import compare

    from .simulation import simulate

    out = out_dir(out)
    dirs = [served] if isinstance(served, (str, Path)) else list(served)
    if not dirs:
        raise SchedlabError("give at least one real cluster run directory (--served DIR)")
    runs = [_Served(Path(d)) for d in dirs]
    first = runs[0]
    for r in runs[1:]:
        for key in ("replicas", "router", "router_options", "policy"):
            if r.cluster.get(key) != first.cluster.get(key):
                raise SchedlabError(
                    f"--served {r.path} and {first.path} differ in {key} "
                    f"({r.cluster.get(key)!r} vs {first.cluster.get(key)!r}): compare runs of one setting"
                )
    meta0 = first.metas[0]
    policy = first.summaries[0]["policy"]
    prof = profile if profile is not None else meta0.get("profile")
    tr = trace if trace is not None else str(first.path / "trace.json")
    if first.pools:
        return _validate_pools(runs, tr, prof, out)
    sim = simulate(
        policy,
        tr,
        options=meta0.get("policy_options") or {},
        profile=prof,
        kv_tokens=meta0.get("kv_tokens"),
        block_size=meta0.get("block_size", 16),
        prefix_caching=bool(meta0.get("prefix_caching")),
        replicas=first.n,
        router=first.cluster["router"],
        router_options=first.cluster.get("router_options") or {},
    )
    s = sim.summary
    name = f"{policy} x{first.n} behind {first.cluster['router']}"
    totals = [r.total() for r in runs]
    total = compare(s, totals, policy=name, trace=str(tr))
    # each run alone against the simulation, beside how fast its steps went
    total["per_run"] = [
        {
            "dir": str(r.path),
            "median_abs_error_pct": compare(s, [t], policy=name, trace=str(tr))["median_abs_error_pct"],
            "step_ratio": r.step_ratio,
        }
        for r, t in zip(runs, totals)
    ]
    per = _per_replica(runs, s, [f"{policy} replica {i}" for i in range(first.n)], tr)
    # routing: each replica's share, and agreement request by request (on the first run's trace)
    sim_of = dict(zip(sim.requests["id"].astype(str), sim.requests["replica"]))
    routing = []
    for r in runs:
        both = [(k, j) for k, j in r.front_replica.items() if k in sim_of and j is not None]
        routing.append(
            {
                "dir": str(r.path),
                "real_share": [sum(1 for _, j in both if j == i) / max(len(both), 1) for i in range(first.n)],
                "same_replica": sum(1 for k, j in both if sim_of[k] == j) / max(len(both), 1),
                "step_ratio": r.step_ratio,
            }
        )
    result = {
        "served": [str(r.path) for r in runs],
        "trace": str(tr),
        "replicas": first.n,
        "router": first.cluster["router"],
        "router_options": first.cluster.get("router_options") or {},
        "policy": policy,
        "profile": prof,
        "shifts_s": [r.shifts for r in runs],
        "missing_replicas": {str(r.path): r.missing for r in runs if r.missing},
        "total": total,
        "per_replica": per,
        "routing": {
            "sim_share": [float((sim.requests["replica"] == i).mean()) for i in range(first.n)],
            "runs": routing,
        },
    }
    return _written(result, sim, out)


def _per_replica(runs: list[_Served], sim_summary: dict[str, Any], labels: list[str], tr) -> list:
    """Each replica's summaries in the runs (those that wrote one) against its simulated twin's;
    None for a replica no run has."""
    from schedlab.analysis.validation import compare

    out = []
    for i, label in enumerate(labels):
        mine = [r.summaries[i] for r in runs if r.summaries[i] is not None]
        out.append(compare(sim_summary["replicas"][i], mine, policy=label, trace=str(tr)) if mine else None)
    return out


def _written(result: dict[str, Any], sim, out) -> dict[str, Any]:
    """``result``, written with the simulated run to ``out`` (validation.json, sim/) when given."""
    if out is not None:
        o = Path(out)
        o.mkdir(parents=True, exist_ok=True)
        sim.save(o / "sim")
        (o / "validation.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _validate_pools(runs: list[_Served], tr, prof, out) -> dict[str, Any]:
    """``validate_served`` of prefill and decode apart: the simulation of the same pools
    (``sim.disagg``), the KV moved over the link the front measured before serving (``cluster.json``'s
    ``link``: bandwidth of the shared-memory file, latency of the HTTP hand-off), whole, its bytes
    per token the model's (``meta.json``). Compared: the cluster as its clients saw it (the front's
    summary), each replica (its own summary.json), and each request's exposed transfer."""
    from schedlab.analysis.validation import compare

    from .options import ClusterOptions
    from .simulation import simulate

    first = runs[0]
    meta0 = first.metas[0]
    policy = first.summaries[0]["policy"]
    group = {
        "policy": policy,
        "options": meta0.get("policy_options") or {},
        "profile": str(prof),
        **({"kv_tokens": meta0["kv_tokens"]} if meta0.get("kv_tokens") else {}),
    }
    link = first.cluster["link"]
    cu = ClusterOptions(
        router=first.cluster["router"],
        router_options=first.cluster.get("router_options") or {},
        groups=[
            {**group, "pool": "prefill", "count": first.pools.count("prefill")},
            {**group, "pool": "decode", "count": first.pools.count("decode")},
        ],
        transfer={
            "mode": "whole",  # (the prefill replica writes the file once its request has ended)
            "bandwidth_gbs": link["bandwidth_gbs"],
            "latency_s": link["latency_s"],
            "kv_bytes_per_token": int(meta0["kv_bytes_per_token"]),
        },
    )
    sim = simulate(None, tr, cluster=cu, block_size=meta0.get("block_size", 16))
    s = sim.summary
    name = f"{policy} {first.pools.count('prefill')} prefill + {first.pools.count('decode')} decode"
    total = compare(s, [r.cluster["summary"] for r in runs], policy=name, trace=str(tr))
    per = _per_replica(runs, s, [f"{policy} replica {i} ({pool})" for i, pool in enumerate(first.pools)], tr)
    predicted = sim.meta["cluster"]["transfer_s"]
    pairs = [
        (float(row["kv"]["exposed_s"]), float(predicted[row["id"]]))
        for r in runs
        for row in r.trace["requests"]
        if "exposed_s" in (row.get("kv") or {}) and row["id"] in predicted
    ]
    transfer = {
        "link": link,
        "requests": len(pairs),
        "measured_median_s": statistics.median([m for m, _ in pairs]) if pairs else None,
        "predicted_median_s": statistics.median([p for _, p in pairs]) if pairs else None,
        "ratio_median": statistics.median([m / p for m, p in pairs]) if pairs else None,
    }
    result = {
        "served": [str(r.path) for r in runs],
        "trace": str(tr),
        "replicas": first.n,
        "pools": first.pools,
        "router": first.cluster["router"],
        "policy": policy,
        "profile": str(prof),
        "total": total,
        "per_replica": per,
        "transfer": transfer,
    }
    return _written(result, sim, out)


def format_served(v: dict[str, Any]) -> str:
    """What ``validate --served`` prints: the cluster's table, each replica's, the routing (or,
    for prefill and decode apart, the KV transfer)."""
    from schedlab.analysis.validation import format_table

    parts = [format_table(v["total"])]
    for i, p in enumerate(v["per_replica"]):
        parts.append(format_table(p) if p is not None else f"replica {i}: no run directory in any run (killed?)")
    t = v.get("transfer")
    if t is not None:
        if t["requests"]:
            parts.append(
                f"KV transfer ({t['requests']} requests, link measured at {t['link']['bandwidth_gbs']:.2f} GB/s + "
                f"{1e3 * t['link']['latency_s']:.1f} ms): measured median {1e3 * t['measured_median_s']:.1f} ms, "
                f"predicted {1e3 * t['predicted_median_s']:.1f} ms, measured / predicted x{t['ratio_median']:.2f}"
            )
        return "\n\n".join(parts)
    share = " / ".join(f"{x:.2f}" for x in v["routing"]["sim_share"])
    lines = [f"routing: simulated share per replica {share}"]
    for r in v["routing"]["runs"]:
        speed = f"; its steps took x{r['step_ratio']:.2f} their predicted time" if r.get("step_ratio") else ""
        lines.append(
            f"  {r['dir']}: real share {' / '.join(f'{x:.2f}' for x in r['real_share'])}, "
            f"same replica as simulated for {100 * r['same_replica']:.0f} % of requests{speed}"
        )
    parts.append("\n".join(lines))
    return "\n\n".join(parts)
