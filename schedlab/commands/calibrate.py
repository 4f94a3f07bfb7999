"""``calibrate``: measure the real engine and write the cost-model profile simulate uses."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ._app import MODEL_HELP, fail, log_to_stderr, make_app, out_path, run_app

calibrate_app = make_app(
    "Time real passes of the MLX engine over a grid (decode batch x context, prefill chunk x "
    "context, padded multi-prompt prefill, mixed passes, the real loop's per-step overhead), "
    "fit the simulator's cost model and write it, with its fit report, as a profile JSON."
)


@calibrate_app.command()
def calibrate(
    out: Path = typer.Option(..., "--out", parser=out_path, help="profile JSON to write"),
    model: str = typer.Option("tiny", "--model", "-m", help=MODEL_HELP),
    dtype: str = typer.Option("float32", "--dtype", help="float32, float16 or bfloat16"),
    quick: bool = typer.Option(False, "--quick", help="a smaller grid (under a minute for tiny on 2 cores)"),
    seed: int = typer.Option(0, "--seed", help="seed of the grid's order and the prompt ids"),
    model_seed: int = typer.Option(0, "--model-seed", help="seed of a preset's random weights"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress lines"),
    analytic: bool = typer.Option(
        False,
        "--analytic",
        help="also fit the analytic roofline's cpu-local factors to the samples "
        "and store them in the profile (key analytic_cpu_local; validate --hardware cpu-local uses them)",
    ),
    from_profile: Optional[Path] = typer.Option(
        None,
        "--from-profile",
        help="with --analytic: time nothing, fit the factors to "
        "this profile's stored samples (same model and machine) and write it to OUT; with --add-verify: see there",
    ),
    add_verify: bool = typer.Option(
        False,
        "--add-verify",
        help="with --from-profile: time only the verify passes of speculative decoding and add their terms to "
        "that profile (every other coefficient kept), written to OUT",
    ),
    from_runs: bool = typer.Option(
        False,
        "--from-runs",
        help="time nothing: fit the cost model to the real runs' steps "
        "(RUNS: run-real --out or validate directories, their features.parquet), holding out "
        "whole runs; with --grid, on top of that grid profile's fit",
    ),
    grid: Optional[Path] = typer.Option(
        None,
        "--grid",
        help="with --from-runs: a grid profile (calibrate) of the same "
        "model and machine whose fit gives the passes' shape dependence",
    ),
    replay: bool = typer.Option(
        False,
        "--replay",
        help="the default calibration (what validate and run-real make when no "
        "profile matches): the quick grid, then a short real replay of a few policies on a small "
        "synthetic trace, fitted together (~1-3 min)",
    ),
    keep_runs: Optional[Path] = typer.Option(
        None, "--keep-runs", help="with --replay: keep the replay's run directories here"
    ),
    speculative: Optional[str] = typer.Option(
        None,
        "--speculative",
        help="with --trace: also measure the acceptance of these drafts (ngram:k=4) on the trace's requests, the "
        "real engine greedy, and keep it in the profile (acceptance; simulate --speculative ngram:k=4,accept=OUT "
        "reads it); with --from-profile P: P with the acceptance added, nothing else timed",
    ),
    trace: Optional[str] = typer.Option(
        None, "--trace", "-t", help="with --speculative: the workload whose drafts' acceptance is measured"
    ),
    acceptance_only: bool = typer.Option(
        False,
        "--acceptance-only",
        help="with --speculative and --trace: time nothing else; OUT is a small JSON of the acceptance alone",
    ),
    runs: Optional[List[Path]] = typer.Argument(None, help="with --from-runs: run directories", show_default=False),
) -> None:
    """Calibrate the cost model on this machine and write the profile to OUT."""
    import schedlab

    if runs and not from_runs:
        fail("run directories go with --from-runs", 2)
    if grid is not None and not from_runs:  # (in Python, grid= also names a calibration grid)
        fail("--grid goes with --from-runs", 2)
    prof = schedlab.calibrate(
        model=model,
        dtype=dtype,
        quick=quick,
        seed=seed,
        model_seed=model_seed,
        analytic=analytic,
        from_profile=from_profile,
        add_verify=add_verify,
        replay=replay,
        keep_runs=keep_runs,
        from_runs=(runs or []) if from_runs else None,
        grid=grid,
        speculative=speculative,
        trace=trace,
        acceptance_only=acceptance_only,
        out=out,
        log=log_to_stderr("calibrate", quiet),
    )
    print(prof.report())
    print(f"wrote {out}")


def main() -> None:
    run_app(calibrate_app, "calibrate")
