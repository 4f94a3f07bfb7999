"""``sweep``: policies x request rates (x numbers of clients) on one trace, latency against load
(``schedlab.sweep``): a table, sweep.csv, sweep.json and the latency-vs-load figure."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from ._app import (
    BLOCK_SIZE_HELP,
    EXECUTOR_HELP,
    RAY_ADDRESS_HELP,
    PREFIX_HELP,
    Interrupted,
    make_app,
    out_path,
    parse_options,
    run_app,
)

sweep_app = make_app(
    "Simulate policies over one trace rescaled to several request rates and/or behind several "
    "numbers of closed-loop clients; print a table, write sweep.csv, sweep.json and "
    "latency-vs-load curves."
)


@sweep_app.command()
def sweep(
    policy: str = typer.Option(..., "--policy", "-p", help="comma-separated policies (bundled names or file.py:Class)"),
    trace: str = typer.Option(..., "--trace", "-t", help="trace file, or a bundled trace's bare name"),
    rates: Optional[str] = typer.Option(
        None, "--rates", "-r", help="comma-separated request rates (req/s) to rescale the trace to"
    ),
    concurrency: Optional[str] = typer.Option(
        None,
        "--concurrency",
        "-c",
        help="comma-separated numbers of closed-loop clients (max concurrency) to put in front of the replica",
    ),
    request_rate: Optional[str] = typer.Option(
        None,
        "--request-rate",
        help="with --concurrency: issue requests at this rate (req/s; inf: all at once) instead of the trace's times",
    ),
    burstiness: Optional[float] = typer.Option(
        None, "--burstiness", help="with --request-rate: gamma shape of the gaps (1: Poisson)"
    ),
    think_time: Optional[float] = typer.Option(
        None, "--think-time", help="with --concurrency: seconds a client waits after a response"
    ),
    block_size: int = typer.Option(16, "--block-size", help=BLOCK_SIZE_HELP),
    prefix_caching: bool = typer.Option(False, "--prefix-caching", help=PREFIX_HELP),
    workers: Optional[int] = typer.Option(
        None,
        "--workers",
        "-j",
        help="worker processes (default: min(CPU count, jobs)); with --executor ray: jobs in flight at once "
        "(default: all; a local Ray gets this many CPUs)",
    ),
    executor: str = typer.Option("local", "--executor", help=EXECUTOR_HELP),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
    profile: Optional[str] = typer.Option(
        None, "--profile", help="cost-model profile JSON (default: the bundled measured profile)"
    ),
    kv_tokens: Optional[int] = typer.Option(
        None, "--kv-tokens", help="KV cache capacity in tokens (default: the profile's)"
    ),
    option: Optional[List[str]] = typer.Option(
        None, "--option", "-o", help="policy option key=value, applied to every policy (repeatable)"
    ),
    slo: Optional[str] = typer.Option(
        None, "--slo", help="SLOs for goodput, e.g. ttft_ms=2000,tpot_ms=100 (keys: ttft_ms, tpot_ms, e2e_ms)"
    ),
    attainment: float = typer.Option(
        0.9, "--attainment", help="fraction of requests that must meet every SLO for a rate to count as sustained"
    ),
    seed: int = typer.Option(0, "--seed", help="seed for trace loading (Mooncake tick jitter)"),
    out: Optional[Path] = typer.Option(
        None, "--out", "-O", parser=out_path, help="output directory (default: ./sweep-TRACE)"
    ),
    fmt: str = typer.Option("png,svg", "--format", "-f", help="figure formats: png, svg or png,svg"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no table, no progress bar"),
) -> None:
    """Sweep POLICIES x RATES (x CONCURRENCY) on TRACE and report latency against load."""
    import schedlab
    from schedlab.api.sweeps import parse_concurrency, parse_rates, sweep_rows

    pols = list(dict.fromkeys(p.strip() for p in policy.split(",") if p.strip()))
    n_rates = len(parse_rates(rates)) if rates is not None else 0
    n_conc = len(parse_concurrency(concurrency)) if concurrency is not None else 0
    tr = schedlab.load_trace(trace, seed=seed)
    if out is None:
        out = Path(f"sweep-{tr.name}")
    jobs = _Jobs(tr, len(pols), n_rates, n_conc, quiet)

    def work(cb):
        return schedlab.sweep(
            policy,
            tr,
            rates,
            concurrency=concurrency,
            options=parse_options(option),
            profile=profile,
            replica=schedlab.ReplicaOptions(kv_tokens=kv_tokens, block_size=block_size, prefix_caching=prefix_caching),
            request_rate=request_rate,
            burstiness=burstiness,
            think_time=think_time,
            slo=slo,
            attainment=attainment,
            seed=seed,
            workers=workers,
            executor=executor,
            ray_address=ray_address,
            out=out,
            formats=fmt,
            on_start=jobs.started,
            on_done=jobs.counting(cb),
        )

    try:
        table = _with_progress(quiet, jobs.total, work)
    except KeyboardInterrupt:
        # typer turns Ctrl-C into a silent exit 130; say what was dropped, in one line
        raise Interrupted(
            f"{jobs.finished} of {jobs.total} simulations done, the rest cancelled; nothing written"
        ) from None
    rows = sweep_rows(table)
    if not quiet:
        _print_results(table, rows)
    if _print_problems(rows, table.attrs["info"]):
        raise typer.Exit(1)


class _Jobs:
    """The sweep's simulations (policies x rates x concurrencies of one trace): how many, and how
    many are done."""

    def __init__(self, tr, n_pols: int, n_rates: int, n_conc: int, quiet: bool):
        self.tr = tr
        self.quiet = quiet
        self.total = n_pols * max(n_rates, 1) * max(n_conc, 1)
        self.dims = (
            f"{n_pols} policies"
            + (f" x {n_rates} rates" if n_rates else "")
            + (f" x {n_conc} concurrencies" if n_conc else "")
        )
        self.finished = 0

    def started(self, jobs: int, used: int) -> None:  # after the workers exist (see analysis.executors)
        if not self.quiet:
            print(
                f"sweep: {self.dims} = {jobs} simulations of {self.tr.name} ({len(self.tr)} requests) on {used} "
                "worker(s)",
                file=sys.stderr,
                flush=True,
            )

    def counting(self, cb):
        """``cb`` (or nothing) for each finished simulation, counted."""

        def done(row):
            self.finished += 1
            if cb is not None:
                cb(row)

        return done


def _print_results(table, rows) -> None:
    """The table, each policy's highest sustained rate (with SLOs), the files written."""
    from schedlab.analysis.sweep import format_table

    info = table.attrs["info"]
    sustained = info.get("max_sustained_rate")
    print(format_table(rows, slo=bool(info.get("slo"))))
    if sustained:
        print(
            f"\nHighest sustained rate (>= {info['attainment']:.0%} of requests meet every SLO at it and at every "
            f"lower swept rate):"
        )
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


def _print_problems(rows, info) -> bool:
    """The first errors and the rejected requests, on stderr; whether any simulation failed."""
    errors = [r for r in rows if r.get("error")]
    for r in errors[:5]:
        where = [] if r.get("rate_rps") is None else [f"{r['rate_rps']:g} req/s"]
        where += [] if r.get("max_concurrency") is None else [f"{r['max_concurrency']} clients"]
        print(f"sweep: error: {r['policy']} at {', '.join(where) or 'the trace times'}: {r['error']}", file=sys.stderr)
    rejected = [r for r in rows if r.get("rejected")]
    if rejected:
        print(
            f"sweep: warning: {rejected[0]['rejected']} request(s) rejected in every run: their prompt + "
            f"output exceeds the KV capacity of {info['kv_tokens']} tokens (they count as SLO misses)",
            file=sys.stderr,
        )
    return bool(errors)


def _with_progress(quiet: bool, total: int, work):
    """Run ``work(on_done)`` under a rich progress bar on stderr (when stderr is a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        return work(None)
    with Progress(
        TextColumn("simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("", total=total)

        def done(row):
            at = [] if row.get("rate_rps") is None else [f"{row['rate_rps']:g} req/s"]
            at += [] if row.get("max_concurrency") is None else [f"{row['max_concurrency']} clients"]
            bar.update(task, advance=1, description=f"last done: {row['policy']} @ {', '.join(at) or 'trace times'}")

        return work(done)


def main() -> None:
    run_app(sweep_app, "sweep")
