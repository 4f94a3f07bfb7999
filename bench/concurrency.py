"""Latency against client concurrency under KV pressure: vllm, unified and mlx-default.

Closed-loop clients (``vllm bench serve --max-concurrency C`` with ``--request-rate inf``:
every request issued at once, at most C in flight) in front of one simulated replica with
the bundled profile (the ``tiny`` model on this 2-core CPU) and a small KV cache, so that the
policies differ in how they deal with it: ``vllm`` admits on the first chunk's blocks and
preempts (recompute) the latest admitted when decode runs out of blocks; ``unified`` and
``mlx-default`` reserve each request's whole footprint at admission and never preempt.

    python bench/concurrency.py            # runs the sweep, writes bench/results/concurrency.json
    python bench/concurrency.py --table    # the table, from that JSON
"""

from __future__ import annotations

import argparse
import json
import time

import common

RESULT = common.result_path("concurrency")
TRACE = "random:n=300,input_len=512,output_len=256,range_ratio=0.5"
POLICIES = ["vllm", "unified", "mlx-default"]
CONCURRENCY = [1, 4, 8, 16, 32, 64]
KV_TOKENS = 12_288
BLOCK_SIZE = 16


def measure(workers: int | None) -> dict:
    from schedlab import traces
    from schedlab.analysis.sweep import sweep
    from schedlab.sim.cost import LinearCostModel
    from schedlab.sim.profiles import resolve_profile

    profile = resolve_profile(None)
    cm = LinearCostModel.from_profile(profile)
    tr = traces.load(TRACE, seed=0)
    t0 = time.perf_counter()
    rows = sweep(
        tr, POLICIES, None, cm, KV_TOKENS, concurrency=CONCURRENCY, settings={"block_size": BLOCK_SIZE}, workers=workers
    )
    wall = time.perf_counter() - t0
    bad = [r for r in rows if r.get("error") or r["finished"] != len(tr)]
    if bad:
        raise SystemExit(f"a run did not finish every request: {bad[0]}")
    return {
        "trace": TRACE,
        "seed": 0,
        "requests": len(tr),
        "mean_prompt_tokens": sum(r.prompt_tokens for r in tr.requests) / len(tr),
        "mean_output_tokens": sum(r.output_tokens for r in tr.requests) / len(tr),
        "clients": "all requests issued at t=0 (request rate inf), at most C in flight",
        "profile": profile.name,
        "kv_tokens": KV_TOKENS,
        "block_size": BLOCK_SIZE,
        "policies": POLICIES,
        "concurrency": CONCURRENCY,
        "wall_s": round(wall, 2),
        "rev": common.git_rev(),
        "machine": common.machine(),
        "rows": rows,
    }


def table(data: dict) -> str:
    head = (
        "| policy | clients | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | ITL p99 (ms) | "
        "throughput (tok/s) | preemptions | recomputed tokens |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(
            f"| {r['policy']} | {r['max_concurrency']} | {r['ttft_p50_ms'] / 1e3:.2f} | "
            f"{r['ttft_p99_ms'] / 1e3:.2f} | {r['tpot_p50_ms']:.1f} | {r['itl_p99_ms']:.0f} | "
            f"{r['output_throughput_tok_s']:.0f} | {r['preemptions']} | {r['recomputed_tokens']:,} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="print the table from the recorded JSON")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(RESULT.read_text())))
        return
    data = measure(args.workers)
    common.write_json(data, RESULT)
    print(table(data))
    print(f"\nwrote {RESULT} ({data['wall_s']} s)")


if __name__ == "__main__":
    main()
