"""Digests of what ``simulate`` writes, to check that a change leaves the outputs byte for byte.

A refactor or a speed-up of the simulator must not move a single byte of a run's files. This
runs a fixed set of ``simulate --out`` commands in a checkout (fresh processes, as a user runs
them) and records the SHA-256 of each run's ``summary.json`` and ``requests.csv``:

- every bundled policy on ``mixed.json`` and on the Azure 2023 conversation hour;
- a 4-replica cluster (``--replicas 4 --router power-of-two --router-delay 0.05``, one replica
  failing at 600 s) on the Azure hour's requests at 20 req/s (Poisson, seed 0);
- the bundled heterogeneous cluster file (``--cluster h100-a100``) on the Azure hour;
- a prefill/decode cluster file (one prefill H100, two decode H100s, Llama-3.1-8B) on mixed.json.

``--tree DIR`` digests another checkout (``git worktree add /tmp/base REV``); ``--against
FILE`` compares with a digest file written before and exits 1 naming every file that moved.

    python bench/outputs_digest.py --out /tmp/before.json [--tree /tmp/base]
    python bench/outputs_digest.py --against /tmp/before.json

Analytic hardware presets read the serving-kernel tables named by ``SCHEDLAB_KERNEL_DATA``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import common

PD_TOML = """router = "least-requests"

[transfer]
mode = "layerwise"

[[group]]
count = 1
policy = "vllm"
pool = "prefill"
hardware = "h100-sxm"
model_config = "llama-3.1-8b"

[[group]]
count = 2
policy = "vllm"
pool = "decode"
hardware = "h100-sxm"
model_config = "llama-3.1-8b"
"""

FILES = ("summary.json", "requests.csv")


def cases(policies: list[str], pd_file: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for trace in ("mixed", "azure2023_conv"):
        for p in policies:
            out[f"{p}@{trace}"] = ["--policy", p, "--trace", trace]
    out["cluster4@azure2023_conv"] = [
        "--policy", "vllm", "--trace", "azure2023_conv", "--request-rate", "20", "--replicas", "4",
        "--router", "power-of-two", "--router-delay", "0.05", "--fail", "1@600",
    ]  # fmt: skip
    out["h100-a100@azure2023_conv"] = ["--cluster", "h100-a100", "--trace", "azure2023_conv"]
    out["prefill-decode@mixed"] = ["--cluster", str(pd_file), "--trace", "mixed", "--block-size", "16"]
    return out


def digest(tree: Path) -> dict[str, dict[str, str]]:
    sys.path.insert(0, str(Path(__file__).parent))
    from sim_speed import _policies

    code = common.script_code(tree, "simulate")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pd = Path(tmp) / "pd.toml"
        pd.write_text(PD_TOML)
        for name, args in cases(sorted(_policies(tree)), pd).items():
            run_dir = Path(tmp) / name.replace("@", "_")
            proc = subprocess.run(
                [sys.executable, "-c", code, *args, "--out", str(run_dir), "-q"],
                env=env,
                capture_output=True,
                text=True,
                cwd=tmp,
            )
            if proc.returncode != 0:
                raise SystemExit(f"{name}: simulate failed in {tree}: {proc.stderr.strip()[-500:]}")
            out[name] = {f: hashlib.sha256((run_dir / f).read_bytes()).hexdigest() for f in FILES}
            print(f"{name}: {out[name]['summary.json'][:12]} {out[name]['requests.csv'][:12]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=common.ROOT, help="the checkout to digest (default: this one)")
    ap.add_argument("--out", type=Path, help="write the digests here")
    ap.add_argument("--against", type=Path, help="compare with digests written before; exit 1 if any file moved")
    args = ap.parse_args()
    got = digest(args.tree.resolve())
    if args.out:
        common.write_json(got, args.out)
    if args.against:
        before = {k: v for k, v in json.loads(args.against.read_text()).items() if k != "provenance"}
        moved = [
            f"{case}/{f}"
            for case in sorted(set(before) | set(got))
            for f in FILES
            if before.get(case, {}).get(f) != got.get(case, {}).get(f)
        ]
        if moved:
            raise SystemExit("moved: " + ", ".join(moved))
        print(f"all {len(got)} runs' {', '.join(FILES)} byte-identical")


if __name__ == "__main__":
    main()
