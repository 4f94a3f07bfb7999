"""Real-run noise: how much identical real runs differ, under each of the engine's noise settings.

No model can predict a real run closer than real runs agree with each other. This runs the same
policy on the same trace ``--rounds`` times under each setting of ``engine.noise`` (none,
``gc-off``, ``warmup=3``, both; ``pin=`` is left out on a 2-CPU machine, where pinning to every
CPU changes nothing), the settings interleaved round by round (A, B, C, D, A, B, ...: this
machine drifts by up to 35 % within minutes), and records per setting:

- the spread of the nine metrics ``validate`` compares ((max - min) / median over the rounds,
  %), and its median over the metrics: the figure ``bench/fidelity.py`` sets errors beside;
- the steps' own jitter: over every measured step of every round, measured/predicted's
  (p90 - p10) / p50 (%), and p99 / p50 (the tail that ITL p99 sees).

``--blas-threads 1,2`` adds OpenBLAS's thread count as a setting: OpenBLAS reads it once, when
the library loads, so each round's runs for a count go in a child process of their own
(``OPENBLAS_NUM_THREADS`` set for it), the counts alternating round by round like the rest.

    python bench/noise.py [--model tiny] [--policies mlx-default,chunked-prefill]
                          [--traces real-smoke] [--rounds 6] [--settings "none|gc-off"]
                          [--blas-threads 1,2] [--out bench/results/noise.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedlab import engine  # noqa: E402,F401  (OpenBLAS before mlx)
from schedlab.engine import blas  # noqa: E402
from schedlab.analysis.validation import METRICS, _get  # noqa: E402
from schedlab import api  # noqa: E402


def metric_values(summary: dict) -> dict[str, float | None]:
    """The nine metrics ``validate`` compares (``analysis.validation.METRICS``)."""
    return {key: _get(summary, path) for key, path, _ in METRICS}


def spread_pct(values: list[float]) -> float | None:
    med = statistics.median(values)
    return 100.0 * (max(values) - min(values)) / med if med else None


def label(setting: str, threads: int | None) -> str:
    name = setting or "none"
    return name if threads is None else f"{name} blas-threads={threads}"


def one_round(model: str, cases: list[tuple[str, str]], settings: list[str]) -> dict[tuple, tuple]:
    """Every case under every setting once, in this process: metric values and the steps'
    measured/predicted ratios per (setting, policy, trace)."""
    rows = {}
    for p, t in cases:
        for s in settings:
            # the bundled profile: what is measured here is the real runs, not a prediction
            run = api.run_real(p, t, model=model, no_calibrate=True, noise=s or None, log=lambda kind, msg: None)
            f = run.features
            ratio = (f["measured_s"] / f["predicted_s"]).to_numpy()
            rows[(s, p, t)] = (metric_values(run.summary), ratio[np.isfinite(ratio)])
    return rows


def child_round(args: argparse.Namespace, threads: int) -> dict[tuple, tuple]:
    """``one_round`` in a child process whose OpenBLAS runs ``threads`` threads."""
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--policies", args.policies,
           "--traces", args.traces, "--settings", args.settings]
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"noise: the round with OPENBLAS_NUM_THREADS={threads} failed:\n{proc.stderr[-2000:]}")
    return {(s, p, t): (values, np.asarray(ratio)) for s, p, t, values, ratio in json.loads(proc.stdout.splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--policies", default="mlx-default,chunked-prefill")
    ap.add_argument("--traces", default="real-smoke")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--settings", default="none|gc-off|warmup=3|gc-off,warmup=3",
                    help="noise specs separated by | ('none': no setting)")
    ap.add_argument("--blas-threads", default="",
                    help="OpenBLAS thread counts to compare, e.g. 1,2 (each round's runs per count in a child process)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "noise.json"))
    args = ap.parse_args()
    settings = ["" if x.strip().lower() in ("", "none") else x.strip() for x in args.settings.split("|")]
    cases = [(p, t) for t in args.traces.split(",") for p in args.policies.split(",")]
    if args.worker:  # one round, in this process, for the parent (--blas-threads)
        rows = one_round(args.model, cases, settings)
        print(json.dumps([[s, p, t, values, ratio.tolist()] for (s, p, t), (values, ratio) in rows.items()]))
        return
    threads = [int(x) for x in args.blas_threads.split(",")] if args.blas_threads else [None]
    labels = [(s, n) for s in settings for n in threads]
    runs: dict[tuple, list] = {(label(s, n), p, t): [] for s, n in labels for p, t in cases}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for n in threads:
            rows = one_round(args.model, cases, settings) if n is None else child_round(args, n)
            for (s, p, t), (values, ratio) in rows.items():
                runs[(label(s, n), p, t)].append((values, ratio))
                print(f"round {r + 1}/{args.rounds} {t} {p} [{label(s, n)}]: makespan "
                      f"{values['makespan_s']:.2f} s, ITL p99 {values['itl_ms.p99']:.2f} ms", flush=True)
    settings = [label(s, n) for s, n in labels]
    out = {"benchmark": "noise", "model": args.model, "rounds": args.rounds,
           "blas": {k: v for k, v in blas.info().items() if k in ("name", "threads")},
           "openblas_num_threads_env": os.environ.get("OPENBLAS_NUM_THREADS"),
           "blas_threads_compared": threads if args.blas_threads else None,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "settings": {}}
    for s in settings:
        per_case = {}
        for p, t in cases:
            rows = runs[(s, p, t)]
            spreads = {m: spread_pct([row[0][m] for row in rows]) for m in rows[0][0]}
            ratio = np.concatenate([row[1] for row in rows])
            p10, p50, p90, p99 = np.percentile(ratio, [10, 50, 90, 99])
            per_case[f"{t}/{p}"] = {
                "spread_pct": spreads,
                "spread_pct_median": statistics.median(v for v in spreads.values() if v is not None),
                "step_jitter_pct": 100.0 * (p90 - p10) / p50,
                "step_p99_over_p50": p99 / p50,
                "steps": int(ratio.size),
                "makespan_s": [row[0]["makespan_s"] for row in rows],
            }
        out["settings"][s] = {
            "cases": per_case,
            "spread_pct_median": statistics.median(c["spread_pct_median"] for c in per_case.values()),
            "itl_p99_spread_pct_median": statistics.median(c["spread_pct"]["itl_ms.p99"] for c in per_case.values()),
            "step_jitter_pct_median": statistics.median(c["step_jitter_pct"] for c in per_case.values()),
            "step_p99_over_p50_median": statistics.median(c["step_p99_over_p50"] for c in per_case.values()),
        }
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'setting':18s}{'spread %':>10}{'ITL p99 spread %':>18}{'step jitter %':>15}{'p99/p50':>9}")
    for s, v in out["settings"].items():
        print(f"{s:18s}{v['spread_pct_median']:>10.1f}{v['itl_p99_spread_pct_median']:>18.1f}"
              f"{v['step_jitter_pct_median']:>15.1f}{v['step_p99_over_p50_median']:>9.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
