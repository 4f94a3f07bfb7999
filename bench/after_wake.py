"""After a wake: how much slower a lone decode step runs, by steps and by time since the replica woke.

Reads real runs' ``features.parquet`` (run directories under DIR, e.g. ``bench/regime.py``'s or
``bench/fidelity.py --keep``'s) and scores each step against a profile's coefficients (the
loop's own prediction, ``analysis.runfit.step_predictions``). One-row decode steps with nothing
joining, leaving or prefilling, grouped by how many steps (and how many seconds) after the
last wake of the idle replica they started; per group the median measured / predicted, per run
case (the run directory's name: policy or trace_policy) and over all. The wake's own step is
priced by the after-idle terms (``i_step``, ``i_gap``); ``i_after`` prices the ones after it.

    python bench/after_wake.py DIR [--profile P] [--out bench/results/after_wake_tiny.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedlab.analysis.runfit import step_predictions  # noqa: E402
from schedlab.sim.features import read_features, steps_since_wake  # noqa: E402

STEP_BINS = ((1, 1), (2, 2), (3, 3), (4, 5), (6, 10), (11, 20), (21, 40), (41, 80), (81, 10**9))
TIME_BINS = ((0.0, 0.05), (0.05, 0.1), (0.1, 0.2), (0.2, 0.4), (0.4, 0.8), (0.8, 1e9))


def lone_decode_after_wake(cols: dict, pred: np.ndarray):
    """(ratio, steps since the wake, seconds since the wake) of each one-row decode step that
    follows a wake in its run."""
    k = steps_since_wake(cols["after_idle"])
    idx = np.arange(len(k))
    t = np.where(k >= 0, cols["start_s"] - cols["start_s"][np.maximum(idx - k, 0)], np.nan)  # from the wake's start
    lone = ((cols["decode_rows"] == 1) & (cols["prefill_tokens"] == 0) & (cols["joins"] == 0)
            & (cols["leaves"] == 0) & (k >= 1))
    return cols["measured_s"][lone] / pred[lone], k[lone], t[lone]


def table(ratio, k, t) -> dict:
    def cell(sel):
        return {"steps": int(sel.sum()), "median": round(float(np.median(ratio[sel])), 4)} if sel.any() else None
    label = lambda lo, hi: f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f"{lo}+")  # noqa: E731
    return {"by_steps_since_wake": {label(lo, hi): cell((k >= lo) & (k <= hi)) for lo, hi in STEP_BINS},
            "by_seconds_since_wake": {(f"{lo}-{hi}" if hi < 1e9 else f"{lo}+"): cell((t >= lo) & (t < hi))
                                      for lo, hi in TIME_BINS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", help="a directory holding run directories (searched two levels down)")
    ap.add_argument("--profile", default=None, help="coefficients to score against (default: DIR/profile.json)")
    ap.add_argument("--skip", default="replay-0", help="run paths containing this are left out (a calibration's "
                    "own replay: the data its fit was made from)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = Path(args.runs)
    prof_path = Path(args.profile) if args.profile else base / "profile.json"
    if not prof_path.is_file():
        raise SystemExit(f"{prof_path}: no profile to score against (--profile)")
    coef = json.loads(prof_path.read_text())["coefficients"]
    files = sorted(p for p in list(base.glob("*/*/features.parquet")) + list(base.glob("*/features.parquet"))
                   if not (args.skip and args.skip in str(p)))
    if not files:
        raise SystemExit(f"{base}: no run directories with features.parquet")
    per: dict[str, list] = {}
    for f in files:
        cols = read_features(f)
        case = f.parent.name if "replay" not in str(f.parent.parent.name) else f"replay/{f.parent.name}"
        per.setdefault(case, []).append(lone_decode_after_wake(cols, step_predictions(cols, coef)))
    out = {"benchmark": "after_wake", "runs_dir": str(base), "profile": str(prof_path), "runs": len(files),
           "cases": {}}
    every = []
    for case, parts in sorted(per.items()):
        r, k, t = (np.concatenate([p[i] for p in parts]) for i in range(3))
        out["cases"][case] = {"runs": len(parts), **table(r, k, t)}
        every.append((r, k, t))
    out["all"] = table(*(np.concatenate([e[i] for e in every]) for i in range(3)))
    for case, v in list(out["cases"].items()) + [("all", out["all"])]:
        cells = "  ".join(f"{b}: {c['median']:.3f}" for b, c in v["by_steps_since_wake"].items() if c)
        print(f"{case:30s} {cells}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
