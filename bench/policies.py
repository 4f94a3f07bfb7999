"""Every bundled policy on the bundled mixed trace: the policy table, from the simulator as it is.

Runs ``simulate --policy P --trace mixed.json --out DIR -q`` for every policy in
``schedlab.policies.POLICIES`` (default options, the bundled profile: the ``tiny`` model on a
2-core CPU) and records each run's ``summary.json`` exactly as written, and the share of its
makespan the replica spent in steps (``steps.parquet``: the sum of end - start over the
makespan). Deterministic: the same checkout gives the same file but for its provenance's time.
Prints the table as markdown, each figure with its marker (``docs/benchmarks.md``). Seconds of CPU.

    python bench/policies.py [--trace mixed.json] [--out bench/results/policies.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import common
import pandas as pd
from schedlab.policies import POLICIES

SIMULATE = Path(sys.executable).parent / "simulate"

#: the table's columns: header, key path in the results file, scale, decimals
COLUMNS = (
    ("TTFT p50 s", ("summaries", "{p}", "ttft_ms", "p50"), 0.001, 2),
    ("TTFT p99 s", ("summaries", "{p}", "ttft_ms", "p99"), 0.001, 2),
    ("ITL p50 ms", ("summaries", "{p}", "itl_ms", "p50"), 1, 1),
    ("ITL p99 ms", ("summaries", "{p}", "itl_ms", "p99"), 1, 1),
    ("TPOT p50 ms", ("summaries", "{p}", "tpot_ms", "p50"), 1, 1),
    ("min decode rate tok/s", ("summaries", "{p}", "decode_rate_tok_s", "min"), 1, 1),
    ("throughput tok/s", ("summaries", "{p}", "output_throughput_tok_s"), 1, 1),
    ("makespan s", ("summaries", "{p}", "makespan_s"), 1, 0),
    ("busy %", ("busy", "{p}"), 100, 1),
)


def simulate(policy: str, trace: str) -> tuple[dict, float, str]:
    """One policy's summary.json, its busy share and the profile it ran with."""
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [str(SIMULATE), "--policy", policy, "--trace", trace, "--out", out, "-q"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode:
            raise SystemExit(f"simulate --policy {policy} --trace {trace}: {proc.stderr.strip()}")
        summary = json.loads((Path(out) / "summary.json").read_text())
        steps = pd.read_parquet(Path(out) / "steps.parquet", columns=["start_s", "end_s"])
        profile = json.loads((Path(out) / "meta.json").read_text())["profile"]
    busy = float((steps["end_s"] - steps["start_s"]).sum()) / summary["makespan_s"]
    return summary, busy, Path(profile).name


def table(data: dict, file: str = "policies.json") -> str:
    """The markdown table, every cell a figure with its marker (``FILE:key/path *scale``)."""
    lines = ["| policy | " + " | ".join(h for h, *_ in COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for p in data["summaries"]:
        cells = []
        for _, path, scale, dec in COLUMNS:
            keys = [k.format(p=p) for k in path]
            v = common.value(data, keys)
            marker = f"<!-- fig {file}:{'/'.join(keys)}" + (f" *{scale}" if scale != 1 else "") + " -->"
            cells.append("-" if v is None else f"{v * scale:.{dec}f}{marker}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="mixed.json")
    ap.add_argument("--out", default=str(common.result_path("policies")))
    args = ap.parse_args()
    summaries, busy, profiles = {}, {}, set()
    for p in POLICIES:
        summaries[p], busy[p], prof = simulate(p, args.trace)
        profiles.add(prof)
    data = {
        "benchmark": "policies",
        "trace": args.trace,
        "profile": ",".join(sorted(profiles)),
        "schedlab_commit": common.git_rev(),
        "summaries": summaries,
        "busy": busy,
    }
    common.write_json(data, args.out)
    print(table(data, Path(args.out).name))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
