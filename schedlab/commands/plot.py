"""``plot``: figures of run and validation directories (``schedlab.plot``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from ._app import Interrupted, make_app, out_path, run_app

plot_app = make_app(
    "Draw figures from run directories (simulate --out DIR) and validation directories "
    "(DIR/validation.json + DIR/sim/ + DIR/real/): TTFT and ITL CDFs, per-request decode "
    "rates, a step timeline per run, each replica's unfinished requests over time for a run of several replicas "
    "(replica_load), and simulated-vs-measured overlays."
)


@plot_app.command()
def plot(
    run_dirs: List[Path] = typer.Argument(
        ..., help="run directories and/or validation directories", show_default=False
    ),
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        "-O",
        parser=out_path,
        help="where to write the figures (default: RUN_DIR/plots for one directory, ./plots for several)",
    ),
    fmt: str = typer.Option("png,svg", "--format", "-f", help="png, svg or png,svg"),
    lanes: int = typer.Option(60, "--lanes", help="timeline: most requests (lanes) drawn per run"),
    window: Optional[str] = typer.Option(
        None, "--window", help="timeline: time window START:END in seconds (lanes = requests alive in it)"
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors"),
) -> None:
    """Draw figures for RUN_DIR ... and print the files written."""
    import schedlab

    if out is None:
        out = run_dirs[0] / "plots" if len(run_dirs) == 1 else Path("plots")
    try:
        figs = schedlab.plot(*run_dirs, out=out, formats=fmt, lanes=lanes, window=window)
    except KeyboardInterrupt:
        raise Interrupted() from None
    for w in figs.warnings:
        print(f"plot: warning: {w}", file=sys.stderr)
    if not quiet:
        for f in figs.files:
            print(f)


def main() -> None:
    run_app(plot_app, "plot")
