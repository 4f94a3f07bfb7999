"""Single-stream speed of a model in our engine: load time, prefill and decode rates.

Everything goes through the engine's own path (``ReplicaState`` checks each pass,
``MLXBackend.execute`` runs it and returns its measured seconds):

- load: ``load_model(MODEL, dtype)`` wall time in this process (after ``import engine``;
  the first load in a process also imports mlx-lm's model code).
- prefill: one request's whole prompt (``--prompt`` tokens) as one completing chunk
  (it yields the first token), median over ``--reps`` requests; tok/s = prompt / seconds.
- decode: batches of 1, 4 and 16 rows, each request prefilled with ``--context`` tokens,
  then ``--steps`` decode passes over the batch; the first pass (rows joining the batch
  cache) is reported apart, the median of the others is the step time.

    python bench/model_speed.py [--model smollm2-135m] [--dtype float32] [--out bench/results/model_speed_smollm2.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from schedlab import engine  # noqa: E402,F401  (OpenBLAS before mlx)
from schedlab.engine import blas  # noqa: E402
from schedlab.engine.backend import MLXBackend  # noqa: E402
from schedlab.engine.models import load_model  # noqa: E402

from schedlab.policies.base import Pass, Plan  # noqa: E402
from schedlab.sim.state import ReplicaState  # noqa: E402
from schedlab.traces.schema import Request  # noqa: E402


class Driver:
    def __init__(self, info, requests):
        self.state = ReplicaState(requests, 10_000_000, "bench")
        for r in self.state.accepted:
            self.state.arrive(r)
        self.backend = MLXBackend(info, warmup=False, ignore_eos=True)
        self.backend.start(self.state)

    def apply(self, plan: Plan) -> list[float]:
        times = []
        for r in self.state.apply_admin(plan, 0.0):
            self.backend.release(r)
        for p in plan.passes:
            times.append(self.backend.execute(p, self.state.shape(p), self.state))
            for r in self.state.apply_pass(p, 0.0):
                self.backend.release(r)
        self.state.step_index += 1
        return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    t0 = time.perf_counter()
    info = load_model(a.model, dtype=a.dtype)
    load_s = time.perf_counter() - t0

    # warm-up: one short prefill and a few decode steps (first-call costs)
    warm = Driver(info, [Request("w", 0.0, 32, 4)])
    warm.apply(Plan(admit=("w",), passes=(Pass(prefill=(("w", 32),)),)))
    for _ in range(3):
        warm.apply(Plan(passes=(Pass(decode=("w",)),)))

    prefill = []
    for i in range(a.reps):
        rid = f"p{i}"
        d = Driver(info, [Request(rid, 0.0, a.prompt, 2)])
        prefill += d.apply(Plan(admit=(rid,), passes=(Pass(prefill=((rid, a.prompt),)),)))
    pre_s = statistics.median(prefill)

    decode = {}
    for rows in (1, 4, 16):
        ids = tuple(f"d{rows}-{i}" for i in range(rows))
        d = Driver(info, [Request(rid, 0.0, a.context, a.steps + 2) for rid in ids])
        d.apply(Plan(admit=ids, passes=tuple(Pass(prefill=((rid, a.context),)) for rid in ids)))
        steps = [d.apply(Plan(passes=(Pass(decode=ids),)))[0] for _ in range(a.steps)]
        med = statistics.median(steps[1:])
        decode[rows] = {"first_step_ms": round(steps[0] * 1e3, 2), "step_ms_median": round(med * 1e3, 2),
                        "step_ms_min": round(min(steps[1:]) * 1e3, 2), "step_ms_max": round(max(steps[1:]) * 1e3, 2),
                        "tokens_per_s": round(rows / med, 2)}
        print(f"decode {rows:2d} rows: {med * 1e3:7.1f} ms/step ({rows / med:6.1f} tok/s), "
              f"first (join) {steps[0] * 1e3:.1f} ms", flush=True)
    result = {
        "model": a.model, "dtype": info.dtype, "parameters": info.n_params,
        "load_s": round(load_s, 3),
        "prefill": {"prompt_tokens": a.prompt, "seconds_median": round(pre_s, 4),
                    "seconds_all": [round(x, 4) for x in prefill], "tokens_per_s": round(a.prompt / pre_s, 1)},
        "decode_context": a.context, "decode": decode,
        "blas": blas.summary_line(), "machine": platform.platform(),
        "source": info.metadata()["source"],
    }
    print(f"load {load_s:.2f} s; prefill {a.prompt} tokens: {pre_s * 1e3:.0f} ms ({a.prompt / pre_s:.0f} tok/s); "
          f"{blas.summary_line()}")
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
