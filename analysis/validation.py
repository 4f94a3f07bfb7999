"""How far a simulation is from real runs of the same policy, trace and profile.

Compares summary metrics (simulated vs measured: error % = (sim - real) / real) and the
cost model's per-step error over every real step (predicted vs measured seconds). With
several real runs, the measured value is their median and an error smaller than the
run-to-run spread is labelled as such, and each real run is held out in turn against the
others: the simulation's error there sits beside a real run's own (``hold_one_out``), the
error a simulator as steady as the machine would make. No mlx here: it works on run
directories' data.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

import numpy as np

# (key in validation.json, path into summary.json, label)
METRICS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("ttft_ms.p50", ("ttft_ms", "p50"), "TTFT p50 (ms)"),
    ("ttft_ms.p90", ("ttft_ms", "p90"), "TTFT p90 (ms)"),
    ("ttft_ms.p99", ("ttft_ms", "p99"), "TTFT p99 (ms)"),
    ("itl_ms.p50", ("itl_ms", "p50"), "ITL p50 (ms)"),
    ("itl_ms.p99", ("itl_ms", "p99"), "ITL p99 (ms)"),
    ("tpot_ms.p50", ("tpot_ms", "p50"), "TPOT p50 (ms)"),
    ("e2e_ms.p50", ("e2e_ms", "p50"), "E2E p50 (ms)"),
    ("output_throughput_tok_s", ("output_throughput_tok_s",), "output throughput (tok/s)"),
    ("makespan_s", ("makespan_s",), "makespan (s)"),
)


def _get(summary: Mapping[str, Any], path: Sequence[str]) -> float | None:
    v: Any = summary
    for k in path:
        if not isinstance(v, Mapping) or k not in v:
            return None
        v = v[k]
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def median_summary(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per metric (``METRICS``), the median over ``summaries`` (several simulations, e.g. one
    per real run at that run's own speed, compared as one with the median of the real runs)."""
    out: dict[str, Any] = {}
    for _, path, _ in METRICS:
        vals = [v for v in (_get(s, path) for s in summaries) if v is not None]
        if not vals:
            continue
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = statistics.median(vals)
    return out


def hold_one_out(
    sim: float | None, runs: Sequence[float], sims: Sequence[float] | None = None
) -> tuple[float, float] | None:
    """Each real run held out in turn against the median of the others: (the simulation's mean
    |error| %, the held-out run's own mean |error| %) against those same references. The second
    is the machine's repeat error, what predicting one run from the others costs a perfect
    simulator that is only as steady as the machine; the first, the simulation put in the same
    place. ``sims``: one simulation per real run (each made at the machine's speed probed around
    that run): the others' median is then predicted by the median of the others' simulations.
    None with fewer than two runs or no simulated value."""
    if sims is not None and len(sims) != len(runs):
        raise ValueError(f"hold_one_out: {len(sims)} simulations for {len(runs)} real runs")
    if (sim is None and sims is None) or len(runs) < 2:
        return None
    se, re_ = [], []
    for i, held in enumerate(runs):
        ref = statistics.median(runs[:i] + runs[i + 1 :])
        pred = sim if sims is None else statistics.median(list(sims[:i]) + list(sims[i + 1 :]))
        if ref and pred is not None:
            se.append(100.0 * abs(pred - ref) / abs(ref))
            re_.append(100.0 * abs(held - ref) / abs(ref))
    return (statistics.fmean(se), statistics.fmean(re_)) if se else None


def repeat_summary(metrics: Mapping[str, Mapping[str, Any]]) -> dict[str, float] | None:
    """Over a comparison's metrics: the median and worst of the simulation's and of a real run's
    hold-one-out error (``hold_one_out``; a metric's ``sim_runs``, where given: one simulation
    per real run); None without several real runs."""
    pairs = [hold_one_out(r.get("sim"), list(r.get("real_runs") or []), r.get("sim_runs")) for r in metrics.values()]
    pairs = [p for p in pairs if p is not None]
    if not pairs:
        return None
    sim, real = [p[0] for p in pairs], [p[1] for p in pairs]
    return {
        "sim_median_pct": float(statistics.median(sim)),
        "sim_max_pct": float(max(sim)),
        "real_median_pct": float(statistics.median(real)),
        "real_max_pct": float(max(real)),
        "metrics": len(pairs),
    }


def step_errors(steps: Sequence[Any]) -> dict[str, float | None]:
    """|predicted - measured| / measured over real steps, in %: p50 and p90 (and mean signed)."""
    errs = []
    for s in steps:
        pred, meas = s.predicted_s, s.measured_s
        if pred is None or meas is None or meas <= 0:
            continue
        errs.append(100.0 * (pred - meas) / meas)
    if not errs:
        return {"p50": None, "p90": None, "mean_signed": None, "n": 0}
    a = np.abs(np.asarray(errs))
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "mean_signed": float(np.mean(errs)),
        "n": len(errs),
        "total_pct": 100.0
        * (
            sum(s.predicted_s for s in steps if s.predicted_s is not None and s.measured_s)
            - sum(s.measured_s for s in steps if s.predicted_s is not None and s.measured_s)
        )
        / max(sum(s.measured_s for s in steps if s.predicted_s is not None and s.measured_s), 1e-12),
    }


def compare(
    sim: Mapping[str, Any],
    reals: Sequence[Mapping[str, Any]],
    *,
    policy: str,
    trace: str,
    real_steps: Sequence[Any] = (),
) -> dict[str, Any]:
    """validation.json for one policy: simulated vs measured metrics and the step error."""
    if not reals:
        raise ValueError("compare needs at least one real run")
    metrics: dict[str, dict[str, Any]] = {}
    for key, path, label in METRICS:
        s = _get(sim, path)
        runs = [v for v in (_get(r, path) for r in reals) if v is not None]
        row: dict[str, Any] = {"label": label, "sim": s, "real": statistics.median(runs) if runs else None}
        if s is not None and row["real"]:
            row["error_pct"] = 100.0 * (s - row["real"]) / row["real"]
        else:
            row["error_pct"] = None
        if len(runs) > 1:
            lo, hi = min(runs), max(runs)
            row["real_runs"] = runs
            row["spread_pct"] = 100.0 * (hi - lo) / row["real"] if row["real"] else None
            row["within_spread"] = s is not None and lo <= s <= hi
        metrics[key] = row
    errs = [abs(r["error_pct"]) for r in metrics.values() if r["error_pct"] is not None]
    out = {
        "policy": policy,
        "trace": trace,
        "repeats": len(reals),
        "metrics": metrics,
        "median_abs_error_pct": float(statistics.median(errs)) if errs else None,
        "max_abs_error_pct": float(max(errs)) if errs else None,
        "step_error_pct": step_errors(real_steps),
    }
    rep = repeat_summary(metrics)
    if rep is not None:
        out["hold_one_out"] = rep
    return out


def format_table(v: Mapping[str, Any]) -> str:
    """The printed table: metric, simulated, measured, error %."""
    rep = v.get("repeats", 1)
    head = f"{v['policy']} on {v['trace']}" + (f" ({rep} real runs: measured = median)" if rep > 1 else "")
    lines = [head]
    hoo = v.get("hold_one_out")
    if hoo:  # the headline: the plain simulation as a prediction of a real run it never saw
        verdict = (
            "within the machine's own repeat error"
            if hoo["sim_median_pct"] <= hoo["real_median_pct"]
            else f"{hoo['sim_median_pct'] / max(hoo['real_median_pct'], 1e-9):.1f}x the machine's own repeat error"
        )
        lines.append(
            f"prediction, each real run held out against the others' median: the simulation is off by "
            f"{hoo['sim_median_pct']:.1f} % (median over metrics; worst {hoo['sim_max_pct']:.1f} %), "
            f"a real run by {hoo['real_median_pct']:.1f} % (worst {hoo['real_max_pct']:.1f} %): {verdict}"
        )
    lines += [
        f"{'metric':<28}{'simulated':>12}{'measured':>12}{'error %':>10}" + ("  spread %" if rep > 1 else ""),
    ]
    for key, row in v["metrics"].items():

        def num(x):
            return "-" if x is None else (f"{x:.1f}" if abs(x) >= 100 else f"{x:.2f}")

        err = "-" if row["error_pct"] is None else f"{row['error_pct']:+.1f}"
        line = f"{row['label']:<28}{num(row['sim']):>12}{num(row['real']):>12}{err:>10}"
        if rep > 1:
            sp = row.get("spread_pct")
            sp_s = "-" if sp is None else f"{sp:.1f}"
            line += f"{sp_s:>10}" + ("  (within run-to-run spread)" if row.get("within_spread") else "")
        lines.append(line)
    se = v["step_error_pct"]
    med, worst = v["median_abs_error_pct"], v["max_abs_error_pct"]
    med_s = "-" if med is None else f"{med:.1f}"
    worst_s = "-" if worst is None else f"{worst:.1f}"
    lines.append(f"median |error| {med_s} %, max {worst_s} %")
    if rep > 1:
        rows = [r for r in v["metrics"].values() if r.get("error_pct") is not None and r.get("spread_pct") is not None]
        beyond = [r for r in rows if abs(r["error_pct"]) > r["spread_pct"]]
        spreads = sorted(r["spread_pct"] for r in rows)
        if rows:
            lines.append(
                f"{len(beyond)} of {len(rows)} metrics' |error| exceed the real runs' spread "
                f"(spread median {spreads[len(spreads) // 2]:.1f} %, max {spreads[-1]:.1f} %)"
            )
    if se.get("n"):
        lines.append(
            f"per-step cost-model error over {se['n']} real steps: median |{se['p50']:.1f}| %, "
            f"p90 |{se['p90']:.1f}| %, total predicted vs measured {se['total_pct']:+.1f} %"
        )
    sb = v.get("step_bias")
    if sb:
        from schedlab.analysis.residuals import bias_line

        lines.append(bias_line(sb).replace("cost model on this run", "cost model on the real runs"))
    speed = speed_line(v.get("machine_speed"))
    if speed:
        lines.append(speed)
    adj = v.get("drift_adjusted")
    if adj and adj.get("applied") is False:
        sr = adj.get("step_ratio")
        lines.append(
            f"drift adjustment not applied: the machine ran at x{adj['speed_factor']:.2f} its calibrated time "
            + (f"while the steps took x{sr:.2f} their predicted time" if sr is not None else "with no timed steps")
            + ": its speed does not explain the steps' bias (a cost the model does not see, not drift)"
        )
    elif adj and adj.get("median_abs_error_pct") is not None:
        how = (
            f"one simulation per real run at its speed probed just before and after it, x{min(adj['speeds']):.2f}-"
            f"{max(adj['speeds']):.2f}"
            if adj.get("speeds")
            else f"the simulation with every pass x{adj['speed_factor']:.2f}, the machine's measured speed"
        )
        lines.append(
            f"drift-adjusted ({how}): median |error| {adj['median_abs_error_pct']:.1f} %, max "
            f"{adj['max_abs_error_pct']:.1f} %, step median |{adj['step_error_pct']['p50']:.1f}| %"
            + (
                f", measured/predicted {adj['step_ratio_median']:.3f}"
                if adj.get("step_ratio_median") is not None
                else ""
            )
        )
        h = adj.get("hold_one_out")
        if h:
            lines.append(
                f"drift-adjusted, each real run held out against the others' median: the simulations off by "
                f"{h['sim_median_pct']:.1f} % (median over the metrics), a real run by {h['real_median_pct']:.1f} %"
            )
    sm = v.get("speed_matched")
    if sm and sm.get("median_abs_error_pct") is not None:
        speeds = sm["speeds"]
        at = f"x{speeds[0]:.2f}" if len(speeds) == 1 else f"x{min(speeds):.2f}-{max(speeds):.2f}"
        lines.append(
            f"diagnostic, not a prediction: speed-matched (the simulation made again at each real run's "
            f"own measured speed, {at} the "
            f"cost model's): median |error| {sm['median_abs_error_pct']:.1f} %, max "
            f"{sm['max_abs_error_pct']:.1f} %: the model's share; the rest is the machine's speed"
        )
    if v.get("speculative"):
        from .speculation import format_acceptance

        lines.append(format_acceptance(v["speculative"]))
    return "\n".join(lines)


def speed_line(speed: Mapping[str, Any] | None) -> str | None:
    """One line on the machine's speed around the real runs against its calibration."""
    if not speed:
        return None
    got = {w: r["ratio"] for w in ("before", "after") if isinstance(r := speed.get(w), Mapping) and r.get("ratio")}
    if not got:
        return None
    replay = all(isinstance(r := speed.get(w), Mapping) and r.get("kind") == "replay" for w in got)
    line = (
        (
            "machine speed: the profile's own replay ran at "
            if replay
            else "machine speed: the profile's reference passes ran at "
        )
        + " and ".join(f"{x:.2f}x ({w} the real runs)" for w, x in got.items())
        + (" the time the profile predicts" if replay else " their calibrated time")
    )
    worst = max(got.values(), key=lambda x: abs(x - 1.0))
    if abs(worst - 1.0) >= 0.05:
        line += (
            f": this machine ran up to {100 * abs(worst - 1.0):.0f} % {'slower' if worst > 1 else 'faster'} "
            "than when the profile was measured; errors of that size are the machine, not the cost "
            "model (recalibrate to follow it)"
        )
    mid = [r["ratio"] for r in (speed.get("probes") or [])[1:-1] if isinstance(r, Mapping) and r.get("ratio")]
    if mid:
        line += f"; between the rounds at {', '.join(f'{x:.2f}x' for x in mid)}"
    if len(got) == 2:
        change = got["after"] / got["before"] - 1.0
        if abs(change) >= 0.1:  # one factor cannot stand for the runs: their speed moved under them
            line += (
                f"; it {'slowed' if change > 0 else 'sped up'} by {100 * abs(change):.0f} % during them "
                "(every run met a different machine)"
            )
    return line


def tables_summary(requests: Any, tokens: Any, shifts: Mapping[Any, float] | None = None) -> dict[str, Any]:
    """The metrics ``compare`` reads (``METRICS``), with ``sim.metrics``' definitions, from the
    tables of a run directory rather than a run: ``requests`` (requests.csv as a DataFrame) and
    ``tokens`` (tokens.parquet: request_id, token_index, time_s). For a cluster whose replicas
    kept their own clocks: the tables of all its replicas concatenated, with a ``replica``
    column in both, and ``shifts`` {replica: seconds to add to its times} putting them on one
    clock (latencies do not depend on it; the makespan and throughput do)."""
    from schedlab.sim.metrics import PERCENTILES, dist

    req = requests.copy()
    tok = tokens.copy()
    if shifts:
        req["arrival_s"] = req["arrival_s"] + req["replica"].map(shifts)
        req["finish_s"] = req["finish_s"] + req["replica"].map(shifts)
    done = req[req["status"] == "finished"]
    start = float(req["arrival_s"].min()) if len(req) else 0.0
    end = float(done["finish_s"].max()) if len(done) else start
    makespan = end - start
    out_tokens = int(done["output_tokens"].sum())
    # ITL: every gap between consecutive tokens of each finished request, pooled
    key = ["replica", "request_id"] if "replica" in tok.columns else ["request_id"]
    rkey = ["replica", "id"] if "replica" in tok.columns else ["id"]
    fin = set(map(tuple, done[rkey].to_numpy().tolist()))
    tok = tok[[tuple(k) in fin for k in tok[key].to_numpy().tolist()]].sort_values([*key, "token_index"])
    gaps = np.diff(tok["time_s"].to_numpy(dtype=float))
    same = np.ones(len(gaps), dtype=bool)
    for c in key:
        v = tok[c].to_numpy()
        same &= v[1:] == v[:-1]
    itl = gaps[same] * 1e3

    def col(name: str) -> list[float]:
        return [float(x) for x in done[name].dropna()]

    return {
        "requests": int(len(req)),
        "finished": int(len(done)),
        "makespan_s": makespan,
        "total_output_tokens": out_tokens,
        "output_throughput_tok_s": out_tokens / makespan if makespan > 0 else None,
        "ttft_ms": dist(col("ttft_ms"), PERCENTILES),
        "tpot_ms": dist(col("tpot_ms"), PERCENTILES),
        "itl_ms": dist(itl, PERCENTILES),
        "e2e_ms": dist(col("e2e_ms"), PERCENTILES),
    }
