"""Machine noise: how this machine's speed moves while nothing else runs, and what can follow it.

Two parts, one after the other, nothing else running:

1. A pure-Python loop timed in back-to-back windows (``--window`` s each, ``--seconds`` in all),
   with the kernel's CPU accounting of each window (``/proc/stat``: ticks stolen by the
   hypervisor, the process's share of a CPU): how the CPU's speed moves, and whether the
   hypervisor's steal explains it.
2. MLX passes of a model (``--model``, default ``tiny``: a 2-row decode step at 128 tokens of
   context, a 64-token prefill), each followed by a short pure-Python loop, alternating for
   ``--seconds`` s: how the passes' times spread, and how well a cheap CPU probe (the loop) or
   another kind of pass follows them (correlation of log times).

What it answers for ``validate``'s drift adjustment: the machine's speed can only be taken out
with a probe that moves with the passes; one that does not (here a Python loop) leaves the
noise in. Results: ``bench/results/machine_noise.json`` (docs/validation.md).

    python bench/machine_noise.py [--seconds 60] [--window 0.5] [--model tiny]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import numpy as np

import common


def _ticks() -> dict[str, int] | None:
    """Whole-machine CPU ticks by kind (``/proc/stat``'s first line); None off Linux."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return dict(zip(names, map(int, first[1 : 1 + len(names)])))


def _spin(n: int) -> float:
    """Seconds for ``n`` iterations of a trivial Python loop."""
    t = time.perf_counter()
    x = 0
    for _ in range(n):
        x += 1
    return time.perf_counter() - t


def _spread(xs: list[float]) -> dict[str, float]:
    """Quantiles over the median (a time: above 1 slower than usual)."""
    a = np.asarray(xs, dtype=float)
    med = float(np.median(a))
    return {
        "median": med,
        "p10_over_median": float(np.percentile(a, 10) / med),
        "p90_over_median": float(np.percentile(a, 90) / med),
        "min_over_median": float(a.min() / med),
        "max_over_median": float(a.max() / med),
    }


def _corr(a: list[float], b: list[float]) -> float:
    la, lb = np.log(np.asarray(a)), np.log(np.asarray(b))
    return float(np.corrcoef(la, lb)[0, 1])


def _lag1(xs: list[float]) -> float:
    a = np.log(np.asarray(xs))
    return float(np.corrcoef(a[:-1], a[1:])[0, 1])


def cpu_windows(seconds: float, window: float) -> dict:
    """Part 1: the loop's time per fixed work in back-to-back windows, with the steal ticks."""
    per, times, steal, total, share = 20000, [], 0, 0, []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0, c0, k0 = time.perf_counter(), time.process_time(), _ticks()
        n = 0
        while time.perf_counter() - t0 < window:
            _spin(per)
            n += 1
        wall = time.perf_counter() - t0
        k1 = _ticks()
        times.append(wall / n)  # seconds per `per` iterations
        share.append((time.process_time() - c0) / wall)
        if k0 and k1:
            steal += k1["steal"] - k0["steal"]
            total += sum(k1.values()) - sum(k0.values())
    med = statistics.median(times)
    return {
        "windows": len(times),
        "window_s": window,
        "loop_time": _spread(times),
        "windows_slower_than_1_15x_median": sum(t > 1.15 * med for t in times),
        "windows_faster_than_0_95x_median": sum(t < 0.95 * med for t in times),
        "lag1_corr": _lag1(times),
        "steal_share_of_ticks": steal / total if total else None,
        "process_cpu_share_median": statistics.median(share),
    }


def mlx_passes(model: str, seconds: float) -> dict:
    """Part 2: a decode step, a prefill and a loop probe, alternating."""
    from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
    from schedlab.engine.calibrate import Rig, measure_decode, measure_prefill
    from schedlab.engine.models import load_model

    rig = Rig(load_model(model))
    measure_decode(rig, 2, 128, 2)  # warm-up
    measure_prefill(rig, 64, 0, 1)
    dec, pre, loop = [], [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        dec.append(next(s.seconds for s in measure_decode(rig, 2, 128, 5) if s.group == "decode"))
        pre.append(measure_prefill(rig, 64, 0, 1).seconds)
        loop.append(min(_spin(20000) for _ in range(3)))
    return {
        "model": model,
        "samples": len(dec),
        "decode_2_rows_128_ctx": _spread(dec),
        "prefill_64": _spread(pre),
        "python_loop": _spread(loop),
        "corr_decode_prefill": _corr(dec, pre),
        "corr_decode_python_loop": _corr(dec, loop),
        "corr_prefill_python_loop": _corr(pre, loop),
        "decode_lag1_corr": _lag1(dec),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="each part's length")
    ap.add_argument("--window", type=float, default=0.5, help="part 1's window, seconds")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--out", default=str(common.result_path("machine_noise")))
    args = ap.parse_args()
    if not (args.seconds > 0 and args.window > 0 and math.isfinite(args.seconds)):
        raise SystemExit("--seconds and --window: positive numbers")
    t0 = time.perf_counter()
    out = {
        "benchmark": "machine_noise",
        "rev": common.git_rev(),
        "machine": common.machine(),
        "cpu": cpu_windows(args.seconds, args.window),
        "mlx": mlx_passes(args.model, args.seconds),
    }
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    common.write_json(out, args.out, indent=1)
    c, m = out["cpu"], out["mlx"]
    print(
        f"python loop, {c['windows']} windows of {c['window_s']} s: time p10 {c['loop_time']['p10_over_median']:.2f} / "
        f"p90 {c['loop_time']['p90_over_median']:.2f} x median (min {c['loop_time']['min_over_median']:.2f}, max "
        f"{c['loop_time']['max_over_median']:.2f}), lag-1 corr {c['lag1_corr']:.2f}; steal "
        f"{100 * (c['steal_share_of_ticks'] or 0):.2f} % of ticks; the process had {c['process_cpu_share_median']:.2f} of a CPU"
    )
    print(
        f"{m['model']} passes, {m['samples']} samples: decode p10 {m['decode_2_rows_128_ctx']['p10_over_median']:.2f} / "
        f"p90 {m['decode_2_rows_128_ctx']['p90_over_median']:.2f}, prefill p10 {m['prefill_64']['p10_over_median']:.2f} / "
        f"p90 {m['prefill_64']['p90_over_median']:.2f}; corr(decode, prefill) {m['corr_decode_prefill']:.2f}, "
        f"corr(decode, python loop) {m['corr_decode_python_loop']:.2f}"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
