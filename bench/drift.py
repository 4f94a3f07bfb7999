"""Drift: how far the same real work moves away from its calibration, minute by minute.

The fidelity goal (issue 13) asks for a total predicted step time within +-3 % of measured on
traces run after the calibration. That presumes the machine runs the same passes at the same
speed from the calibration to the runs. This measures it directly, with nothing else changing:
the default calibration (quick grid + real replay, as ``validate`` and ``run-real`` make it;
``--profile`` and ``--replay`` reuse a kept one), then the very same replay (same trace, same
policies, same seed, same engine) run again ``--rounds`` times, ``--gap`` seconds apart, each
compared with the profile step by step: the median measured/predicted (bias) and the total
predicted vs measured step time, per policy and per round. Round 0 is the calibration's own
replay (the fit's data: ~0 by construction). Whatever the later rounds show is the machine,
not the cost model: the work and the model are identical.

    python bench/drift.py [--model smollm2-135m] [--rounds 4] [--gap 120]
                          [--profile P --replay DIR] [--out bench/results/drift.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedlab import engine  # noqa: E402,F401  (OpenBLAS before mlx)
from schedlab.analysis.runfit import errors, load_runs, predict  # noqa: E402
from schedlab.engine import blas  # noqa: E402
from schedlab.engine.calibrate import calibrate_default, grid_coefficients, record_replay, write_profile  # noqa: E402
from schedlab.engine.models import load_model  # noqa: E402
from schedlab.sim.cost import LinearCostModel, read_profile  # noqa: E402


def score(coef: dict, dirs) -> dict:
    """Per replay run (policy): its steps against ``coef``."""
    out = {}
    for r in load_runs(dirs):
        e = errors(predict(coef, r.cols), r.cols["measured_s"])
        out[Path(r.name).name] = {"steps": e["n"], "bias": round(e["bias"], 4), "total_pct": round(e["total_pct"], 2),
                                  "median_abs_pct": round(e["median_abs_pct"], 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=4, help="replays after the calibration's own")
    ap.add_argument("--gap", type=float, default=120.0, help="seconds between the end of one replay and the next")
    ap.add_argument("--profile", default=None, help="a kept default calibration (with --replay: its replay runs)")
    ap.add_argument("--replay", default=None, help="the kept calibration's replay directory")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "drift.json"))
    args = ap.parse_args()
    if (args.profile is None) != (args.replay is None):
        raise SystemExit("--profile and --replay go together (a kept calibration and its replay runs)")
    info = load_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="drift-"))
    t0 = time.perf_counter()
    if args.profile:
        prof, replay0 = read_profile(args.profile), Path(args.replay)
        cal = {"kind": "kept", "profile": args.profile}
    else:
        print(f"{args.model}: default calibration ...", flush=True)
        prof = calibrate_default(info, progress=lambda m: None, keep=work / "replay-0")
        write_profile(prof, work / "profile.json")
        replay0 = work / "replay-0"
        cal = {"kind": prof["calibration"].get("kind"), "wall_s": prof["calibration"].get("wall_s")}
    coef = dict(prof["coefficients"])
    seconds = float(prof["calibration"].get("replay_s") or 8.0)
    # the replay's trace is drawn from the grid's fit alone: the same one as the calibration's
    grid_cost = LinearCostModel(_grid_coefficients(prof))
    rounds = [{"round": 0, "minutes": 0.0, "what": "the calibration's own replay (its fit's data)",
               "runs": score(coef, sorted(p for p in replay0.iterdir() if p.is_dir()))}]
    t_ref = time.perf_counter()
    for k in range(1, args.rounds + 1):
        time.sleep(args.gap)
        minutes = (time.perf_counter() - t_ref) / 60.0
        dirs = record_replay(info, grid_cost, work / f"replay-{k}", seconds=seconds, seed=0, say=lambda m: None)
        rounds.append({"round": k, "minutes": round(minutes, 1), "runs": score(coef, dirs)})
        _print(rounds[-1])
    out = {"benchmark": "drift", "model": args.model, "calibration": cal, "gap_s": args.gap,
           "blas": {k: v for k, v in blas.info().items() if k in ("name", "threads", "thread_timeout")},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
           "rounds": rounds, "summary": _summary(rounds), "wall_s": round(time.perf_counter() - t0, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["summary"], indent=1))
    print(f"wrote {args.out}")


def _grid_coefficients(prof: dict) -> dict:
    """The grid's own fit (what ``calibrate_default`` drew the replay's trace from)."""
    coef = grid_coefficients(prof)
    if coef is None:
        raise SystemExit("the profile keeps no grid samples: cannot draw its replay's trace again")
    return coef


def _print(r: dict) -> None:
    cells = "  ".join(f"{p} bias {v['bias']:.3f} total {v['total_pct']:+.1f} %" for p, v in r["runs"].items())
    print(f"round {r['round']} (+{r['minutes']:.1f} min): {cells}", flush=True)


def _summary(rounds: list[dict]) -> dict:
    later = [v for r in rounds[1:] for v in r["runs"].values()]
    if not later:
        return {}
    totals = [v["total_pct"] for v in later]
    return {"later_runs": len(later), "bias_min": min(v["bias"] for v in later),
            "bias_median": statistics.median(v["bias"] for v in later),
            "bias_max": max(v["bias"] for v in later), "total_pct_min": min(totals),
            "total_pct_median": statistics.median(totals), "total_pct_max": max(totals),
            "within_3pct": sum(1 for t in totals if abs(t) <= 3.0)}


if __name__ == "__main__":
    main()
