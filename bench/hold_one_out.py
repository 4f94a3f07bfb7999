"""The simulation against the machine's own repeat error, from recorded fidelity results.

The fidelity goal (median |error| <= 5 %, worst metric <= 15 %) is measured against the median
of a few real runs, and the real runs disagree among themselves: how far off would a simulator
be that is exactly as good as the machine is steady? Hold each real run out in turn and compare
it with the median of the others: that is a real run's own error, the machine's repeat error.
Put the simulation in the same place (against the same medians of the others) and the two sit
side by side, measured the same way on the same runs (``analysis.validation.hold_one_out``).

Reads ``bench/fidelity.py`` result files (every row keeps its metrics' simulated value and
real runs), runs nothing, and writes per file and model the median over the rows of the
simulation's and a real run's median and worst error, and in how many rows the simulation is
no further off than a real run (``bench.fidelity.hold_one_out_overall``); and the pairwise
directions again, with the pairs the simulation calls equal counted apart (``tied``), and over
all recordings (a re-score's real runs are another file's) how many of every pair the
simulation calls equal pass the real-spread test, beside
the share that identically distributed runs pass it (``bench.fidelity.spread_test_null_share``):
if the two match, the pairs it calls equal behave as equal pairs do.

    python bench/hold_one_out.py [bench/results/fidelity_*.json ...] [--out bench/results/hold_one_out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fidelity import hold_one_out_overall, pairwise, spread_test_null_share  # noqa: E402


def from_file(path: Path) -> dict:
    return _read(path)[0]


def _read(path: Path) -> tuple[dict, bool]:
    """(per model: the file's figures, whether it is a re-score of real runs recorded elsewhere)"""
    try:
        data = json.loads(path.read_text())
        models = data["models"]
        if not isinstance(models, dict) or not all(isinstance(r, dict) for r in models.values()):
            raise TypeError("'models' is not an object of models")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a bench/fidelity.py result ({e})")
    out = {}
    for model, res in models.items():
        rows = [r for t in (res.get("traces") or {}).values() for r in t.values() if r.get("metrics")]
        h = hold_one_out_overall(rows)
        if h:
            plain = (res.get("overall") or {}).get("plain") or {}
            out[model] = {**h, "goal_median_pct": plain.get("median_of_median_abs_error_pct"),
                          "goal_worst_pct": plain.get("median_of_max_abs_error_pct"),
                          "pairwise": pairwise(res.get("traces") or {})["all"]}
    return out, bool(data.get("rescored_from"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="fidelity result files (default: bench/results/fidelity*.json)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hold_one_out.json"))
    args = ap.parse_args()
    files = [Path(f) for f in args.files] or sorted((ROOT / "bench" / "results").glob("fidelity*.json"))
    out: dict = {"benchmark": "hold_one_out", "files": {}}
    print(f"{'file':34s} {'model':13s} {'rows':>4s}  {'sim median/worst':>17s}  {'real run median/worst':>22s}  "
          f"{'sim <= real (median, worst)':>27s}  {'plain vs median of all runs':>27s}  pairwise right (tied)")
    rescores = set()
    for f in files:
        got, rescored = _read(f)
        if not got:
            continue
        out["files"][f.name] = got
        if rescored:
            rescores.add(f.name)
        for model, h in got.items():
            print(f"{f.name:34s} {model:13s} {h['rows']:4d}  {h['sim_median_pct']:8.1f} / {h['sim_worst_pct']:5.1f}  "
                  f"{h['real_median_pct']:13.1f} / {h['real_worst_pct']:5.1f}  "
                  f"{h['rows_sim_median_within_real']:18d}, {h['rows_sim_worst_within_real']:2d}      "
                  + (f"{h['goal_median_pct']:12.1f} / {h['goal_worst_pct']:5.1f}" if h["goal_median_pct"] is not None
                     else f"{'-':>12s} / {'-':>5s}")
                  + f"  {h['pairwise']['right']}/{h['pairwise']['considered']} ({h['pairwise']['tied']})")
    # each recording's real runs once: a re-score (--rescore) compares the same runs again
    pw = [h["pairwise"] for name, got in out["files"].items() if name not in rescores for h in got.values()]
    eq = sum(p.get("simulated_equal") or 0 for p in pw)
    if eq:
        tied = sum(p["tied"] for p in pw if p.get("simulated_equal"))
        # what equal pairs would give: each recording's pairs at the pass share of its runs' count
        null = sum(p["simulated_equal"] * spread_test_null_share(p["runs"]) for p in pw
                   if p.get("simulated_equal") and (p.get("runs") or 0) >= 2) / eq
        out["simulated_equal"] = {"recordings": sorted(set(out["files"]) - rescores),
                                  "pairs": eq, "pass_spread_test": tied, "share": tied / eq, "null_pass_share": null}
        print(f"pairs the simulation calls equal (recordings, not re-scores): {eq}, of which {tied} "
              f"({100 * tied / eq:.1f} %) pass the real-spread test; identically distributed runs (as many as each "
              f"recording's) would pass it {100 * null:.1f} % of the time")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
