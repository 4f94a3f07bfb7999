"""Capacity search speed: ``schedlab capacity`` as a user runs it, on the Azure 2023 conversation
hour, for 2 policies x 1, 2, 4 replicas on the H100 + Llama 3.1 8B analytic preset.

Each run is the installed command in a fresh process (``schedlab capacity ... -j WORKERS``, the
local process pool), timed from launch to exit (so loading the trace and the preset count); the
capacities, the search's points and its early stops come from the run's ``capacity.json``.
Medians over ``--repeat`` runs; ``--baseline DIR`` (another checkout, ``git worktree add DIR
REV``) runs that version's command right after each run, and records its times, its number of
simulations and whether it found the same capacities. Goal (issue 40): under 2 minutes of wall time on this 2-core
machine with the local executor.

``--executor ray --compare-workers 1,2`` runs the same search on a local Ray (started by each
command: its start-up counts) with 1 and with 2 workers, alternating (rounds of [1, 2]), and
reports each one's median and the speed-up (goal: at least 1.7x with 2). It also measures Ray's
per-task overhead in this process: ``--tasks`` one-request simulations as Ray tasks on one
worker, against the same jobs run here, (Ray - here) / tasks, medians over ``--repeat``.

    python bench/capacity.py [--repeat 3] [--baseline DIR] [--out bench/results/capacity.json]
    python bench/capacity.py --executor ray --compare-workers 1,2 [--repeat 2]   # -> capacity_ray.json

Results: ``bench/results/capacity.json``, ``bench/results/capacity_ray.json`` (``docs/capacity.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

GOAL_WALL_S = 120.0
GOAL_NEXT_WALL_S = 30.0  # the next goal (issue 55): with a faster simulation core, under 30 s
GOAL_RAY_SPEEDUP = 1.7
BIN = Path(sys.executable).parent


def one(args, out: Path, workers: int | None = None, tree: Path | None = None) -> tuple[float, dict]:
    """One ``schedlab capacity`` run, launch to exit: the installed command, or ``tree``'s (another
    checkout, imported from there in a fresh process)."""
    head, env = [str(BIN / "schedlab")], None
    if tree is not None:
        head, env = (
            [sys.executable, "-c", common.script_code(tree, "schedlab")],
            {**os.environ, "PYTHONPATH": str(tree)},
        )
    cmd = [
        *head,
        "capacity",
        "--policy",
        args.policies,
        "--replicas",
        args.replicas,
        "--router",
        args.router,
        "--hardware",
        args.hardware,
        "--model-config",
        args.model_config,
        "--trace",
        args.trace,
        "--slo",
        args.slo,
        "--attainment",
        str(args.attainment),
        "--tolerance",
        str(args.tolerance),
        "-j",
        str(workers or args.workers),
        "--executor",
        args.executor,
        "--out",
        str(out),
        "-f",
        "png",
        "-q",
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, cwd=tree)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"capacity failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return wall, json.loads((out / "capacity.json").read_text())


def command(args) -> dict:
    """The searched command's options, as the results file records them."""
    keys = ("policies", "replicas", "router", "hardware", "model_config", "trace", "slo", "attainment", "tolerance")
    return {**{k: getattr(args, k) for k in keys}, "executor": args.executor}


def goals(doc: dict) -> dict:
    """``doc`` (a local run's results) with the goals applied to its median wall time."""
    doc["goal_wall_s"] = GOAL_WALL_S
    doc["meets_goal"] = doc["wall_s"] < GOAL_WALL_S
    doc["goal_next_wall_s"] = GOAL_NEXT_WALL_S
    doc["meets_next_goal"] = doc["wall_s"] < GOAL_NEXT_WALL_S
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--policies", default="vllm,chunked-prefill")
    ap.add_argument("--replicas", default="1,2,4")
    ap.add_argument("--router", default="least-requests")
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--model-config", default="llama-3.1-8b")
    ap.add_argument("--trace", default="azure2023_conv")
    ap.add_argument("--slo", default="ttft=500,tpot=50")
    ap.add_argument("--attainment", type=float, default=0.99)
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    ap.add_argument("--compare-workers", default=None, help="e.g. 1,2: alternate these worker counts")
    ap.add_argument("--tasks", type=int, default=200, help="tasks of the per-task overhead measurement")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--summarize", type=Path, default=None, help="apply the goals to this results file again")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout (git worktree add DIR REV): its "
                    "command runs right after each run, the same search, and the file holds both")  # fmt: skip
    args = ap.parse_args()
    if args.summarize:
        doc = goals(json.loads(args.summarize.read_text()))
        common.write_json(doc, args.summarize)
        print(f"{doc['wall_s']:.1f} s: goal {doc['meets_goal']}, next goal {doc['meets_next_goal']}")
        return
    if args.compare_workers:
        return compare_workers(args)
    args.out = args.out or common.result_path("capacity")
    walls: list[float] = []
    base_walls: list[float] = []
    base = None
    result = None
    for k in range(args.repeat):
        with tempfile.TemporaryDirectory() as d:
            wall, res = one(args, Path(d) / "out")
        walls.append(wall)
        print(f"run {k + 1}: {wall:.1f} s", file=sys.stderr, flush=True)
        if args.baseline is not None:  # the version before, right after, in the same round
            with tempfile.TemporaryDirectory() as d:
                bwall, base = one(args, Path(d) / "out", tree=args.baseline.resolve())
            base_walls.append(bwall)
            print(f"run {k + 1} baseline: {bwall:.1f} s", file=sys.stderr, flush=True)
        if result is not None:  # the search is deterministic: every run finds the same
            assert [c["capacity_rps"] for c in res["configurations"]] == [
                c["capacity_rps"] for c in result["configurations"]
            ]
        result = res
    wall = statistics.median(walls)
    rows = result["configurations"]
    out = {
        "bench": "capacity",
        "what": f"schedlab capacity as a command (fresh process, launch to exit), {args.executor} executor; "
        "medians over runs",
        "command": {**command(args), "workers": args.workers},
        "wall_s": wall,
        "wall_s_runs": walls,
        "simulations": sum(int(r["runs"]) for r in rows),
        "early_stops": sum(int(r["early_stops"]) for r in rows),
        "configurations": rows,
        "repeat": args.repeat,
        "revision": common.git_rev(),
        "machine": common.machine(),
    }
    if base is not None:
        brows = base["configurations"]
        out["baseline"] = {
            "tree": str(args.baseline),
            "revision": common.git_rev(args.baseline),
            "wall_s": statistics.median(base_walls),
            "wall_s_runs": base_walls,
            "simulations": sum(int(r["runs"]) for r in brows),
            "early_stops": sum(int(r["early_stops"]) for r in brows),
            "capacities_rps": [r["capacity_rps"] for r in brows],
            "speedup": statistics.median(base_walls) / wall,
            "same_capacities": [r["capacity_rps"] for r in brows] == [r["capacity_rps"] for r in rows],
        }
    common.write_json(goals(out), args.out)
    print(f"capacity: {wall:.1f} s (goal < {GOAL_WALL_S:.0f} s, next < {GOAL_NEXT_WALL_S:.0f} s), {out['simulations']} simulations, "
          f"{out['early_stops']} stopped early")  # fmt: skip
    for r in rows:
        print(f"  {r['configuration']:<40} {r['capacity_rps']:8.2f} req/s  binding {r['binding']}")
    if "baseline" in out:
        b = out["baseline"]
        print(f"baseline {b['revision']}: {b['wall_s']:.1f} s, {b['simulations']} simulations; "
              f"{b['speedup']:.2f}x; same capacities: {b['same_capacities']}")  # fmt: skip


def task_overhead(n_tasks: int, repeat: int) -> dict:
    """Ray's cost per task: ``n_tasks`` tiny jobs (one one-request simulation each) on a local
    Ray with one worker, against the same jobs run in this process."""
    from schedlab import traces
    from schedlab.analysis.executors import run_jobs
    from schedlab.analysis.sweep import Job, _sweep_job
    from schedlab.api.profiles import linear_model

    cost, kv, _ = linear_model(None, None)
    tr = traces.Trace("one", "", [traces.Request("r", 0.0, 16, 4)])
    jobs = [Job(i, "vllm", {}, None, None) for i in range(n_tasks)]
    shared = (tr, cost, kv, None, None)
    t0 = time.perf_counter()
    run_jobs(_sweep_job, jobs[:1], shared, 1, executor="ray")  # start Ray, warm its worker
    start_s = time.perf_counter() - t0
    here, ray = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        want = run_jobs(_sweep_job, jobs, shared, 1)
        here.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = run_jobs(_sweep_job, jobs, shared, 1, executor="ray")
        ray.append(time.perf_counter() - t0)
        assert got == want
    return {
        "tasks": n_tasks,
        "ray_start_s": start_s,
        "in_process_s": statistics.median(here),
        "ray_s": statistics.median(ray),
        "per_task_overhead_ms": (statistics.median(ray) - statistics.median(here)) / n_tasks * 1e3,
        "what": "a local Ray with one worker, each task one one-request simulation: (Ray - in process) / tasks; "
        "ray_start_s: ray.init plus the first task (a worker process started)",
    }


def compare_workers(args) -> None:
    counts = [int(x) for x in args.compare_workers.split(",")]
    walls: dict[int, list[float]] = {n: [] for n in counts}
    result = None
    for k in range(args.repeat):
        for n in counts:
            with tempfile.TemporaryDirectory() as d:
                wall, res = one(args, Path(d) / "out", workers=n)
            walls[n].append(wall)
            print(f"round {k + 1}, {n} worker(s): {wall:.1f} s", file=sys.stderr, flush=True)
            if result is not None:
                assert res["configurations"] == result["configurations"]
            result = res
    med = {n: statistics.median(w) for n, w in walls.items()}
    speedup = med[counts[0]] / med[counts[-1]]
    overhead = task_overhead(args.tasks, args.repeat) if args.executor == "ray" else None
    out = {
        "bench": "capacity_workers",
        "what": f"schedlab capacity as a command (fresh process, launch to exit), {args.executor} executor with "
        f"{' and '.join(map(str, counts))} workers, alternating; medians over rounds",
        "command": command(args),
        "wall_s": {str(n): med[n] for n in counts},
        "wall_s_runs": {str(n): walls[n] for n in counts},
        "speedup": speedup,
        "goal_speedup": GOAL_RAY_SPEEDUP,
        "meets_goal": speedup >= GOAL_RAY_SPEEDUP,
        "task_overhead": overhead,
        "configurations": result["configurations"],
        "repeat": args.repeat,
        "revision": common.git_rev(),
        "machine": common.machine(),
    }
    common.write_json(out, args.out or common.result_path(f"capacity_{args.executor}"))
    print(f"capacity on {args.executor}: " + ", ".join(f"{n} worker(s) {med[n]:.1f} s" for n in counts)
          + f"; {speedup:.2f}x (goal >= {GOAL_RAY_SPEEDUP}x)")  # fmt: skip
    if overhead:
        print(f"per-task overhead {overhead['per_task_overhead_ms']:.2f} ms; Ray start {overhead['ray_start_s']:.1f} s")


if __name__ == "__main__":
    main()
