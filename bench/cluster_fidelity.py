"""A real cluster against its simulation: 2 replicas of SmolLM2-135M (one core each) behind two
routers, the same trace replayed through ``run-real --replicas 2`` several times per router
(the routers alternating round by round: this machine drifts), then ``validate --served`` on each
router's runs: the simulated cluster, each replica and the routing against the real runs, with
the real runs' own spread (each run held out against the others' median).

The replicas plan with a cost profile of SmolLM2 measured on one core (the replicas' share):
without one cached, the first run's replica 0 calibrates it before the others start.

    python bench/cluster_fidelity.py [--rounds 3] [--routers least-requests,round-robin]

Results: ``bench/results/cluster_fidelity.json`` (``docs/cluster.md``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

TRACE = "sonnet:n=24,input_len=128,output_len=32,prefix_len=32,rate=0.6"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--routers", default="least-requests,round-robin")
    ap.add_argument("--policy", default="vllm")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=common.result_path("cluster_fidelity"))
    ap.add_argument("--validate-only", action="store_true", help="the runs are in --work already: compare only")
    args = ap.parse_args()
    routers = args.routers.split(",")
    work = args.work or Path(tempfile.mkdtemp(prefix="cluster-fidelity-"))
    runs: dict[str, list[Path]] = {r: [] for r in routers}
    walls: dict[str, list[float]] = {r: [] for r in routers}
    for k in range(args.rounds):
        for router in routers:
            d = work / f"{router}-{k + 1}"
            if args.validate_only:
                runs[router].append(d)
                continue
            cmd = ["schedlab", "run-real", "--policy", args.policy, "--model", args.model, "--trace", args.trace,
                   "--replicas", "2", "--router", router, "--out", str(d), "-q"]  # fmt: skip
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            walls[router].append(time.perf_counter() - t0)
            if p.returncode != 0:
                raise SystemExit(f"run-real failed ({router}, round {k + 1}): {p.stderr.strip()[-3000:]}")
            print(f"round {k + 1} {router}: {walls[router][-1]:.0f} s", file=sys.stderr, flush=True)
            runs[router].append(d)
    results = {}
    for router in routers:
        v_out = work / f"validate-{router}"
        cmd = ["schedlab", "validate", *sum((["--served", str(d)] for d in runs[router]), []), "--out", str(v_out)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"validate --served failed ({router}): {p.stderr.strip()[-3000:]}")
        print(p.stdout)
        v = json.loads((v_out / "validation.json").read_text())
        total = v["total"]
        results[router] = {
            "median_abs_error_pct": total["median_abs_error_pct"],
            "max_abs_error_pct": total["max_abs_error_pct"],
            "hold_one_out": total.get("hold_one_out"),
            "per_run": total.get("per_run"),
            "metrics": total["metrics"],
            "per_replica": [
                {
                    "median_abs_error_pct": r["median_abs_error_pct"],
                    "hold_one_out": r.get("hold_one_out"),
                }
                for r in v["per_replica"]
            ],
            "routing": v["routing"],
            "profile": v["profile"],
            "run_wall_s": walls[router] or None,
        }
    out = {
        "bench": "cluster_fidelity",
        "what": "run-real --replicas 2 (one core each) behind each router, rounds alternating routers; "
        "validate --served on each router's runs (simulation vs the real runs' median; each run held out "
        "against the others' median: the simulation's error beside a real run's own)",
        "trace": args.trace,
        "policy": args.policy,
        "model": args.model,
        "rounds": args.rounds,
        "revision": common.git_rev(),
        "machine": common.machine(),
        "routers": results,
    }
    common.write_json(out, args.out)
    for router, r in results.items():
        h = r["hold_one_out"] or {}
        print(
            f"{router}: median |error| {r['median_abs_error_pct']:.1f} %, held out: sim "
            f"{h.get('sim_median_pct', float('nan')):.1f} % / a real run {h.get('real_median_pct', float('nan')):.1f} %"
        )


if __name__ == "__main__":
    main()
