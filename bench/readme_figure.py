"""The README's picture: every bundled policy's TTFT and ITL on the bundled mixed trace, drawn by
``schedlab plot``.

Runs ``simulate --policy P --trace mixed.json --out DIR/P -q`` for every policy in
``schedlab.policies.POLICIES`` (default options, the bundled profile: the runs of
``bench/policies.py``), then ``schedlab plot DIR/* --format png`` over all of them, and keeps
its ``ttft_cdf.png`` and ``itl_cdf.png`` as ``docs/figures/mixed_ttft_cdf.png`` and
``docs/figures/mixed_itl_cdf.png``. Records the numbers the legends show (each run's TTFT and ITL
p50 and p99, from its ``summary.json``) and each picture's SHA-256 in
``bench/results/readme_figure.json``. Deterministic (simulation only): the same checkout and
matplotlib give the same pictures. Seconds of CPU.

    python bench/readme_figure.py [--trace mixed.json] [--figures docs/figures] [--out bench/results/readme_figure.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import common
from schedlab.policies import POLICIES

BIN = Path(sys.executable).parent
KEPT = ("ttft_cdf", "itl_cdf")  # the plot command's file stems the README shows
METRICS = ("ttft_ms", "itl_ms")


def run(*argv: str) -> None:
    proc = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)}: {proc.stderr.strip()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="mixed.json")
    ap.add_argument("--figures", type=Path, default=common.ROOT / "docs" / "figures")
    ap.add_argument("--out", default=str(common.result_path("readme_figure")))
    args = ap.parse_args()
    stem = Path(args.trace).stem
    policies, figures = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = [Path(tmp) / p for p in POLICIES]
        for p, d in zip(POLICIES, runs):
            run("simulate", "--policy", p, "--trace", args.trace, "--out", str(d), "-q")
            summary = json.loads((d / "summary.json").read_text())
            policies[p] = {m: {q: summary[m][q] for q in ("p50", "p99")} for m in METRICS}
        plots = Path(tmp) / "plots"
        run("schedlab", "plot", *map(str, runs), "--out", str(plots), "--format", "png", "-q")
        args.figures.mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            dest = args.figures / f"{stem}_{name}.png"
            shutil.copyfile(plots / f"{name}.png", dest)
            where = dest.resolve().relative_to(common.ROOT) if dest.resolve().is_relative_to(common.ROOT) else dest
            figures[name] = {"path": str(where), "sha256": hashlib.sha256(dest.read_bytes()).hexdigest()}
    data = {
        "bench": "readme_figure",
        "what": "every bundled policy simulated on the trace (default options, the bundled profile), "
        "drawn by `schedlab plot` over their run directories: the TTFT and ITL CDFs README.md shows; "
        "per policy the p50 and p99 the legends show (summary.json's)",
        "trace": args.trace,
        "commands": [
            f"simulate --policy P --trace {args.trace} --out DIR/P -q",
            "schedlab plot DIR/P ... --out PLOTS --format png -q",
        ],
        "policies": policies,
        "figures": figures,
    }
    common.write_json(data, args.out)
    for f in figures.values():
        print(f"wrote {f['path']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
