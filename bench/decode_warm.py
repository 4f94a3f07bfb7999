"""Decode warm-up: how much slower the passes right after a batch forms run than later ones.

The calibration grid's steady decode sample used to time the passes right after the batch
formed (the join). In the real loop most decode steps come long after that: a request decodes
for tens to hundreds of steps. This times, for a few batch sizes and contexts, the join and
then ``--passes`` decode passes over the same rows, each batch shape once per round (rounds
interleaved, medians over rounds per position), and reports each position's time relative to
the median of the late positions (the seventh on). ``engine.calibrate.DECODE_WARM`` (the
untimed passes the grid now runs before its steady sample) rests on it.

    python bench/decode_warm.py [--model tiny] [--rounds 3] [--passes 14] [--out bench/results/decode_warm_tiny.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedlab import engine  # noqa: E402,F401  (loads BLAS before mlx)
from schedlab.engine import blas  # noqa: E402
from schedlab.engine.calibrate import DECODE_WARM, Rig, batch_contexts, measure_decode, measure_prefill  # noqa: E402
from schedlab.engine.models import load_model  # noqa: E402
from schedlab.policies.base import Pass  # noqa: E402

SHAPES = ((1, 60), (1, 600), (2, 60), (2, 600), (4, 60), (4, 600), (16, 60), (16, 600))
LATE_FROM = 6  # positions (0-based, after the join) from which a pass counts as late


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=14)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.passes <= LATE_FROM + 1:
        raise SystemExit(f"--passes must be above {LATE_FROM + 1}: the late passes are the ones from the {LATE_FROM + 1}th on")
    info = load_model(args.model)
    rig = Rig(info, seed=0)
    for _ in range(2):  # the process's first forwards are slow: untimed
        measure_decode(rig, 4, 64, 2)
        measure_prefill(rig, 64, 64, 1)
    t0 = time.perf_counter()
    runs: dict[tuple[int, int], list[list[float]]] = {s: [] for s in SHAPES}
    for _ in range(args.rounds):
        for b, c in SHAPES:
            state, ids = rig.scenario([(n, args.passes + 3) for n in batch_contexts(b, c, False)])
            for rid in ids:
                rig.admit(state, [rid], prime=state.by_id[rid].prompt_tokens - 1)
            rig.timed(state, Pass(decode=tuple(ids)))  # the batch forms (merge)
            runs[(b, c)].append([rig.timed(state, Pass(decode=tuple(ids)))[1] for _ in range(args.passes)])
            rig.close(state)
    shapes = []
    for (b, c), rr in runs.items():
        pos = [statistics.median(r[i] for r in rr) for i in range(args.passes)]
        late = statistics.median(pos[LATE_FROM:])
        rel = [p / late for p in pos]
        shapes.append({"rows": b, "context": c, "late_ms": round(late * 1e3, 4),
                       "relative_to_late": [round(x, 4) for x in rel],
                       "first3_over_late": round(statistics.median(rel[:3]), 4),
                       "after_warm_over_late": round(statistics.median(rel[DECODE_WARM:DECODE_WARM + 3]), 4)})
        print(f"B={b:2d} C={c:4d} late {late * 1e3:7.3f} ms  first 3 {shapes[-1]['first3_over_late']:.3f}x  "
              f"after {DECODE_WARM} warm {shapes[-1]['after_warm_over_late']:.3f}x  "
              + " ".join(f"{x:.2f}" for x in rel), flush=True)
    out = {"benchmark": "decode_warm", "model": args.model, "rounds": args.rounds, "passes": args.passes,
           "late_from": LATE_FROM, "decode_warm": DECODE_WARM,
           "blas": {k: v for k, v in blas.info().items() if k in ("name", "threads", "thread_timeout")},
           "machine": {"platform": platform.platform(), "processor": platform.processor()},
           "shapes": shapes,
           "first3_over_late_median": round(statistics.median(s["first3_over_late"] for s in shapes), 4),
           "after_warm_over_late_median": round(statistics.median(s["after_warm_over_late"] for s in shapes), 4),
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(f"median over shapes: the first 3 passes {out['first3_over_late_median']:.3f}x the late ones, "
          f"the 3 after {DECODE_WARM} warm {out['after_warm_over_late_median']:.3f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
