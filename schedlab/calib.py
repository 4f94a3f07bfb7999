"""``calibrate``: measure the real engine and write the cost-model profile simulate uses."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from .common import fail, make_app, run_app

calibrate_app = make_app(
    "Time real passes of the MLX engine over a grid (decode batch x context, prefill chunk x "
    "context, padded multi-prompt prefill, mixed passes, the real loop's per-step overhead), "
    "fit the simulator's cost model and write it, with its fit report, as a profile JSON.")


@calibrate_app.command()
def calibrate(
    out: Path = typer.Option(..., "--out", help="profile JSON to write"),
    model: str = typer.Option("tiny", "--model", "-m", help="preset (micro, tiny, small) or a local mlx-lm checkpoint directory"),
    dtype: str = typer.Option("float32", "--dtype", help="float32, float16 or bfloat16"),
    quick: bool = typer.Option(False, "--quick", help="a smaller grid (under a minute for tiny on 2 cores)"),
    seed: int = typer.Option(0, "--seed", help="seed of the grid's order and the prompt ids"),
    model_seed: int = typer.Option(0, "--model-seed", help="seed of a preset's random weights"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress lines"),
) -> None:
    """Calibrate the cost model on this machine and write the profile to OUT."""
    import engine  # noqa: F401  (OpenBLAS before mlx)
    from engine import blas
    from engine.models import check_spec

    check_spec(model, dtype)
    if out.exists() and out.is_dir():
        fail(f"--out {out} is a directory; give a file name")
    if not out.parent.exists():
        fail(f"--out: directory {out.parent} does not exist")
    from engine.calibrate import GRIDS, calibrate as run_calibration, write_profile
    from sim.fit import format_report
    from engine.models import load_model

    info = load_model(model, dtype=dtype, seed=model_seed)
    blas.notify_if_missing()
    grid = GRIDS["quick" if quick else "default"]

    def say(msg: str) -> None:
        if not quiet:
            print(f"calibrate: {msg}", file=sys.stderr, flush=True)

    profile = run_calibration(info, grid, seed=seed, progress=say)
    try:
        write_profile(profile, out)
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    print(format_report(profile))
    print(f"wrote {out}")


def calibrate_main() -> None:
    run_app(calibrate_app, "calibrate")
