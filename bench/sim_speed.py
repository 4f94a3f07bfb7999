"""Simulator speed: the whole Azure 2023 conversation hour under every policy.

Writes wall seconds, simulated makespan, requests simulated per wall second and the
speed-up (makespan / wall) per policy, medians over ``--repeat`` runs, to JSON.
Target (issue 2): every policy >= 500x faster than its simulated makespan on 2 cores.

Two cost models: the bundled measured profile (the tiny model on this CPU: the hour is far
beyond its capacity, so makespans are long and the speed-up is easy) and the analytic
roofline of an H100 running Llama 3.1 8B (closer to serving the hour: the harder case for
the target, because the makespan is short and batches are full of work).

    python bench/sim_speed.py [--profile FILE] [--repeat 3] [--out bench/results/sim_speed.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import traces  # noqa: E402
from policies import POLICIES, make_policy  # noqa: E402
from sim import run, summarize  # noqa: E402
from sim.cost import LinearCostModel  # noqa: E402
from sim.profiles import resolve_profile  # noqa: E402

TARGET = 500.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="azure2023_conv")
    ap.add_argument("--profile", default=None, help="cost profile (default: the bundled one)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sim_speed.json"))
    args = ap.parse_args()

    profile = resolve_profile(args.profile)
    cost = LinearCostModel.from_profile(profile)
    capacity = int(cost.meta.get("kv_tokens", 262144))
    tr = traces.load(args.trace)
    from analysis.analytic import make_analytic_cost_model

    h100, h100_cap, _ = make_analytic_cost_model("h100-sxm", "llama-3.1-8b", 16)
    scenarios = {
        f"profile:{profile.name}": measure(tr, cost, capacity, args),
        "analytic:h100-sxm+llama-3.1-8b": measure(tr, h100, h100_cap, args),
    }
    out = {
        "benchmark": "sim_speed",
        "trace": tr.name,
        "requests": len(tr.requests),
        "repeat": args.repeat,
        "target_speedup": TARGET,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": __import__("os").cpu_count()},
        "scenarios": scenarios,
        "all_meet_target": all(r["meets_target"] for sc in scenarios.values() for r in sc.values()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


def measure(tr, cost, capacity, args) -> dict:
    print(f"-- {type(cost).__name__}, KV {capacity} tokens", flush=True)
    rows = {}
    for name in args.policies.split(","):
        walls, result = [], None
        for _ in range(args.repeat):
            gc.collect()
            t0 = time.perf_counter()
            res = run(tr.requests, make_policy(name), cost, kv_capacity=capacity, trace_name=tr.name)
            walls.append(time.perf_counter() - t0)
            result = res
        s = summarize(result)
        wall = statistics.median(walls)
        rows[name] = {
            "wall_s": wall,
            "wall_s_runs": walls,
            "makespan_s": s["makespan_s"],
            "speedup": s["makespan_s"] / wall,
            "requests_per_wall_s": len(tr.requests) / wall,
            "steps": s["steps"],
            "steps_per_wall_s": s["steps"] / wall,
            "finished": s["finished"],
            "meets_target": s["makespan_s"] / wall >= TARGET,
        }
        print(f"{name:16s} wall {wall:6.2f}s  makespan {s['makespan_s']:9.1f}s  "
              f"{rows[name]['speedup']:6.0f}x  {rows[name]['requests_per_wall_s']:7.0f} req/s  "
              f"{s['steps']} steps", flush=True)
    return rows


if __name__ == "__main__":
    main()
