"""Cluster simulation speed: the Azure 2023 conversation hour on N replicas, its rate scaled by N.

The hour's requests arrive N times as fast (every arrival time divided by N), so each of N
replicas behind the router sees about the load one replica sees in the plain hour; a run
simulates the same requests on N = 1, 4, 16, 64 replicas (``least-requests``, ``unified``, the
bundled measured profile). Each run is a fresh process (``sim.run`` of the deployment, the loop
alone: the trace is loaded and scaled before the clock starts), so its peak memory is its own.
Reported per N, medians over ``--repeat`` rounds (the Ns interleaved in each round: this
machine drifts): wall seconds, simulated requests per wall second, the simulated makespan, peak
resident memory. Goal: at least 10,000 simulated requests per second at every N.

``--baseline DIR``: a checkout of another version (``git worktree add /tmp/old REV``) runs the
same Ns in the same rounds, each run right after this one's (A, B, A, B: this machine drifts by
up to 35 % within minutes); per N its median wall time and the ratio, and whether both made the
same run (its makespan and step count).

    python bench/cluster.py [--repeat 3] [--ns 1,4,16,64] [--baseline /tmp/old] [--out bench/results/cluster.json]

Results: ``bench/results/cluster.json`` (``docs/cluster.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import common

GOAL_REQ_PER_S = 10_000

# one run, in a fresh process: prints a JSON line; with "profile" (argv[5]) the run is made under
# cProfile and the line says where its time went, by function and by part of the simulator
CHILD = r"""
import dataclasses, json, os, resource, sys, time
from collections import defaultdict
import schedlab
from schedlab import traces
from schedlab.policies import make_policy
from schedlab.routers import make_router
from schedlab.sim import Deployment, Group, run
from schedlab.sim.cost import DEFAULT_KV_TOKENS, LinearCostModel
from schedlab.sim.profiles import resolve_profile

n, trace, policy, router = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
profiled = sys.argv[5:] == ["profile"]
profile = resolve_profile(None)
cost = LinearCostModel.from_profile(profile)
capacity = int(cost.meta.get('kv_tokens', DEFAULT_KV_TOKENS))
tr = traces.load(trace)
reqs = [dataclasses.replace(r, arrival_s=r.arrival_s / n) for r in tr.requests]
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if profiled:
    import cProfile, pstats
    prof = cProfile.Profile()
    prof.enable()
t0 = time.perf_counter()
group = Group(tuple(make_policy(policy) for _ in range(n)), cost, capacity)
res = run(Deployment((group,), make_router(router)), reqs, trace_name=tr.name, record_passes=False)
wall = time.perf_counter() - t0
assert res.error is None, res.error
if not profiled:
    done = [r for r in res.requests if r.finish_s is not None]
    print(json.dumps({
        "wall_s": wall,
        "requests": len(res.requests),
        "finished": len(done),
        "makespan_s": max(r.finish_s for r in done),
        "steps": len(res.steps),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_run_mb": rss0 / 1024,
    }))
    sys.exit(0)
prof.disable()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(schedlab.__file__)))
PARTS = (("state machine", "/sim/state.py"), ("replica loop", "/sim/loop.py"), ("clock", "/sim/clock.py"),
         ("policy", "/policies/"), ("cost model", "/sim/cost.py"), ("backend", "/sim/backend.py"),
         ("cluster and router", "/sim/cluster.py"), ("cluster and router", "/routers/"),
         ("arrivals", "/sim/sources.py"), ("SimPy", "/simpy/"))
stats = pstats.Stats(prof).stats
total = sum(v[2] for v in stats.values())
funcs, parts = [], defaultdict(float)
for (path, line, name), (cc, nc, tt, ct, callers) in stats.items():
    part = next((p for p, key in PARTS if key in path), "built-ins and other")
    parts[part] += tt
    where = os.path.relpath(path, ROOT) if path.startswith(ROOT) else path.split("site-packages/")[-1]
    funcs.append((tt, nc, where + ":" + name, part))
funcs.sort(reverse=True)
print(json.dumps({
    "profiled_s": total, "steps": len(res.steps),
    "parts": {k: v / total for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
    "top": [{"function": f, "part": part, "share": tt / total, "calls": nc, "us_per_call": 1e6 * tt / nc}
            for tt, nc, f, part in funcs[:12]],
}))
"""


def one(n: int, trace: str, policy: str, router: str, profiled: bool = False, tree: Path | None = None) -> dict:
    """One run in a fresh process, of this checkout or of ``tree``'s."""
    argv = [sys.executable, "-c", CHILD, str(n), trace, policy, router] + (["profile"] if profiled else [])
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree is not None else None
    # (``-c`` puts the working directory first on the path: the tree's own package is imported)
    p = subprocess.run(argv, capture_output=True, text=True, check=False, env=env, cwd=tree)
    if p.returncode != 0:
        raise SystemExit(f"cluster run N={n} failed: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ns", default="1,4,16,64")
    ap.add_argument("--trace", default="azure2023_conv")
    ap.add_argument("--policy", default="unified")
    ap.add_argument("--router", default="least-requests")
    ap.add_argument("--profile-n", type=int, default=4, help="N of the one run made under cProfile (0: none)")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout, run alongside in the same rounds")
    ap.add_argument("--out", type=Path, default=common.result_path("cluster"))
    args = ap.parse_args()
    ns = [int(x) for x in args.ns.split(",")]
    base = args.baseline.resolve() if args.baseline else None
    runs: dict[int, list[dict]] = {n: [] for n in ns}
    base_runs: dict[int, list[dict]] = {n: [] for n in ns}
    for k in range(args.repeat):
        for n in ns:
            r = one(n, args.trace, args.policy, args.router)
            runs[n].append(r)
            b = one(n, args.trace, args.policy, args.router, tree=base) if base else None
            if b is not None:
                base_runs[n].append(b)
            print(
                f"round {k + 1} N={n}: {r['wall_s']:.2f} s, {r['requests'] / r['wall_s']:,.0f} req/s, "
                f"peak {r['peak_rss_mb']:.0f} MB" + (f"; baseline {b['wall_s']:.2f} s" if b else ""),
                file=sys.stderr,
                flush=True,
            )
    rows = []
    for n in ns:
        rs = runs[n]
        wall = statistics.median(r["wall_s"] for r in rs)
        rows.append(
            {
                "replicas": n,
                "requests": rs[0]["requests"],
                "finished": rs[0]["finished"],
                "steps": rs[0]["steps"],
                "makespan_s": rs[0]["makespan_s"],
                "wall_s": wall,
                "wall_s_runs": [r["wall_s"] for r in rs],
                "req_per_s": rs[0]["requests"] / wall,
                "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs),
                "rss_before_run_mb": statistics.median(r["rss_before_run_mb"] for r in rs),
                "meets_goal": rs[0]["requests"] / wall >= GOAL_REQ_PER_S,
            }
        )
        if base:
            bs = base_runs[n]
            b_wall = statistics.median(r["wall_s"] for r in bs)
            rows[-1]["baseline"] = {
                "wall_s": b_wall,
                "wall_s_runs": [r["wall_s"] for r in bs],
                "req_per_s": bs[0]["requests"] / b_wall,
                "speedup": b_wall / wall,  # the baseline's median wall over this one's
                "same_run": all(
                    (r["makespan_s"], r["steps"], r["finished"])
                    == (rs[0]["makespan_s"], rs[0]["steps"], rs[0]["finished"])
                    for r in bs
                ),
            }
    profile = None
    if args.profile_n:  # (after the timed rounds: cProfile slows the run it watches several times over)
        profile = {
            "replicas": args.profile_n,
            **one(args.profile_n, args.trace, args.policy, args.router, profiled=True),
        }
    out = {
        "bench": "cluster",
        "what": "the trace's arrival times divided by N on N replicas; wall seconds of sim.run of the deployment alone "
        "(record_passes=False), medians over rounds, N interleaved within each round",
        "trace": args.trace,
        "policy": args.policy,
        "router": args.router,
        "cost": "bundled measured profile",
        "goal_req_per_s": GOAL_REQ_PER_S,
        "repeat": args.repeat,
        "revision": common.git_rev(),
        "baseline_revision": common.git_rev(base) if base else None,
        "machine": common.machine(),
        "rows": rows,
        # where the time goes: cProfile's own time per function (its overhead inflates small calls),
        # as shares of the profiled run, and summed by part of the simulator
        "profile": profile,
    }
    common.write_json(out, args.out)
    for row in rows:
        print(
            f"N={row['replicas']:>3}: {row['wall_s']:6.2f} s  {row['req_per_s']:>9,.0f} req/s  "
            f"makespan {row['makespan_s']:.0f} s  peak {row['peak_rss_mb']:.0f} MB"
            + (f"  baseline {row['baseline']['wall_s']:.2f} s ({row['baseline']['speedup']:.2f}x)" if base else "")
        )


if __name__ == "__main__":
    main()
