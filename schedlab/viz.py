"""Console scripts ``plot`` and ``sweep``: pictures of schedules. Errors are one line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from .common import Interrupted, fail, make_app, parse_options, run_app

plot_app = make_app(
    "Draw figures from run directories (simulate --out DIR) and validation directories "
    "(DIR/validation.json + DIR/sim/ + DIR/real/): TTFT and ITL CDFs, per-request decode "
    "rates, a step timeline per run, and simulated-vs-measured overlays.")

sweep_app = make_app(
    "Simulate policies over one trace rescaled to several request rates; print a table, "
    "write sweep.csv, sweep.json and latency-vs-load curves.")


def _formats(text: str) -> list[str]:
    fmts = [f.strip().lower().lstrip(".") for f in text.split(",") if f.strip()]
    bad = [f for f in fmts if f not in ("png", "svg")]
    if bad or not fmts:
        fail(f"--format must be png, svg or png,svg; got {text!r}", 2)
    return list(dict.fromkeys(fmts))


@plot_app.command()
def plot(
    run_dirs: List[Path] = typer.Argument(..., help="run directories and/or validation directories", show_default=False),
    out: Optional[Path] = typer.Option(None, "--out", "-O", help="where to write the figures "
                                       "(default: RUN_DIR/plots for one directory, ./plots for several)"),
    fmt: str = typer.Option("png,svg", "--format", "-f", help="png, svg or png,svg"),
    lanes: int = typer.Option(60, "--lanes", help="timeline: most requests (lanes) drawn per run"),
    window: Optional[str] = typer.Option(None, "--window", help="timeline: time window START:END in seconds "
                                         "(lanes = requests alive in it)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors"),
) -> None:
    """Draw figures for RUN_DIR ... and print the files written."""
    from . import api

    formats = _formats(fmt)
    if out is None:
        out = run_dirs[0] / "plots" if len(run_dirs) == 1 else Path("plots")
    try:
        figs = api.plot(*run_dirs, out=out, formats=formats, lanes=lanes, window=window)
    except KeyboardInterrupt:
        raise Interrupted() from None
    for w in figs.warnings:
        print(f"plot: warning: {w}", file=sys.stderr)
    if not quiet:
        for f in figs.files:
            print(f)


@sweep_app.command()
def sweep(
    policy: str = typer.Option(..., "--policy", "-p", help="comma-separated policies (bundled names or file.py:Class)"),
    trace: str = typer.Option(..., "--trace", "-t", help="trace file, or a bundled trace's bare name"),
    rates: str = typer.Option(..., "--rates", "-r", help="comma-separated request rates (req/s) to rescale the trace to"),
    workers: Optional[int] = typer.Option(None, "--workers", "-j", help="worker processes (default: min(CPU count, jobs))"),
    profile: Optional[str] = typer.Option(None, "--profile", help="cost-model profile JSON (default: the bundled measured profile)"),
    kv_tokens: Optional[int] = typer.Option(None, "--kv-tokens", help="KV cache capacity in tokens (default: the profile's)"),
    option: Optional[List[str]] = typer.Option(None, "--option", "-o", help="policy option key=value, applied to every policy (repeatable)"),
    slo: Optional[str] = typer.Option(None, "--slo", help="SLOs for goodput, e.g. ttft_ms=2000,tpot_ms=100 (keys: ttft_ms, tpot_ms, e2e_ms)"),
    attainment: float = typer.Option(0.9, "--attainment", help="fraction of requests that must meet every SLO for a rate to count as sustained"),
    seed: int = typer.Option(0, "--seed", help="seed for trace loading (Mooncake tick jitter)"),
    out: Optional[Path] = typer.Option(None, "--out", "-O", help="output directory (default: ./sweep-TRACE)"),
    fmt: str = typer.Option("png,svg", "--format", "-f", help="figure formats: png, svg or png,svg"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no table, no progress bar"),
) -> None:
    """Sweep POLICIES x RATES on TRACE and report latency against load."""
    from . import api

    pols = list(dict.fromkeys(p.strip() for p in policy.split(",") if p.strip()))
    if not pols:
        fail("--policy needs at least one policy", 2)
    rate_list = api.parse_rates(rates)
    formats = _formats(fmt)
    opts = parse_options(option)
    tr = api.load_trace(trace, seed=seed)
    if out is None:
        out = Path(f"sweep-{tr.name}")
    n_jobs = len(pols) * len(rate_list)

    def started(jobs: int, used: int) -> None:  # after the workers exist (see analysis.sweep._parallel)
        if not quiet:
            print(f"sweep: {len(pols)} policies x {len(rate_list)} rates = {jobs} simulations of "
                  f"{tr.name} ({len(tr)} requests) on {used} worker(s)", file=sys.stderr, flush=True)

    finished = [0]

    def work(cb):
        def done(row):
            finished[0] += 1
            if cb is not None:
                cb(row)

        return api.sweep(pols, tr, rate_list, options=opts, profile=profile, kv_tokens=kv_tokens, slo=slo,
                         attainment=attainment, seed=seed, workers=workers, out=out, formats=formats,
                         on_start=started, on_done=done)

    try:
        table = _with_progress(quiet, n_jobs, work)
    except KeyboardInterrupt:
        # typer turns Ctrl-C into a silent exit 130; say what was dropped, in one line
        raise Interrupted(f"{finished[0]} of {n_jobs} simulations done, the rest cancelled; "
                          "nothing written") from None

    from analysis.sweep import format_table

    info = table.attrs["info"]
    rows = table.astype(object).where(table.notna(), None).to_dict("records")
    slos = info.get("slo")
    sustained = info.get("max_sustained_rate")
    if not quiet:
        print(format_table(rows, slo=bool(slos)))
        if sustained:
            print(f"\nHighest sustained rate (>= {attainment:.0%} of requests meet every SLO at it and at every lower swept rate):")
            for pol, s in sustained.items():
                if s["rate_rps"] is None:
                    text = f"none: fails at the lowest swept rate, {s['first_failing_rate_rps']:g} req/s"
                elif s["limited_by_sweep"]:
                    text = f">= {s['rate_rps']:g} req/s (the highest swept rate; sweep higher to find the limit)"
                else:
                    text = f"{s['rate_rps']:g} req/s (fails at {s['first_failing_rate_rps']:g})"
                print(f"  {pol}: {text}")
        print()
        for f in table.attrs["files"]:
            print(f)
    errors = [r for r in rows if r.get("error")]
    for r in errors[:5]:
        print(f"sweep: error: {r['policy']} at {r['rate_rps']:g} req/s: {r['error']}", file=sys.stderr)
    rejected = [r for r in rows if r.get("rejected")]
    if rejected:
        print(f"sweep: warning: {rejected[0]['rejected']} request(s) rejected in every run: their prompt + "
              f"output exceeds the KV capacity of {info['kv_tokens']} tokens (they count as SLO misses)", file=sys.stderr)
    if errors:
        raise typer.Exit(1)


def _with_progress(quiet: bool, total: int, work):
    """Run ``work(on_done)`` under a rich progress bar on stderr (when stderr is a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        return work(None)
    with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=True) as bar:
        task = bar.add_task("", total=total)

        def done(row):
            bar.update(task, advance=1, description=f"last done: {row['policy']} @ {row['rate_rps']:g} req/s")

        return work(done)


def plot_main() -> None:
    run_app(plot_app, "plot")


def sweep_main() -> None:
    run_app(sweep_app, "sweep")
