"""Per-step residuals of the cost model on real runs: measured / predicted against the step's features.

Input: a real run's features table (``sim.features.step_table(result)`` or
``features.parquet``; several runs concatenated with ``concat``). Each step's prediction is
the run's own ``predicted_s`` (what the profile the run used predicted), or, with ``coef``,
what those coefficients predict for it (``analysis.runfit.predict``).

``residual_table`` bins the steps by one feature at a time (decode rows, prefill tokens,
longest context, joins/leaves, the idle gap before the step, the first step after a batch
change, passes per step) and gives, per bin, the median of measured / predicted with its
10th-90th percentiles, the bin's share of the measured time and its total error. A bin far
from 1 where the others are near it is an effect the cost model misses.

``step_split`` splits each step into its passes' own time (``execute``) and the rest (the loop's
work: planning, state updates, logs, SimPy's hops), each against its own prediction (the pass and
after-idle terms; the per-step terms), per step kind: where a step's excess lives.

``bias`` is the one-line version ``run-real`` prints: the median of measured / predicted over
the run's steps (back to back and right after idle), and the total predicted vs measured
step time: a profile that no longer fits the machine shows at once.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from schedlab.analysis.runfit import predict, step_predictions
from schedlab.sim.cost import IDLE_STEP_FEATURES, PASS_FEATURES, STEP_FEATURES

# (name, column, bins as (label, lo, hi) with lo <= x < hi); None column: computed below
BINS: tuple[tuple[str, str, tuple[tuple[str, float, float], ...]], ...] = (
    ("decode rows", "decode_rows", (("0", 0, 1), ("1", 1, 2), ("2-4", 2, 5), ("5-16", 5, 17), ("17+", 17, np.inf))),
    (
        "prefill tokens",
        "prefill_tokens",
        (("0", 0, 1), ("1-64", 1, 65), ("65-256", 65, 257), ("257-1024", 257, 1025), ("1025+", 1025, np.inf)),
    ),
    (
        "longest decode context",
        "decode_ctx",
        (("none", 0, 1), ("1-255", 1, 256), ("256-1023", 256, 1024), ("1024+", 1024, np.inf)),
    ),
    ("batch joins/leaves", "_change", (("none", 0, 1), ("joins", 1, 2), ("leaves", 2, 3), ("both", 3, 4))),
    (
        "idle before (s)",
        "_idle",
        (
            ("back to back", -1, 0),
            ("0-0.05", 0, 0.05),
            ("0.05-0.25", 0.05, 0.25),
            ("0.25-1", 0.25, 1.0),
            ("1+", 1.0, np.inf),
        ),
    ),
    ("after a batch change", "after_change", (("no", 0, 1), ("yes", 1, 2))),
    ("passes in the step", "passes", (("1", 1, 2), ("2+", 2, np.inf))),
)


def concat(tables: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    tables = [t for t in tables if t is not None]
    if not tables:
        return {}
    keys = set(tables[0])
    for t in tables[1:]:
        keys &= set(t)
    return {k: np.concatenate([np.asarray(t[k], dtype=float) for t in tables]) for k in keys}


def residual_table(cols: Mapping[str, np.ndarray], coef: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """One row per (feature, bin) with steps in it: n, median/p10/p90 of measured/predicted,
    share of measured time (%), total predicted vs measured (%)."""
    if not cols or not len(cols.get("measured_s", ())):
        return []
    meas = np.asarray(cols["measured_s"], dtype=float)
    pred = step_predictions(cols, coef)
    ok = (meas > 0) & (pred > 0)
    ratio = np.where(ok, meas / np.where(pred > 0, pred, 1.0), np.nan)
    derived = {
        "_change": (np.asarray(cols["joins"]) > 0) * 1.0 + (np.asarray(cols["leaves"]) > 0) * 2.0,
        "_idle": np.where(np.asarray(cols["after_idle"]) > 0, np.asarray(cols["idle_before_s"]), -0.5),
    }
    total = meas[ok].sum()
    rows = []
    for name, col, bins in BINS:
        x = derived[col] if col in derived else np.asarray(cols[col], dtype=float)
        for label, lo, hi in bins:
            m = ok & (x >= lo) & (x < hi)
            if not m.any():
                continue
            r = ratio[m]
            rows.append(
                {
                    "feature": name,
                    "bin": label,
                    "n": int(m.sum()),
                    "median": float(np.median(r)),
                    "p10": float(np.percentile(r, 10)),
                    "p90": float(np.percentile(r, 90)),
                    "time_share_pct": float(100.0 * meas[m].sum() / total) if total else 0.0,
                    "total_pct": float(100.0 * (pred[m].sum() - meas[m].sum()) / meas[m].sum()),
                }
            )
    return rows


STEP_KINDS = ("decode 1", "decode n", "prefill", "mixed")


def step_kinds(cols: Mapping[str, np.ndarray]) -> np.ndarray:
    """Each step's kind: ``decode 1`` (one row), ``decode n``, ``prefill``, ``mixed`` (decode rows
    and prefill chunks), prefixed ``after idle, `` (the replica waited for an arrival just before)
    or else ``batch change, `` (rows join or leave)."""
    rows = np.asarray(cols["decode_rows"], dtype=float)
    chunks = np.asarray(cols["prefill_chunks"], dtype=float)
    kind = np.where(chunks > 0, np.where(rows > 0, "mixed", "prefill"), np.where(rows == 1, "decode 1", "decode n"))
    idle = np.asarray(cols["after_idle"], dtype=float) > 0
    changed = np.asarray(cols["batch_changed"], dtype=float) > 0
    return np.where(
        idle, np.char.add("after idle, ", kind), np.where(changed, np.char.add("batch change, ", kind), kind)
    )


def step_split(cols: Mapping[str, np.ndarray], coef: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """Per step kind (``step_kinds``): steps, the median measured step (ms), and its two parts,
    each the median over the kind's steps of measured and of predicted (ms) and of their ratio:
    ``passes`` (the passes' own time against the pass terms and the after-idle ones: a machine
    that sat idle runs its passes slower) and ``loop`` (the rest against the per-step terms). ``coef``: the linear cost model's coefficients the run planned
    with; without them (an analytic model) the predicted parts are None (only the whole step's
    prediction is known)."""
    if not cols or not len(cols.get("measured_s", ())):
        return []
    meas = np.asarray(cols["measured_s"], dtype=float)
    passes = np.asarray(cols["passes_s"], dtype=float)
    loop = np.asarray(cols["overhead_s"], dtype=float)
    pred = step_predictions(cols, None)
    p_pass = p_loop = None
    if coef is not None:  # (the loop's own prediction, term group by term group)
        p_pass = predict({k: coef[k] for k in PASS_FEATURES + IDLE_STEP_FEATURES + ("i_after",) if k in coef}, cols)
        p_loop = predict({k: coef[k] for k in STEP_FEATURES if k in coef}, cols)
    kinds = step_kinds(cols)
    order = [k for base in STEP_KINDS for k in (base, f"batch change, {base}", f"after idle, {base}")]
    rows = []

    def part(m, x, px):
        out = {"measured_ms": float(np.median(x[m])) * 1e3, "predicted_ms": None, "ratio": None}
        if px is not None:
            ok = m & (px > 0)
            out["predicted_ms"] = float(np.median(px[m])) * 1e3
            out["ratio"] = float(np.median(x[ok] / px[ok])) if ok.any() else None
        return out

    for kind in order:
        m = kinds == kind
        if not m.any():
            continue
        ok = m & (pred > 0)
        rows.append(
            {
                "kind": kind,
                "n": int(m.sum()),
                "measured_ms": float(np.median(meas[m])) * 1e3,
                "predicted_ms": float(np.median(pred[m])) * 1e3,
                "ratio": float(np.median(meas[ok] / pred[ok])) if ok.any() else None,
                "passes": part(m, passes, p_pass),
                "loop": part(m, loop, p_loop),
            }
        )
    return rows


def format_step_split(rows: Sequence[Mapping[str, Any]], title: str | None = None) -> str:
    def f(v, spec):
        return format(v, spec) if v is not None else "-".rjust(len(format(0.0, spec)))

    lines = [title] if title else []
    lines.append(
        f"{'step kind':<24}{'steps':>7}{'ms':>9}{'meas/pred':>10}   "
        f"{'passes ms':>9}{'pred':>9}{'m/p':>7}   {'loop ms':>8}{'pred':>8}{'m/p':>7}"
    )
    for r in rows:
        p, q = r["passes"], r["loop"]
        lines.append(
            f"{r['kind']:<24}{r['n']:>7}{r['measured_ms']:>9.3f}{f(r['ratio'], '10.3f')}   "
            f"{p['measured_ms']:>9.3f}{f(p['predicted_ms'], '9.3f')}{f(p['ratio'], '7.3f')}   "
            f"{q['measured_ms']:>8.3f}{f(q['predicted_ms'], '8.3f')}{f(q['ratio'], '7.3f')}"
        )
    return "\n".join(lines)


def format_residuals(rows: Sequence[Mapping[str, Any]], title: str | None = None) -> str:
    lines = [title] if title else []
    lines.append(f"{'feature':<24}{'bin':<14}{'steps':>7}{'meas/pred':>10}{'p10-p90':>13}{'time %':>8}{'total %':>9}")
    last = None
    for r in rows:
        name = r["feature"] if r["feature"] != last else ""
        last = r["feature"]
        lines.append(
            f"{name:<24}{r['bin']:<14}{r['n']:>7}{r['median']:>10.3f}"
            f"{r['p10']:>6.2f}-{r['p90']:<6.2f}{r['time_share_pct']:>8.1f}{r['total_pct']:>+9.1f}"
        )
    return "\n".join(lines)


def bias(cols: Mapping[str, np.ndarray], coef: Mapping[str, float] | None = None) -> dict[str, Any] | None:
    """Median measured/predicted over the steps (all, back to back, after idle), its mean (a fit
    aims at each shape's mean step time: on a machine whose slow spells skew step times to the
    slow side the median step then runs below its prediction while the mean meets it), how much
    one step's ratio says of the next (``lag1_corr``) and the total predicted vs measured step
    time. None without measured steps."""
    if not cols or not len(cols.get("measured_s", ())):
        return None
    meas = np.asarray(cols["measured_s"], dtype=float)
    pred = step_predictions(cols, coef)
    ok = (meas > 0) & (pred > 0)
    if not ok.any():
        return None
    ratio = meas[ok] / pred[ok]
    idle = np.asarray(cols["after_idle"], dtype=float)[ok] > 0

    def med(m):
        return float(np.median(ratio[m])) if m.any() else None

    return {
        "steps": int(ok.sum()),
        "median": float(np.median(ratio)),
        "mean": float(np.mean(ratio)),
        # consecutive steps' measured/predicted alike (near 1: slow and fast spells of many steps;
        # near 0: each step's own noise)
        "lag1_corr": float(np.corrcoef(ratio[:-1], ratio[1:])[0, 1]) if len(ratio) > 2 and np.std(ratio) > 0 else None,
        "back_to_back": med(~idle),
        "after_idle": med(idle),
        "after_idle_steps": int(idle.sum()),
        "predicted_s": float(pred[ok].sum()),
        "measured_s": float(meas[ok].sum()),
        "total_pct": float(100.0 * (pred[ok].sum() - meas[ok].sum()) / meas[ok].sum()),
    }


def run_speed(cols: Mapping[str, np.ndarray], coef: Mapping[str, float] | None = None) -> float | None:
    """A run's own speed against its cost model: its steps' total measured seconds over their
    total predicted seconds (``bias``'s totals); ``coef``: predicted by these coefficients
    instead of the steps' own predictions. None without measured steps."""
    b = bias(cols, coef)
    return b["measured_s"] / b["predicted_s"] if b else None


def bias_line(b: Mapping[str, Any] | None) -> str | None:
    """'cost model on this run: measured/predicted median 1.12 over 245 steps (back to back
    1.10, after idle 1.35 over 7); total predicted 2.31 s vs measured 2.71 s (-14.8 %)'."""
    if not b:
        return None
    parts = [
        f"back to back {b['back_to_back']:.2f}" if b.get("back_to_back") is not None else None,
        f"after idle {b['after_idle']:.2f} over {b['after_idle_steps']}" if b.get("after_idle") is not None else None,
    ]
    parts = [p for p in parts if p]
    line = (
        f"cost model on this run: measured/predicted median {b['median']:.2f} over {b['steps']} steps"
        + (f" ({', '.join(parts)})" if parts else "")
        + f"; total predicted {b['predicted_s']:.2f} s vs measured {b['measured_s']:.2f} s ({b['total_pct']:+.1f} %)"
    )
    if abs(b["total_pct"]) > 10 or abs(b["median"] - 1) > 0.1:
        line += ": the profile no longer fits this machine's speed (recalibrate: calibrate --replay, or calibrate --from-runs)"
    return line
