"""Regime or machine? The calibration's own replay and held-out traces, alternated.

After a default calibration, the held-out real runs of ``bench/fidelity.py`` ran slower than it
predicted (the median real run's speed — its steps' total measured over predicted seconds —
1.07x on tiny, 1.10x on smollm2-135m: ``bench/results/fidelity_speed_matched.json``). Either
the machine slowed between the calibration and the runs (drift: ``bench/drift.py`` saw the very
same replay move by -13 to +19 % within ten minutes), or the held-out traces put the engine in
a regime the replay does not cover (a model error). This separates the two: the default
calibration, then ``--rounds`` rounds of [the calibration's replay again, then each held-out
case], every run scored against the profile by its speed. The replay's speed in a round is the
machine's at that moment; a held-out case's speed over the replay's in the same round is the
regime's share, with the drift divided out. The held-out cases rotate from round to round, so
that no case always runs last (after the machine has been busy longest).

    python bench/regime.py [--model tiny] [--rounds 5] [--out bench/results/regime_tiny.json]
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
from schedlab.analysis.runfit import load_runs  # noqa: E402
from bench.drift import _grid_coefficients  # noqa: E402
from schedlab.engine import blas  # noqa: E402
from schedlab.engine.calibrate import calibrate_default, record_replay, write_profile  # noqa: E402
from schedlab.engine.models import load_model  # noqa: E402
from schedlab.engine.noise import Noise  # noqa: E402
from schedlab import api  # noqa: E402
from schedlab.sim.cost import LinearCostModel  # noqa: E402

# (trace, seed, policy): held out from the calibration, as bench/fidelity.py holds them out
CASES = {
    "tiny": [("real-smoke", 0, "mlx-default"), ("real-smoke", 0, "slots"),
             ("random:n=32,input_len=200,output_len=48,range_ratio=0.8,rate=5,burstiness=0.5", 13, "mlx-default"),
             ("random:n=32,input_len=200,output_len=48,range_ratio=0.8,rate=5,burstiness=0.5", 13, "chunked-prefill"),
             ("real-mixed", 0, "vllm")],
    "smollm2-135m": [("random:n=8,input_len=96,output_len=24,range_ratio=0.5,rate=0.6", 11, "mlx-default"),
                     ("random:n=8,input_len=96,output_len=24,range_ratio=0.5,rate=0.6", 11, "unified"),
                     ("random:n=10,input_len=64,output_len=32,range_ratio=0.5,rate=1.5,burstiness=0.5", 12, "vllm")],
}


def speed(coef: dict, run_dir: Path) -> float:
    """A run's steps' total measured seconds over their total predicted under ``coef``."""
    (r,) = load_runs([run_dir])
    return api.run_speed(r.cols, coef)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=sorted(CASES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="default: bench/results/regime_MODEL.json")
    args = ap.parse_args()
    out_path = Path(args.out or ROOT / "bench" / "results" / f"regime_{args.model}.json")
    info = load_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="regime-"))
    t0 = time.perf_counter()
    print(f"{args.model}: default calibration ...", flush=True)
    prof = calibrate_default(info, progress=lambda m: None, keep=work / "replay-0")
    path = write_profile(prof, work / "profile.json")
    coef = dict(prof["coefficients"])
    seconds = float(prof["calibration"].get("replay_s") or 8.0)
    grid_cost = LinearCostModel(_grid_coefficients(prof))  # what the calibration drew its replay from
    keys = [f"{t if t.startswith('real-') else 'random@' + str(s)}/{p}" for t, s, p in CASES[args.model]]
    rounds = [{"round": 0, "replay": {d.name: speed(coef, d) for d in sorted((work / "replay-0").iterdir())
                                      if d.is_dir()}}]
    for k in range(1, args.rounds + 1):
        row: dict = {"round": k, "minutes": round((time.perf_counter() - t0) / 60.0, 1)}
        dirs = record_replay(info, grid_cost, work / f"replay-{k}", seconds=seconds, seed=0)
        row["replay"] = {d.name: speed(coef, d) for d in dirs}
        row["held_out"] = {}
        cases = list(zip(keys, CASES[args.model]))
        shift = (k - 1) % len(cases)  # each case takes each place in the round in turn
        for key, (trace, seed, pol) in cases[shift:] + cases[:shift]:
            d = work / f"round-{k}" / key.replace("/", "_").replace("@", "_")
            api.run_real(pol, trace, model=args.model, profile=str(path), seed=seed,
                         log=lambda kind, msg: None).save(d)
            row["held_out"][key] = speed(coef, d)
        rep = statistics.median(row["replay"].values())
        row["replay_median"] = rep
        row["held_out_over_replay"] = {key: row["held_out"][key] / rep for key in keys}
        row["order"] = list(row["held_out"])
        rounds.append(row)
        print(f"round {k} (+{row['minutes']} min): replay {rep:.3f}  "
              + "  ".join(f"{key} {row['held_out'][key]:.3f} ({row['held_out'][key] / rep:.3f})" for key in keys),
              flush=True)
    later = rounds[1:]
    summary = {
        "replay_speed": {"min": min(r["replay_median"] for r in later), "max": max(r["replay_median"] for r in later),
                         "median": statistics.median(r["replay_median"] for r in later)},
        "held_out_speed_median": {key: statistics.median(r["held_out"][key] for r in later) for key in keys},
        "held_out_over_replay_median": {key: statistics.median(r["held_out_over_replay"][key] for r in later)
                                        for key in keys},
    }
    summary["held_out_over_replay_all_median"] = statistics.median(
        v for r in later for v in r["held_out_over_replay"].values())
    out = {"benchmark": "regime", "model": args.model, "rounds": args.rounds, "cases": keys,
           "calibration": {"kind": prof["calibration"].get("kind"), "wall_s": prof["calibration"].get("wall_s")},
           "blas": {k: v for k, v in blas.info().items() if k in ("name", "threads", "thread_timeout")},
           "noise": Noise.from_env().describe(),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
           "rounds_detail": rounds, "summary": summary, "wall_s": round(time.perf_counter() - t0, 1)}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
