"""Calibration A/B: does a change to the calibration (the grid, its fit) predict held-out real runs better?

A change to how a profile is made cannot be judged by re-fitting kept data when it changes what
is measured (a new grid point): it needs fresh calibrations, and two calibrations of the same
code already differ (the machine drifts by several percent within minutes). So: the default
calibration (``calibrate_default``, what ``validate``/``run-real`` make) of checkout A and of
checkout B, made side by side A B A B ..., each in a process of its own; then each profile
re-scores the kept real runs of earlier ``bench/fidelity.py --keep`` recordings
(``bench/fidelity.py --rescore KEPT --profile P``: no real run, seconds). Recorded per profile:
its wall time, the replay's held-out step error and the grid's held-out pass error per group;
per profile and recording: the rows' median / worst error and how many rows meet the goal,
plain and speed-matched (the simulation at each kept run's own speed against the new profile:
the model's share, comparable across profiles made on other days), the pairwise directions, and
the kept steps' bias by prefill size. Per side, the sums over its profiles.

    python bench/calibration_ab.py --a /path/to/checkout-A --b . --model tiny \\
        --kept /tmp/fid-cfd,/tmp/fid-243 --rounds 2 --out bench/results/calibration_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedlab.analysis.runfit import step_predictions  # noqa: E402
from schedlab.sim.features import read_features  # noqa: E402

CALIBRATE = """
import sys, time, json
sys.path.insert(0, sys.argv[1])
from schedlab import engine  # OpenBLAS before mlx
from schedlab.engine.models import load_model
from schedlab.engine.calibrate import calibrate_default, write_profile
t = time.perf_counter()
write_profile(calibrate_default(load_model(sys.argv[2])), sys.argv[3])
print(round(time.perf_counter() - t, 1))
"""

PREFILL_BINS = ((0, 0), (1, 256), (257, 1024), (1025, 2048), (2049, 10**9))


def commit(checkout: Path) -> str:
    r = subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def calibrate(checkout: Path, model: str, out: Path) -> float:
    r = subprocess.run([sys.executable, "-c", CALIBRATE, str(checkout), model, str(out)],
                       capture_output=True, text=True, cwd=checkout)
    if r.returncode != 0:
        raise SystemExit(f"calibration in {checkout} failed:\n{r.stderr[-2000:]}")
    return float(r.stdout.split()[-1])


def rescore(kept: Path, model: str, profile: Path, out: Path) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fidelity.py"), "--rescore", str(kept), "--models", model,
                        "--profile", str(profile), "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"re-score of {kept} failed:\n{r.stderr[-2000:]}")
    return json.loads(out.read_text())["models"][model]


def profile_summary(path: Path, wall_s: float) -> dict:
    p = json.loads(path.read_text())
    rep, held = p.get("fit_report") or {}, (p.get("runs_report") or {}).get("held_out") or {}
    return {"wall_s": wall_s,
            "replay_held_out": {k: {"median_abs_pct": round(v["median_abs_pct"], 2), "bias": round(v["bias"], 4),
                                    "total_pct": round(v["total_pct"], 2)} for k, v in held.items() if v.get("n")},
            "grid_held_out_median_abs_pct": {g: round(rep[g]["held_out"]["median_abs_pct"], 2)
                                             for g in ("decode", "join", "leave", "prefill")
                                             if (rep.get(g) or {}).get("held_out", {}).get("n")},
            "terms": {g: rep[g]["terms"] for g in ("decode", "prefill") if rep.get(g)}}


def kept_steps(kept: Path, model: str) -> list[dict]:
    """The kept real runs' step tables (``features.parquet``), read once per recording."""
    return [read_features(f) for f in sorted((kept / model.replace("/", "_")).glob("*/*/real*/features.parquet"))]


def step_bias_by_prefill(tables: list[dict], coef: dict) -> dict:
    """The kept real steps' measured / predicted under ``coef``, by prefill tokens in the step."""
    meas = {b: [] for b in PREFILL_BINS}
    pred = {b: [] for b in PREFILL_BINS}
    for cols in tables:
        p = step_predictions(cols, coef)
        for lo, hi in PREFILL_BINS:
            sel = (cols["prefill_tokens"] >= lo) & (cols["prefill_tokens"] <= hi)
            meas[(lo, hi)] += list(cols["measured_s"][sel])
            pred[(lo, hi)] += list(p[sel])
    out = {}
    for (lo, hi), m in meas.items():
        if m:
            m, p = np.array(m), np.array(pred[(lo, hi)])
            out[f"{lo}-{hi}" if hi < 10**9 else f"{lo}+"] = {"steps": len(m), "median": round(float(np.median(m / p)), 4),
                                                            "total": round(float(m.sum() / p.sum()), 4)}
    return out


def row_summary(res: dict) -> dict:
    o = res["overall"]
    pw, pws = res["pairwise"].get("all") or {}, (res.get("pairwise_speed_matched") or {}).get("all") or {}
    keys = ("median_of_median_abs_error_pct", "median_of_max_abs_error_pct", "rows_median_within_goal",
            "rows_max_within_goal", "rows")
    return {"plain": {k: o["plain"][k] for k in keys}, "speed_matched": {k: o["speed_matched"][k] for k in keys},
            "pairwise_right": [pw.get("right"), pw.get("considered")],
            "pairwise_speed_matched_right": [pws.get("right"), pws.get("considered")]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="checkout A (the calibration as it was)")
    ap.add_argument("--b", default=str(ROOT), help="checkout B (the change; default: this one)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--kept", required=True, help="bench/fidelity.py --keep directories, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--what", default="", help="one line saying what B changes, kept in the JSON")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "calibration_ab.json"))
    args = ap.parse_args()
    sides = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    kept = [Path(k) for k in args.kept.split(",") if k]
    for k in kept:
        if not (k / args.model.replace("/", "_") / "profile.json").is_file():
            raise SystemExit(f"{k}: no kept {args.model} recording (bench/fidelity.py --keep)")
    tmp = Path(tempfile.mkdtemp(prefix="calibration-ab-"))
    t0 = time.perf_counter()
    profiles: dict[str, dict] = {}
    for r in range(1, args.rounds + 1):
        for side, checkout in sides.items():  # A B A B: the machine's drift meets both alike
            path = tmp / f"{side}{r}.json"
            wall = calibrate(checkout, args.model, path)
            profiles[f"{side}{r}"] = {"path": path, **profile_summary(path, wall)}
            print(f"{side}{r}: calibrated in {wall} s", flush=True)
    tables = {k: kept_steps(k, args.model) for k in kept}
    for tag, prof in profiles.items():
        coef = json.loads(prof["path"].read_text())["coefficients"]
        prof["rescored"] = {}
        for k in kept:
            res = rescore(k, args.model, prof["path"], tmp / f"{tag}_{k.name}.json")
            prof["rescored"][k.name] = {**row_summary(res), "step_bias_by_prefill_tokens":
                                        step_bias_by_prefill(tables[k], coef)}
            sm = prof["rescored"][k.name]["speed_matched"]
            print(f"{tag} {k.name}: speed-matched {sm['median_of_median_abs_error_pct']:.1f} / "
                  f"{sm['median_of_max_abs_error_pct']:.1f} % ({sm['rows_median_within_goal']} / "
                  f"{sm['rows_max_within_goal']} of {sm['rows']} rows within the goal)", flush=True)
        prof["path"] = str(prof["path"])
    totals = {}
    for side in sides:
        rows = [v for tag, p in profiles.items() if tag.startswith(side) for v in p["rescored"].values()]
        totals[side] = {
            f"{kind}_rows_{which}_within_goal": sum(r[kind][f"rows_{which}_within_goal"] for r in rows)
            for kind in ("plain", "speed_matched") for which in ("median", "max")}
        totals[side]["rows"] = sum(r["speed_matched"]["rows"] for r in rows)
        totals[side]["speed_matched_median_of_medians"] = round(statistics.median(
            r["speed_matched"]["median_of_median_abs_error_pct"] for r in rows), 2)
        totals[side]["pairwise_speed_matched_right"] = [sum(r["pairwise_speed_matched_right"][i] or 0 for r in rows)
                                                        for i in (0, 1)]
        totals[side]["calibration_s"] = [p["wall_s"] for tag, p in profiles.items() if tag.startswith(side)]
    out = {"benchmark": "calibration_ab", "what": args.what, "model": args.model, "rounds": args.rounds,
           "checkouts": {k: commit(v) for k, v in sides.items()}, "kept": [str(k) for k in kept],
           "profiles": profiles, "totals": totals, "wall_s": round(time.perf_counter() - t0, 1)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for side, t in totals.items():
        print(f"{side}: speed-matched rows within the goal {t['speed_matched_rows_median_within_goal']} / "
              f"{t['speed_matched_rows_max_within_goal']} of {t['rows']} (median / worst), median of the rows' "
              f"medians {t['speed_matched_median_of_medians']} %, pairwise {t['pairwise_speed_matched_right']}, "
              f"calibration {t['calibration_s']} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
