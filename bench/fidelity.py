"""Fidelity: how far `simulate` is from `run-real`, for all six policies x the bundled
real-run traces (real-smoke, real-mixed), with the bundled measured profile.

For each (trace, policy): one simulation and ``--repeat`` real runs (tiny model, MLX on
this CPU), compared as `validate` compares them (measured = median of the real runs).
Writes per-policy median and max |error| over the validated metrics, the per-step
cost-model error, and the real runs' own spread (run-to-run noise), to JSON.

Target (issue 4): median |error| <= 3 % and worst <= 10 % for every policy.

    python bench/fidelity.py [--repeat 3] [--traces real-smoke,real-mixed] [--out bench/results/fidelity.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402,F401  (OpenBLAS before mlx)
import traces  # noqa: E402
from engine import blas  # noqa: E402
from engine.calibrate import find_or_calibrate  # noqa: E402
from engine.models import load_model  # noqa: E402
from policies import POLICIES, make_policy  # noqa: E402
from schedlab.validate import validate_one  # noqa: E402
from sim.cost import LinearCostModel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="real-smoke,real-mixed")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fidelity.json"))
    ap.add_argument("--keep", default=None, help="keep the run directories here")
    ap.add_argument("--calibrate", action="store_true",
                    help="calibrate (default grid) first and validate against that fresh profile: this "
                         "machine's speed drifts by tens of %% over an hour, so a profile measured minutes "
                         "before the runs separates the cost model's error from the machine's drift")
    args = ap.parse_args()

    info = load_model(args.model)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fidelity-"))
    if args.calibrate:
        from engine.calibrate import GRIDS, calibrate, write_profile

        print("calibrating (default grid) ...", flush=True)
        path = write_profile(calibrate(info, GRIDS["default"]), work / "profile.json")
    else:
        path, note = find_or_calibrate(args.profile, info, work, lambda m: print(m, flush=True))
        if note:
            print("note:", note)
    cost = LinearCostModel.from_profile(path)
    capacity = int(cost.meta.get("kv_tokens", 262144))
    results: dict = {}
    t0 = time.perf_counter()
    for tname in args.traces.split(","):
        tr = traces.load(tname)
        results[tname] = {}
        for pname in args.policies.split(","):
            pol = make_policy(pname)
            v = validate_one(pol, tr, info, cost, capacity, work / tname / pname, args.repeat, 0,
                             {"profile": str(path)}, lambda m: print(f"{tname}: {m}", flush=True))
            spreads = [r["spread_pct"] for r in v["metrics"].values() if r.get("spread_pct") is not None]
            results[tname][pname] = {
                "median_abs_error_pct": v["median_abs_error_pct"],
                "max_abs_error_pct": v["max_abs_error_pct"],
                "worst_metric": max(v["metrics"], key=lambda k: abs(v["metrics"][k]["error_pct"] or 0)),
                "step_error_pct": v["step_error_pct"],
                "real_spread_pct_median": statistics.median(spreads) if spreads else None,
                "machine_speed": v.get("machine_speed"),
                "drift_adjusted": v.get("drift_adjusted"),
                "within_spread": sum(1 for r in v["metrics"].values() if r.get("within_spread")),
                "metrics": {k: {"sim": r["sim"], "real": r["real"], "error_pct": r["error_pct"],
                                "spread_pct": r.get("spread_pct")} for k, r in v["metrics"].items()},
            }
            r = results[tname][pname]
            print(f"{tname:11s} {pname:16s} median |err| {r['median_abs_error_pct']:5.1f}%  max "
                  f"{r['max_abs_error_pct']:5.1f}% ({r['worst_metric']})  step p50 "
                  f"{r['step_error_pct']['p50']:5.1f}%  real spread {r['real_spread_pct_median'] or 0:5.1f}%  "
                  f"machine speed {_speed(r['machine_speed'])}  drift-adjusted median |err| "
                  f"{_num((r['drift_adjusted'] or {}).get('median_abs_error_pct'))}% max "
                  f"{_num((r['drift_adjusted'] or {}).get('max_abs_error_pct'))}%",
                  flush=True)
    out = {
        "benchmark": "fidelity",
        "model": args.model,
        "profile": path.name,
        "profile_calibrated_now": bool(args.calibrate),
        "repeat": args.repeat,
        "target": {"median_abs_error_pct": 3.0, "max_abs_error_pct": 10.0},
        "blas": {k: v for k, v in blas.info().items() if k in ("name", "threads", "thread_timeout")},
        "machine": {"platform": platform.platform(), "cpus": __import__("os").cpu_count()},
        "wall_s": round(time.perf_counter() - t0, 1),
        "results": results,
        "per_policy": {p: _per_policy([results[t][p] for t in results]) for p in args.policies.split(",")},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


def _per_policy(rows: list[dict]) -> dict:
    """Over the traces: median of the median |error|, worst |error|, plain and drift-adjusted."""
    out = {"median_abs_error_pct": statistics.median(r["median_abs_error_pct"] for r in rows),
           "max_abs_error_pct": max(r["max_abs_error_pct"] for r in rows)}
    adj = [r["drift_adjusted"] for r in rows if r.get("drift_adjusted")]
    if adj:
        out["drift_adjusted"] = {"median_abs_error_pct": statistics.median(a["median_abs_error_pct"] for a in adj),
                                 "max_abs_error_pct": max(a["max_abs_error_pct"] for a in adj)}
    return out


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:5.1f}"


def _speed(speed: dict | None) -> str:
    """'1.31x/1.28x': the profile's reference passes before/after the real runs, vs calibration."""
    if not speed:
        return "-"
    return "/".join(f"{speed[w]['ratio']:.2f}x" if speed.get(w) else "-" for w in ("before", "after"))


if __name__ == "__main__":
    main()
