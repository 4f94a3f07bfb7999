"""Step jitter against kept real runs: does drawing each simulated step's noise bring the
simulation closer to the real engine's percentiles?

A cost model predicts a step's mean seconds; a real step of the same shape takes now less, now
more (skewed to the slow side), so a deterministic simulation puts ITL p50 (a typical step)
above the real one and may miss the slow tail. ``sim.jitter.StepJitter`` is a calibration's
measured / predicted step times as a mean-1 distribution (a profile fitted from runs carries
it); ``SimBackend(jitter=...)`` draws one multiplier per step.

This re-scores ``bench/fidelity.py --keep`` directories (their real runs and profiles; no real
run here) with no jitter and with the profile's jitter, median over N draws, side by side: the
same real runs on both sides, so the difference is the jitter's alone. Recorded per kept
directory and model: the overall figures (plain and speed-matched), the pairwise-direction
share, and per metric the median |error| over the rows (speed-matched: the machine's speed
taken out, what is left is the model's).

    python bench/jitter.py --kept DIR[,DIR...] [--draws 1,3] [--out bench/results/jitter_rescore.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fidelity import kept_replay, kept_traces, rescore_model  # noqa: E402
from schedlab.policies import POLICIES  # noqa: E402


def kept_models(kept_dirs: str, models: str, overrides: dict):
    """(kept directory, model, trace specs) for every model a comma-separated list of
    ``bench/fidelity.py --keep`` directories holds (``overrides``: ``--traces``, parsed)."""
    for kept in kept_dirs.split(","):
        kp = Path(kept)
        for model in models.split(","):
            if (kp / model).is_dir():
                yield kp, model, overrides.get(model) or kept_traces(kp, model)


def spread_by_size(kept: Path) -> list[dict]:
    """The kept replay runs' measured / predicted step times under the kept profile, by the
    step's predicted seconds (bins at its 50th, 80th and 95th percentiles): is the spread
    relative (the same ratios for small and large steps) or not?"""
    import numpy as np

    from schedlab.analysis.runfit import predict
    from schedlab.sim.cost import LinearCostModel

    coef = dict(LinearCostModel.from_profile(kept / "profile.json").coefficients)
    runs = kept_replay(kept)
    pred = np.concatenate([predict(coef, r.cols) for r in runs])
    meas = np.concatenate([r.cols["measured_s"] for r in runs])
    ok = pred > 0
    pred, ratio = pred[ok], meas[ok] / pred[ok]
    edges = np.quantile(pred, [0.0, 0.5, 0.8, 0.95, 1.0])
    out = []
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        sel = (pred >= lo) & ((pred < hi) if k < 3 else (pred <= hi))
        q = np.quantile(ratio[sel], [0.1, 0.5, 0.9, 0.99])
        out.append({"predicted_ms": [round(1e3 * lo, 2), round(1e3 * hi, 2)], "steps": int(sel.sum()),
                    **{f"p{p}": round(float(v), 3) for p, v in zip((10, 50, 90, 99), q)}})
    return out


def _digest(res: dict) -> dict:
    per_metric: dict[str, dict[str, float]] = {}
    rows = [r for t in res["traces"].values() for r in t.values()]
    for way in ("plain", "speed_matched"):
        acc: dict[str, list[float]] = {}
        for r in rows:
            errs = ({k: v["error_pct"] for k, v in r["metrics"].items()} if way == "plain"
                    else (r.get("speed_matched") or {}).get("error_pct") or {})
            for k, v in errs.items():
                if v is not None:
                    acc.setdefault(k, []).append(v)
        per_metric[way] = {k: {"median_abs": round(statistics.median(map(abs, v)), 2),
                               "median_signed": round(statistics.median(v), 2)} for k, v in acc.items()}
    pw = res["pairwise"].get("all") or {}
    return {"overall": res["overall"], "pairwise": {"right": pw.get("right"), "considered": pw.get("considered")},
            "per_metric": per_metric, "step_jitter": res["calibration"].get("step_jitter")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kept", required=True, help="bench/fidelity.py --keep directories, comma-separated")
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--draws", default="1,3", help="jittered simulations per run (median taken), comma-separated")
    ap.add_argument("--traces", default=None, help="as bench/fidelity.py's --traces, for kept runs of other traces")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "jitter_rescore.json"))
    args = ap.parse_args()
    from bench.fidelity import _parse_traces

    overrides = _parse_traces(args.traces)
    draws = [0] + [int(x) for x in args.draws.split(",") if x.strip()]
    out: dict = {"benchmark": "jitter", "draws": draws, "kept": {}}
    t0 = time.perf_counter()
    for kp, model, specs in kept_models(args.kept, args.models, overrides):
        got = {}
        for n in draws:
            with redirect_stdout(io.StringIO()):
                res = rescore_model(model, list(POLICIES), specs, kp / model, jitter=n)
            got["none" if n == 0 else f"jitter_{n}"] = _digest(res)
            o = res["overall"]
            print(f"{kp.name} {model} {'no jitter' if n == 0 else f'jitter x{n}':<10} "
                  f"plain {o['plain']['median_of_median_abs_error_pct']:5.1f} / "
                  f"{o['plain']['median_of_max_abs_error_pct']:5.1f}  matched "
                  f"{o['speed_matched']['median_of_median_abs_error_pct']:5.1f} / "
                  f"{o['speed_matched']['median_of_max_abs_error_pct']:5.1f}", flush=True)
        out["kept"].setdefault(kp.name, {})[model] = {"traces": [f"{s}@{seed}" for s, seed in specs], **got,
                                                      "spread_by_size": spread_by_size(kp / model)}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
