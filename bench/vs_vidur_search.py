"""Capacity search side by side with Vidur-Search, in one run on this machine.

The space both can express: Llama-2-7B fp16 on one A100-80GB per replica, 1, 2 and 4 replicas
behind round-robin, Vidur's Sarathi scheduler (chunk 512, batch cap 128, KV 7,424 blocks of 16
tokens, recompute preemption; ``vs_vidur.SarathiVidur`` on schedlab's side), the Azure 2023
conversation hour as ``bench/vs_vidur.py`` prepares it for both (prompts clipped to prompt +
output <= 4096, arrivals time-scaled to each rate tried), and one SLO: the 99th percentile of
TTFT at most 2 s.

- **schedlab**: ``schedlab capacity --policy vs_vidur:SarathiVidur --replicas 1,2,4 --router
  round-robin --hardware a100-80gb-sxm --model-config llama-2-7b --slo ttft_ms=2000 --attainment
  0.99 --tolerance 0.025 --start-rps 2`` (2 workers), a fresh process timed launch to exit.
- **Vidur-Search** (``vidur.config_optimizer``, the vidur==0.0.26 wheel, on Ray with 2 slots),
  through ``bench/peers/vidur_search/vidur_search.py``: its own binary search (start 2 req/s per
  replica, granularity 2.5 %), run as published except for what it needs to run here at all and
  to test the same SLO on the same arrivals (each patch and why: that file's docstring and
  ``vidur_search_patch.py``): the metric is TTFT (``prefill_e2e_time``) instead of scheduling
  delay, and each probe replays the hour time-scaled to its rate (``--arrivals trace``) instead
  of Poisson arrivals over shuffled lengths. Timed launch to exit.

The two searches' stopping rules differ slightly (schedlab: (hi - lo) / lo <= 2.5 %; Vidur:
|hi - lo| < 2.5 % of the last rate tried) and so do their pass tests: schedlab counts a request
that never finished as a miss, Vidur's percentile is over completed requests (with no time
limit every request completes). Both pass iff 99 % of the requests have TTFT <= 2 s.

Vidur needs its venv and data prepared as ``bench/vs_vidur.py`` says (``--vidur-python``, a
``--vidur-cache`` whose predictors are trained, ``--vidur-lengths`` the repository's
``data/processed_traces/splitwise_conv.csv``, ``--vidur-replay`` the hour in the wheel's trace
format), plus ``ray`` in that venv.

    python bench/vs_vidur_search.py --vidur-python /tmp/vidurenv/bin/python [--repeat 1]

Results: ``bench/results/vs_vidur_search.json`` (``docs/capacity.md``).
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

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
REPLICAS = (1, 2, 4)
SLO_S = 2.0
QUANTILE = 0.99
GRANULARITY = 0.025
START_PER_REPLICA = 2.0
GOAL_SPEEDUP = 10.0
GOAL_WITHIN = 0.15

YAML = """\
clusters:
{clusters}
schedulers:
  - scheduler: sarathi
    chunk_size: 512
traces:
  - name: azure_conv
    trace_file: {lengths}
    max_seq_len: 4096
    num_requests: 19366
    start_qps: {start}
batch_sizes: [128]
tp_dimensions: [1]
pp_dimensions: [1]
models:
  - name: llama-2-7b-hf
    identifier: meta-llama/Llama-2-7b-hf
"""


def clipped_trace(path: Path) -> None:
    """The hour as vs_vidur.py gives it to schedlab (Vidur's clip, output + 1)."""
    sys.path.insert(0, str(HERE))
    import vs_vidur

    from schedlab.traces.loaders import save_json

    save_json(vs_vidur.workload()[0], str(path))


def run_schedlab(trace: Path, out: Path, workers: int) -> tuple[float, dict[int, float | None]]:
    cmd = [
        str(BIN / "schedlab"),
        "capacity",
        "--policy",
        "vs_vidur:SarathiVidur",
        "--trace",
        str(trace),
        "--hardware",
        "a100-80gb-sxm",
        "--model-config",
        "llama-2-7b",
        "--kv-tokens",
        "118784",
        "--block-size",
        "16",
        "--replicas",
        ",".join(map(str, REPLICAS)),
        "--router",
        "round-robin",
        "--slo",
        f"ttft_ms={SLO_S * 1e3:g}",
        "--attainment",
        str(QUANTILE),
        "--tolerance",
        str(GRANULARITY),
        "--start-rps",
        str(START_PER_REPLICA),
        "-j",
        str(workers),
        "--out",
        str(out),
        "-f",
        "png",
        "-q",
    ]
    env = {**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"schedlab capacity failed: {p.stderr.strip()[-2000:]}")
    rows = json.loads((out / "capacity.json").read_text())["configurations"]
    return wall, {int(r["replicas"]): r["capacity_rps"] for r in rows}


def run_vidur(args, work: Path) -> tuple[float, dict[int, float | None], dict]:
    clusters = "\n".join(f"  - device: a100\n    num_gpus: {n}\n    gpus_per_node: 4" for n in REPLICAS)
    cfg = work / "space.yml"
    cfg.write_text(YAML.format(clusters=clusters, lengths=args.vidur_lengths, start=START_PER_REPLICA))
    out = work / f"vidur-{time.time_ns()}"
    cmd = [
        args.vidur_python,
        str(HERE / "peers" / "vidur_search" / "vidur_search.py"),
        "--metric",
        "ttft",
        "--arrivals",
        "trace",
        "--replay-trace",
        args.vidur_replay,
        "--start-qps-per-replica",
        "--slots",
        str(args.workers),
        "--config-path",
        str(cfg),
        "--output-dir",
        str(out),
        "--cache-dir",
        args.vidur_cache,
        "--scheduling-delay-slo-value",
        str(SLO_S),
        "--scheduling-delay-slo-quantile",
        str(QUANTILE),
        "--min-search-granularity",
        str(GRANULARITY * 100),
        "--max-iterations",
        "20",
        "--time-limit",
        "0",
        "--skip-cache-warmup",
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    wall = time.perf_counter() - t0
    (work / "vidur_search.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise SystemExit(f"Vidur-Search failed ({p.returncode}): {(p.stdout + p.stderr).strip()[-3000:]}")
    res = json.loads((out / "results.json").read_text())
    caps = {int(r["cluster_config_num_replicas"]): r["max_qps_under_sla"] for r in res["results"]}
    probes = sum(1 for _ in (out / "runs").glob("*/*/*/request_metrics.csv"))
    return wall, caps, {"probes": probes, "search_wall_s": res.get("wall_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="rounds of [schedlab, Vidur-Search]; medians")
    ap.add_argument("--workers", type=int, default=2, help="schedlab's workers and Vidur-Search's slots")
    ap.add_argument("--vidur-python", default=os.environ.get("VIDUR_PYTHON"))
    ap.add_argument("--vidur-cache", default=os.environ.get("VIDUR_CACHE", "/tmp/vidurrun/vidur_cache"))
    ap.add_argument("--vidur-lengths", default="/tmp/vidurrepo/data/processed_traces/splitwise_conv.csv")
    ap.add_argument("--vidur-replay", default="/tmp/vidurrun/traces/splitwise_conv_first19366.csv")
    ap.add_argument("--out", default=str(common.result_path("vs_vidur_search")))
    args = ap.parse_args()
    if not args.vidur_python:
        raise SystemExit("give --vidur-python (or $VIDUR_PYTHON): a venv with vidur==0.0.26 and ray")
    ours_w, vidur_w = [], []
    ours_caps = vidur_caps = None
    vidur_info: dict = {}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        trace = work / "azure2023_conv_vidurclip.json"
        clipped_trace(trace)
        for k in range(args.repeat):
            w, caps = run_schedlab(trace, work / f"schedlab-{k}", args.workers)
            ours_w.append(w)
            assert ours_caps in (None, caps)
            ours_caps = caps
            print(f"round {k + 1}: schedlab {w:.1f} s {caps}", file=sys.stderr, flush=True)
            w, caps, vidur_info = run_vidur(args, work)
            vidur_w.append(w)
            vidur_caps = caps
            print(f"round {k + 1}: Vidur-Search {w:.1f} s {caps}", file=sys.stderr, flush=True)
    ours, theirs = statistics.median(ours_w), statistics.median(vidur_w)
    rows = []
    for n in REPLICAS:
        a, b = ours_caps.get(n), vidur_caps.get(n)
        rows.append(
            {
                "replicas": n,
                "schedlab_rps": a,
                "vidur_rps": b,
                "ratio": (a / b) if a and b else None,
            }
        )
    within = [abs(r["ratio"] - 1) <= GOAL_WITHIN for r in rows if r["ratio"] is not None]
    out = {
        "bench": "vs_vidur_search",
        "what": "capacity searches side by side in one run, each a fresh process timed launch to exit; medians",
        "space": {
            "model": "llama-2-7b fp16",
            "hardware": "a100-80gb-sxm, one per replica",
            "replicas": list(REPLICAS),
            "router": "round-robin",
            "schedule": "Vidur's Sarathi: chunk 512, batch cap 128, KV 7424 blocks of 16, recompute preemption",
            "trace": "azure2023_conv, Vidur's clip (prompt + output <= 4096), arrivals time-scaled",
            "slo": f"P{QUANTILE * 100:g} TTFT <= {SLO_S:g} s",
            "granularity": GRANULARITY,
            "start_rps_per_replica": START_PER_REPLICA,
            "workers": args.workers,
        },
        "schedlab": {"wall_s": ours, "wall_s_runs": ours_w, "executor": "local"},
        "vidur": {"wall_s": theirs, "wall_s_runs": vidur_w, "version": "vidur 0.0.26 config_optimizer", **vidur_info},
        "capacities": rows,
        "speedup": theirs / ours,
        "goal": {"speedup": GOAL_SPEEDUP, "within": GOAL_WITHIN},
        "meets_speed_goal": theirs / ours >= GOAL_SPEEDUP,
        "capacities_within_goal": bool(within) and all(within),
        "repeat": args.repeat,
        "revision": common.git_rev(),
        "machine": common.machine(),
    }
    common.write_json(out, args.out)
    print(f"schedlab {ours:.1f} s, Vidur-Search {theirs:.1f} s: {theirs / ours:.1f}x")
    for r in rows:
        print(f"  x{r['replicas']}: schedlab {r['schedlab_rps']} req/s, Vidur {r['vidur_rps']} req/s")


if __name__ == "__main__":
    main()
