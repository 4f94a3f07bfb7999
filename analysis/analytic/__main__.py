"""``python -m analysis.analytic refit | table``: maintain the efficiency fits, print the presets."""

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
                print(f"{name:14s} compute {e.compute:.3f} bandwidth {e.bandwidth:.3f} "
                      f"overhead {e.overhead_per_layer_s * 1e6:6.1f} us/layer  points {len(res.residuals):2d} "
                      f"max|res| {res.max_abs_residual:6.1%} rms {res.rms_residual:6.1%}")
            return 0
        if cmd == "table":
            print(f"{'preset':14s} {'mem GB':>7s} {'GB/s':>7s} {'TFLOPS':>8s} {'dtype':>5s} {'e_c':>6s} {'e_b':>6s} {'o us':>6s}  basis")
            for name in list_hardware():
                if name == "cpu-local" and "--measure" not in args:
                    print(f"{name:14s} (measured on first use)")
                    continue
                hw = load_hardware(name)
                e = hw.efficiency
                print(f"{name:14s} {hw.memory_bytes / 1e9:7.0f} {hw.bandwidth / 1e9:7.0f} {hw.peak() / 1e12:8.1f} "
                      f"{hw.default_compute:>5s} {e.compute:6.3f} {e.bandwidth:6.3f} {e.overhead_per_layer_s * 1e6:6.1f}  "
                      f"{e.basis}{' from ' + e.extra['from'] if 'from' in e.extra else ''}")
            return 0
    except AnalyticError as exc:
        print(f"analysis.analytic: error: {exc}", file=sys.stderr)
        return 1
    print(f"usage: python -m analysis.analytic [refit [--dry-run] | table [--measure]] (got {cmd!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
