"""The fit's mode, checked on held-out traces: the kept calibration data of earlier recordings
fitted again each way, scored against the same kept real runs.

``analysis.runfit`` can fit a calibration's replay runs (with the grid's passes) ``joint`` — every
term at once — or ``scaled`` — the grid's shapes, one factor per group of terms. Its own
held-out score leaves one replay run out, but every replay run is of the same trace, so that
score cannot see how a mode carries over to other traces. This re-scores ``bench/fidelity.py
--keep`` directories (no real run): per kept directory and model, the profile refitted from the
kept grid samples and replay runs three ways — both modes tried and the one with the better
held-out replay score kept (the choice before ``joint`` became the default), ``joint`` only,
``scaled`` only —
each scored as ``--rescore --refit`` scores it (plain and speed-matched, pairwise, per metric).

    python bench/fit_modes.py --kept DIR[,DIR...] [--traces ...] [--out bench/results/fit_modes.json]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fidelity import _parse_traces, rescore_model  # noqa: E402
from bench.jitter import _digest, kept_models  # noqa: E402
from schedlab.policies import POLICIES  # noqa: E402

# "either": both tried, the better on the held-out replay runs kept (the choice before joint became
# the default); then each alone
MODES = {"either": ("scaled", "joint"), "joint": ("joint",), "scaled": ("scaled",)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kept", required=True, help="bench/fidelity.py --keep directories, comma-separated")
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--traces", default=None, help="as bench/fidelity.py's --traces, for kept runs of other traces")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fit_modes.json"))
    args = ap.parse_args()
    overrides = _parse_traces(args.traces)
    out: dict = {"benchmark": "fit_modes", "kept": {}, "totals": {}}
    t0 = time.perf_counter()
    for kp, model, specs in kept_models(args.kept, args.models, overrides):
        got = {}
        for name, modes in MODES.items():
            with redirect_stdout(io.StringIO()):
                res = rescore_model(model, list(POLICIES), specs, kp / model, refit=True, fit_modes=modes)
            got[name] = {**_digest(res), "chosen": res["calibration"].get("chosen")}
            o = res["overall"]
            tot = out["totals"].setdefault(name, {"rows": 0, "plain_median_within": 0, "plain_max_within": 0,
                                                   "matched_median_within": 0, "matched_max_within": 0})
            tot["rows"] += o["plain"]["rows"]
            tot["plain_median_within"] += o["plain"]["rows_median_within_goal"]
            tot["plain_max_within"] += o["plain"]["rows_max_within_goal"]
            tot["matched_median_within"] += o["speed_matched"]["rows_median_within_goal"]
            tot["matched_max_within"] += o["speed_matched"]["rows_max_within_goal"]
            print(f"{kp.name} {model} {name:<8} ({got[name]['chosen']['mode']}) plain "
                  f"{o['plain']['median_of_median_abs_error_pct']:5.1f} / {o['plain']['median_of_max_abs_error_pct']:5.1f}"
                  f"  matched {o['speed_matched']['median_of_median_abs_error_pct']:5.1f} / "
                  f"{o['speed_matched']['median_of_max_abs_error_pct']:5.1f}", flush=True)
        out["kept"].setdefault(kp.name, {})[model] = {"traces": [f"{s}@{seed}" for s, seed in specs], **got}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("rows within the goal (plain median / worst, matched median / worst):")
    for name, t in out["totals"].items():
        print(f"  {name:<8} {t['plain_median_within']} / {t['plain_max_within']}, "
              f"{t['matched_median_within']} / {t['matched_max_within']} of {t['rows']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
