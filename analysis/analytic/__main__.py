"""``python -m schedlab.analysis.analytic refit | refit-serving [--data DIR] | table``: maintain the efficiency fits, print the presets.

``refit-serving`` needs the serving-kernel tables (not shipped; ``--data DIR``, else
``$SCHEDLAB_KERNEL_DATA``, else ``.data/vidur-kernels/``: see ``analysis/hardware/kernels/README.md``).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    cmd = args[0] if args else "table"
    from . import AnalyticError
    from .hardware import list_hardware, load_hardware

    try:
        if cmd == "refit":
            from .fit import refit

            for name, res in refit(write="--dry-run" not in args).items():
                e = res.efficiency
                print(
                    f"{name:14s} compute {e.compute:.3f} bandwidth {e.bandwidth:.3f} "
                    f"overhead {e.overhead_per_layer_s * 1e6:6.1f} us/layer  points {len(res.residuals):2d} "
                    f"max|res| {res.max_abs_residual:6.1%} rms {res.rms_residual:6.1%}"
                )
            return 0
        if cmd == "refit-serving":
            from .kernels import refit_serving

            data = None
            for i, a in enumerate(args):
                if a == "--data":
                    if i + 1 >= len(args):
                        raise AnalyticError("--data needs a directory (the serving-kernel tables)")
                    data = args[i + 1]
                elif a.startswith("--data="):
                    data = a.split("=", 1)[1]
            for name, res in refit_serving(write="--dry-run" not in args, data=data).items():
                e = res.errors
                ho = e.get("passes (all), held out") or e.get("linear, held-out models")
                print(
                    f"{name:14s} tile {res.serving.gemm_tile_tokens} e_c {res.serving.compute[-1]:.3f} "
                    f"e_b {res.serving.bandwidth:.3f} o {res.serving.overhead_per_layer_s * 1e6:5.1f} us/layer  "
                    f"held out: median {ho['median_abs']:.1%} worst {ho['worst_abs']:.1%} ({ho['n']} points)"
                )
            return 0
        if cmd == "table":
            print(
                f"{'preset':14s} {'mem GB':>7s} {'GB/s':>7s} {'TFLOPS':>8s} {'dtype':>5s} {'e_c':>6s} {'e_b':>6s} {'o us':>6s}  engine, basis"
            )
            for name in list_hardware():
                if name == "cpu-local" and "--measure" not in args:
                    print(f"{name:14s} (measured on first use)")
                    continue
                hw = load_hardware(name)
                e = hw.efficiency
                print(
                    f"{name:14s} {hw.memory_bytes / 1e9:7.0f} {hw.bandwidth / 1e9:7.0f} {hw.peak() / 1e12:8.1f} "
                    f"{hw.default_compute:>5s} {e.compute:6.3f} {e.bandwidth:6.3f} {e.overhead_per_layer_s * 1e6:6.1f}  "
                    f"{hw.engine or '-'}, {e.basis}{' from ' + e.extra['from'] if 'from' in e.extra else ''}"
                )
            return 0
    except AnalyticError as exc:
        print(f"analysis.analytic: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"usage: python -m schedlab.analysis.analytic [refit [--dry-run] | refit-serving [--data DIR] [--dry-run] | "
        f"table [--measure]] "
        f"(got {cmd!r})",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
