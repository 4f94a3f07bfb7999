"""Long context: a regime the default calibration misses, or the machine?

The default calibration's replay (``engine.calibrate.replay_trace``) draws prompts of 16..256
tokens, so its runs never decode past ~300 tokens of context, while the bundled real-mixed
trace decodes 3-4 rows at ~1,900 tokens. ``bench/regime.py`` found vllm on real-mixed 1.10x
its profile's speed over the replay beside it, at every place in its rounds: a lead for a
missing long-context term. This tests the lead directly, on ``tiny``:

- profile A: the default calibration (quick grid + the short replay), as ``validate`` makes it;
- a second replay of the same policies with prompts of 16..2048 tokens (``max_prompt``), and
  profiles B (grid + long replay) and C (grid + both replays), fitted on the same grid;
- profile A_measured: A's grid and replay fitted with the weighting the fit had before, each
  step's error relative to its measured seconds (``analysis.runfit.Config.weigh_by``): the
  weighting's share, on the same runs;
- ``--rounds`` rounds of [the short replay, the long replay, the held-out cases of
  ``bench/regime.py`` in rotating order], every run run with profile A and scored under every
  profile by its speed (total measured over predicted step seconds); a run's speed over the short
  replay's in the same round divides the machine's drift out.

If long contexts were a regime the short replay misses, the long replay and real-mixed would run
slower than A says, relative to the short replay beside them, and B or C would close the gap.

    python bench/long_context.py [--rounds 4] [--out bench/results/long_context_tiny.json]
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
from schedlab.analysis.runfit import load_runs, profile_from_runs  # noqa: E402
from bench.drift import _grid_coefficients  # noqa: E402
from bench.regime import CASES  # noqa: E402
from schedlab.engine import blas  # noqa: E402
from schedlab.engine.calibrate import calibrate_default, record_replay, write_profile  # noqa: E402
from schedlab.engine.models import load_model  # noqa: E402
from schedlab import api  # noqa: E402
from schedlab.sim.cost import LinearCostModel  # noqa: E402

LONG_PROMPT = 2048
PROFILES = ("A", "A_measured", "B", "C")


def _context(run_dir: Path) -> dict:
    """How far a run's decode steps reach: the longest context and the steps past 1,024 tokens."""
    (r,) = load_runs([run_dir])
    ctx, rows = r.cols["decode_ctx"], r.cols["decode_rows"]
    return {"max_ctx": int(ctx.max()), "steps_past_1024": int((ctx > 1024).sum()),
            "steps_3plus_rows_past_1024": int(((ctx > 1024) & (rows >= 3)).sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "long_context_tiny.json"))
    args = ap.parse_args()
    info = load_model("tiny")
    work = Path(tempfile.mkdtemp(prefix="long-context-"))
    t0 = time.perf_counter()
    print("tiny: default calibration (profile A) ...", flush=True)
    prof_a = calibrate_default(info, progress=lambda m: None, keep=work / "short-0")
    seconds = float(prof_a["calibration"].get("replay_s") or 8.0)
    grid_prof = dict(prof_a, coefficients=_grid_coefficients(prof_a))
    grid_cost = LinearCostModel(dict(grid_prof["coefficients"]))  # what the replays' traces are drawn from
    long0 = record_replay(info, grid_cost, work / "long-0", seconds=seconds, seed=0, max_prompt=LONG_PROMPT)
    short0 = sorted(d for d in (work / "short-0").iterdir() if d.is_dir())

    def fit(dirs, weigh_by="prediction"):
        runs = load_runs(dirs)
        for r in runs:
            r.name = Path(r.name).name
        return profile_from_runs(runs, grid_prof, kind="grid+replay", weigh_by=weigh_by)

    profs = {"A": prof_a, "A_measured": fit(short0, "measured"), "B": fit(long0), "C": fit(short0 + long0)}
    path_a = write_profile(prof_a, work / "profile-A.json")
    coefs = {k: dict(p["coefficients"]) for k, p in profs.items()}
    fits = {k: {key: p["runs_report"][key] for key in ("chosen", "score", "fit")} for k, p in profs.items()}
    cal_s = round(time.perf_counter() - t0, 1)
    print(f"calibrated in {cal_s} s", flush=True)

    def speeds(d: Path) -> dict:
        (r,) = load_runs([d])
        return {k: api.run_speed(r.cols, c) for k, c in coefs.items()}

    keys = [f"{t if t.startswith('real-') else 'random@' + str(s)}/{p}" for t, s, p in CASES["tiny"]]
    context = {"short replay": _context(short0[0]), "long replay": _context(long0[0])}
    rounds = []
    for k in range(1, args.rounds + 1):
        row: dict = {"round": k, "minutes": round((time.perf_counter() - t0) / 60.0, 1)}
        short = record_replay(info, grid_cost, work / f"short-{k}", seconds=seconds, seed=0)
        long_ = record_replay(info, grid_cost, work / f"long-{k}", seconds=seconds, seed=0, max_prompt=LONG_PROMPT)
        row["short_replay"] = {d.name: speeds(d) for d in short}
        row["long_replay"] = {d.name: speeds(d) for d in long_}
        row["held_out"] = {}
        cases = list(zip(keys, CASES["tiny"]))
        shift = (k - 1) % len(cases)
        for key, (trace, seed, pol) in cases[shift:] + cases[:shift]:
            d = work / f"round-{k}" / key.replace("/", "_").replace("@", "_")
            api.run_real(pol, trace, model="tiny", profile=str(path_a), seed=seed,
                         log=lambda kind, msg: None).save(d)
            row["held_out"][key] = speeds(d)
            if k == 1 and key.startswith("real-mixed"):
                context[key] = _context(d)
        ref = {p: statistics.median(v[p] for v in row["short_replay"].values()) for p in PROFILES}
        row["short_replay_median"] = ref
        row["over_short_replay"] = {
            **{f"long replay/{n}": {p: v[p] / ref[p] for p in PROFILES} for n, v in row["long_replay"].items()},
            **{key: {p: v[p] / ref[p] for p in PROFILES} for key, v in row["held_out"].items()}}
        rounds.append(row)
        print(f"round {k} (+{row['minutes']} min): short replay speed under A {ref['A']:.3f}; over it: "
              + "  ".join(f"{n} {v['A']:.3f}" for n, v in row["over_short_replay"].items()), flush=True)

    names = list(rounds[0]["over_short_replay"])
    over = {n: {p: statistics.median(r["over_short_replay"][n][p] for r in rounds) for p in PROFILES}
            for n in names}
    long_names = [n for n in names if n.startswith("long replay/")]
    summary = {
        "short_replay_speed_A": {"min": min(r["short_replay_median"]["A"] for r in rounds),
                                 "max": max(r["short_replay_median"]["A"] for r in rounds)},
        "over_short_replay_median": over,
        "long_replay_over_short_median": {p: statistics.median(r["over_short_replay"][n][p] for r in rounds
                                                               for n in long_names) for p in PROFILES},
        "held_out_over_short_median": {p: statistics.median(r["over_short_replay"][key][p] for r in rounds
                                                            for key in keys) for p in PROFILES},
        "speed_median": {  # every later run's speed under each profile, not divided by anything
            group: {p: statistics.median(v[p] for r in rounds for v in r[group].values()) for p in PROFILES}
            for group in ("short_replay", "long_replay", "held_out")},
        "profile_speed_vs_A": {p: statistics.median(
            v[p] / v["A"] for r in rounds for v in [*r["short_replay"].values(), *r["long_replay"].values(),
                                                   *r["held_out"].values()]) for p in PROFILES},
    }
    out = {"benchmark": "long_context", "model": "tiny", "rounds": args.rounds, "long_prompt": LONG_PROMPT,
           "cases": keys, "calibration_wall_s": cal_s, "fits": fits, "context": context,
           "blas": {k: v for k, v in blas.info().items() if k in ("name", "threads", "thread_timeout")},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
           "rounds_detail": rounds, "summary": summary, "wall_s": round(time.perf_counter() - t0, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
