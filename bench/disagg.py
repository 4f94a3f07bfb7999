"""Disaggregated against co-located serving: capacity at equal GPU count, per SLO pair.

On the Azure 2023 conversation hour (the trace's own arrivals rescaled by ``capacity``'s
search), Llama 3.1 8B on H100s (the analytic ``h100-sxm`` preset, vLLM's engine model), the
``vllm`` policy everywhere: ``--gpus`` replicas co-located (each prefills and decodes) against
every prefill:decode split of the same count (1:N-1 ... N-1:1), the KV moved over the preset's
own link (NVLink 4) layer by layer. For each SLO pair (TTFT, TPOT), ``schedlab capacity``'s
search over the same cluster files; recorded: each configuration's capacity (req/s at 99 %
attainment) and per GPU (DistServe's goodput per GPU), and which configuration is best.

    python bench/disagg.py [--gpus 4] [--slos "ttft_ms=200,tpot_ms=100;ttft_ms=2000,tpot_ms=25"]
                           [--trace azure2023_conv] [--workers 2] [--out bench/results/disagg.json]

Results: ``bench/results/disagg.json`` (what it found: ``docs/cluster.md``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import common

import schedlab

GROUP = 'policy = "vllm"\nhardware = "h100-sxm"\nmodel_config = "llama-3.1-8b"\n'


def cluster_files(gpus: int, work: Path) -> list[Path]:
    files = []
    co = work / f"co-located-{gpus}.toml"
    co.write_text(f'router = "least-requests"\n\n[[group]]\ncount = {gpus}\n{GROUP}')
    files.append(co)
    for p in range(1, gpus):
        f = work / f"pd-{p}-{gpus - p}.toml"
        f.write_text(
            'router = "least-requests"\n\n[transfer]\nmode = "layerwise"\n\n'
            f'[[group]]\npool = "prefill"\ncount = {p}\n{GROUP}\n'
            f'[[group]]\npool = "decode"\ncount = {gpus - p}\n{GROUP}'
        )
        files.append(f)
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--slos", default="ttft_ms=200,tpot_ms=100;ttft_ms=2000,tpot_ms=25")
    ap.add_argument("--trace", default="azure2023_conv")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(common.result_path("disagg")))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="disagg-"))
    files = cluster_files(args.gpus, work)
    out: dict = {
        "benchmark": "disagg",
        "what": f"capacity of {args.gpus} H100s (Llama 3.1 8B, vllm policy) co-located vs every prefill:decode split, "
        "KV over NVLink 4 layer by layer; capacity at 99 % attainment of both SLOs",
        "trace": args.trace,
        "gpus": args.gpus,
        "rev": common.git_rev(),
        "machine": common.machine(),
        "slos": {},
    }
    t_all = time.perf_counter()
    for slo in args.slos.split(";"):
        t0 = time.perf_counter()
        table = schedlab.capacity(
            None, args.trace, slo=slo, clusters=[str(f) for f in files], workers=args.workers, block_size=16
        )
        rows = common.capacity_rows(
            table, ("capacity_rps", ("per_gpu_rps", "capacity_per_gpu_rps"), "binding", "first_failing_rps")
        )
        best = max(rows, key=lambda k: rows[k]["capacity_rps"] or 0.0)
        co = rows[f"co-located-{args.gpus}"]["capacity_rps"] or 0.0
        out["slos"][slo] = {
            "configurations": rows,
            "best": best,
            "best_over_co_located": (rows[best]["capacity_rps"] / co) if co else None,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        print(f"{slo}: best {best}", flush=True)
        for k, v in rows.items():
            print(f"  {k:<16} {v['capacity_rps']!s:>8} req/s  {v['per_gpu_rps']!s:>8} per GPU  binds {v['binding']}")
    out["wall_s"] = round(time.perf_counter() - t_all, 1)
    print(f"wrote {common.write_json(out, args.out)}")


if __name__ == "__main__":
    main()
