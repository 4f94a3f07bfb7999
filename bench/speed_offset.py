"""Where the plain fidelity error comes from: each row's error against how far its real runs ran
from the speed the profile was calibrated at.

A row of a ``bench/fidelity.py`` recording is one policy on one held-out trace: one simulation
(made with the default calibration, before the real runs) against the median of its real runs.
Every real run also tells how fast the machine ran while it ran: its steps' total measured over
total predicted seconds (``speed_matched.speeds`` in the row). If the model were the problem, a
row's plain error would not care about that speed; if the machine's drift is, rows whose runs
ran at the calibrated speed meet the goal and rows whose runs did not miss it, while the
speed-matched error (the same simulation made again at the runs' own speed: the model's share)
stays put across the bins.

Reads fresh recordings only (files that re-score runs recorded elsewhere are skipped: their
runs are already counted), runs nothing, and writes per bin of |row speed - 1| the rows, the
share meeting the median (<= 5 %) and worst (<= 15 %) goals plain and speed-matched, and their
median errors; per recording and model the spread of its runs' speeds; and, where a recording
kept them, how far one real run is from the median of its siblings (the machine's repeat error:
``hold_one_out``), which no simulation made before the runs can be expected to beat by much.

    python bench/speed_offset.py [bench/results/fidelity_*.json ...] [--out bench/results/speed_offset.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_MEDIAN, GOAL_WORST = 5.0, 15.0
BINS = ((0.0, 3.0), (3.0, 6.0), (6.0, 10.0), (10.0, float("inf")))  # |row speed - 1|, per cent


def rows_of(path: Path) -> tuple[list[dict], dict]:
    """(the recording's rows with their runs' speed, per model the spread of its runs' speeds);
    ([], {}) for a file that re-scores runs recorded elsewhere."""
    try:
        data = json.loads(path.read_text())
        models = data["models"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a bench/fidelity.py result ({e})")
    if data.get("rescored_from"):
        return [], {}
    rows, spread = [], {}
    for model, res in models.items():
        speeds_all = []
        for trace, by_policy in (res.get("traces") or {}).items():
            for policy, r in by_policy.items():
                sm = r.get("speed_matched") or {}
                speeds = sm.get("speeds") or []
                if not speeds or r.get("median_abs_error_pct") is None or sm.get("median_abs_error_pct") is None:
                    continue
                speeds_all += speeds
                h = r.get("hold_one_out") or {}
                rows.append({"file": path.name, "model": model, "trace": trace, "policy": policy,
                             "speed": statistics.median(speeds),
                             "plain": (r["median_abs_error_pct"], r["max_abs_error_pct"]),
                             "matched": (sm["median_abs_error_pct"], sm["max_abs_error_pct"]),
                             "real": (h.get("real_median_pct"), h.get("real_max_pct"))})
        if speeds_all:
            spread[model] = {"runs": len(speeds_all), "min": min(speeds_all),
                             "median": statistics.median(speeds_all), "max": max(speeds_all)}
    return rows, spread


def within(rows: list[dict], key: str) -> dict:
    """How many of ``rows`` meet the goals by ``key`` ('plain', 'matched' or 'real'), and their
    median errors (rows without that figure left out)."""
    got = [r[key] for r in rows if r[key][0] is not None]
    if not got:
        return {"rows": 0}
    return {"rows": len(got),
            "median_within": sum(m <= GOAL_MEDIAN for m, _ in got),
            "worst_within": sum(w <= GOAL_WORST for _, w in got),
            "both_within": sum(m <= GOAL_MEDIAN and w <= GOAL_WORST for m, w in got),
            "median_of_median_pct": round(statistics.median(m for m, _ in got), 2),
            "median_of_worst_pct": round(statistics.median(w for _, w in got), 2)}


def by_bin(rows: list[dict]) -> list[dict]:
    out = []
    for lo, hi in BINS:
        sel = [r for r in rows if lo <= abs(r["speed"] - 1) * 100 < hi]
        out.append({"offset_pct": [lo, None if hi == float("inf") else hi],
                    "plain": within(sel, "plain"), "speed_matched": within(sel, "matched"),
                    "real_run_vs_siblings": within(sel, "real")})
    return out


def rank_correlation(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rho (average ranks for ties)."""
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return round(cov / var, 3) if var else None


def summarise(rows: list[dict]) -> dict:
    off = [abs(r["speed"] - 1) for r in rows]
    return {"rows": len(rows),
            "median_row_speed": round(statistics.median(r["speed"] for r in rows), 4),  # a lean either way?
            "rows_runs_within_3pct_of_calibrated_speed": sum(o <= 0.03 for o in off),
            "bins": by_bin(rows),
            "all": {"plain": within(rows, "plain"), "speed_matched": within(rows, "matched"),
                    "real_run_vs_siblings": within(rows, "real")},
            "spearman_offset_vs_error": {
                "plain_median": rank_correlation(off, [r["plain"][0] for r in rows]),
                "speed_matched_median": rank_correlation(off, [r["matched"][0] for r in rows])}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="fidelity result files (default: bench/results/fidelity*.json)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "speed_offset.json"))
    args = ap.parse_args(argv)
    files = [Path(f) for f in args.files] or sorted((ROOT / "bench" / "results").glob("fidelity*.json"))
    rows, recordings = [], {}
    for f in files:
        got, spread = rows_of(f)
        rows += got
        if spread:
            recordings[f.name] = spread
    if not rows:
        raise SystemExit("no fresh recording with per-run speeds among the files")
    out = {"benchmark": "speed_offset", "goal": {"median_pct": GOAL_MEDIAN, "worst_pct": GOAL_WORST},
           "recordings": recordings,
           "models": {m: summarise([r for r in rows if r["model"] == m]) for m in sorted({r["model"] for r in rows})},
           "all": summarise(rows)}
    print(f"{'model':13s} {'|speed-1|':>10s} {'rows':>5s}  {'plain: med<=5 / worst<=15':>26s}  "
          f"{'matched: med<=5 / worst<=15':>28s}  {'real run vs siblings':>21s}  plain med / matched med")
    for m, s in list(out["models"].items()) + [("all", out["all"])]:
        for b in s["bins"]:
            lo, hi = b["offset_pct"]
            p, q, r = b["plain"], b["speed_matched"], b["real_run_vs_siblings"]
            if not p["rows"]:
                continue
            rr = f"{r['median_within']}/{r['worst_within']} of {r['rows']}" if r["rows"] else "-"
            print(f"{m:13s} {f'{lo:g}-{hi:g} %' if hi else f'>{lo:g} %':>10s} {p['rows']:5d}  "
                  f"{p['median_within']:>12d} / {p['worst_within']:<11d}  {q['median_within']:>13d} / "
                  f"{q['worst_within']:<12d}  {rr:>21s}  {p['median_of_median_pct']:5.1f} / {q['median_of_median_pct']:4.1f}")
        print(f"{m:13s} rank correlation of |speed-1| with the row's median error: plain "
              f"{s['spearman_offset_vs_error']['plain_median']}, speed-matched "
              f"{s['spearman_offset_vs_error']['speed_matched_median']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
