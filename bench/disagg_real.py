"""Prefill and decode apart, for real, against its simulation: ``run-real --prefill 1 --decode 1``
(two replica processes of SmolLM2-135M, one core each; each request's first token on the prefill
replica, its prompt's KV through a shared-memory file to the decode replica, the rest there) on
the same trace several times, then ``validate --served`` on the runs: the simulation of the same
pools (``sim.disagg``) with the link the front measured before serving, against the real runs,
with the real runs' own spread (each run held out against the others' median). Also recorded, per
run: every request answered once, the KV moved (tokens, bytes), and what the decode replica
computed of the prompts (nothing: mlx-lm's hand-off makes the first token a decode row's input).

    python bench/disagg_real.py [--rounds 3] [--policy mlx-default]

Results: the ``real`` key of ``bench/results/disagg.json`` (``docs/cluster.md``); the other keys
are ``bench/disagg.py``'s and are kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

TRACE = "sonnet:n=24,input_len=128,output_len=32,prefix_len=32,rate=0.6"


def one_run(d: Path) -> dict:
    """What a run directory says of the hand-off."""
    served = json.loads((d / "trace.json").read_text())["requests"]
    cluster = json.loads((d / "cluster.json").read_text())
    pre, dec = (json.loads((d / f"replica-{i}" / "meta.json").read_text())["engine"] for i in (0, 1))
    moved = [r for r in served if "kv" in r]
    return {
        "requests": len(served),
        "distinct_ids": len({r["id"] for r in served}),
        "finished": cluster["summary"]["finished"],
        "kv_handed_on": len(moved),
        "kv_tokens": sum(r["kv"]["tokens"] for r in moved),
        "kv_bytes": sum(r["kv"]["bytes"] for r in moved),
        "prefill_exported_tokens": pre["kv_exported_tokens"],
        "decode_imported_tokens": dec["kv_imported_tokens"],
        "decode_prefill_tokens": dec["prefill_tokens"],
        # medians over the requests handed on: the prefill engine writing the file; from the first token
        # to the front hearing of it; from then to the decode replica taking it; their sum
        **{
            f"{key}_median": statistics.median(r["kv"][key] for r in moved) if moved else None
            for key in ("export_s", "notice_s", "handoff_s", "exposed_s")
        },
        "link": cluster.get("link"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policy", default="mlx-default")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=common.result_path("disagg"))
    ap.add_argument("--validate-only", action="store_true", help="the runs are in --work already: compare only")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="disagg-real-"))
    runs, walls = [], []
    for k in range(args.rounds):
        d = work / f"pd-{k + 1}"
        runs.append(d)
        if args.validate_only:
            continue
        cmd = ["schedlab", "run-real", "--policy", args.policy, "--model", args.model, "--trace", args.trace,
               "--prefill", "1", "--decode", "1", "--out", str(d), "-q"]  # fmt: skip
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        if p.returncode != 0:
            raise SystemExit(f"run-real failed (round {k + 1}): {p.stderr.strip()[-3000:]}")
        print(f"round {k + 1}: {walls[-1]:.0f} s", file=sys.stderr, flush=True)
    v_out = work / "validate"
    cmd = ["schedlab", "validate", *sum((["--served", str(d)] for d in runs), []), "--out", str(v_out)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"validate --served failed: {p.stderr.strip()[-3000:]}")
    print(p.stdout)
    v = json.loads((v_out / "validation.json").read_text())
    total = v["total"]
    real = {
        "what": "run-real --prefill 1 --decode 1 (one core each; the KV through a shared-memory file), "
        f"{args.rounds} runs; validate --served: the simulation of the same pools with the link measured "
        "before serving, against the runs' median (each run held out against the others' median)",
        "trace": args.trace,
        "policy": args.policy,
        "model": args.model,
        "rounds": args.rounds,
        "rev": common.git_rev(),
        "machine": common.machine(),
        "profile": v["profile"],
        "median_abs_error_pct": total["median_abs_error_pct"],
        "max_abs_error_pct": total["max_abs_error_pct"],
        "hold_one_out": total.get("hold_one_out"),
        "metrics": total["metrics"],
        "per_replica": [
            {"pool": pool, "median_abs_error_pct": r["median_abs_error_pct"], "hold_one_out": r.get("hold_one_out")}
            for pool, r in zip(v["pools"], v["per_replica"])
        ],
        "transfer": v["transfer"],
        "runs": [one_run(d) for d in runs],
        "run_wall_s": walls or None,
    }
    try:
        out = json.loads(Path(args.out).read_text())
    except FileNotFoundError:
        out = {"benchmark": "disagg"}
    out["real"] = real
    common.write_json(out, args.out)
    h = real["hold_one_out"] or {}
    t = real["transfer"]
    print(
        f"median |error| {real['median_abs_error_pct']:.1f} %, held out: sim {h.get('sim_median_pct', float('nan')):.1f} %"
        f" / a real run {h.get('real_median_pct', float('nan')):.1f} %; KV transfer measured / predicted "
        f"x{t['ratio_median']:.2f}"
    )


if __name__ == "__main__":
    main()
