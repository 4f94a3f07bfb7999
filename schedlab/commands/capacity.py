"""``capacity``: the highest request rate each configuration (policy x router x replicas, and
cluster files) serves within its SLOs (``schedlab.capacity``): a table, and with ``--out``
capacity.csv, capacity.json and the figures."""

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
    fail,
    make_app,
    out_path,
    parse_options,
    run_app,
)

capacity_app = make_app(
    "For every configuration (policies x routers x replica counts, and cluster files), find the highest "
    "request rate (the trace's arrivals time-scaled to it) at which at least --attainment of all requests "
    "finish and meet every SLO: bracket, then bisect to --tolerance."
)


#: the flags' longer help texts
_SLO_HELP = (
    "the SLOs in ms, e.g. ttft_ms=2000,tpot_ms=100 (keys: ttft_ms, tpot_ms, e2e_ms; or vllm bench "
    "serve --goodput's ttft, tpot, e2el)"
)
_ROUTER_HELP = (
    "comma-separated routers (round-robin, least-requests, least-tokens, ... or file.py:Class); "
    "default: none for one replica, round-robin for more"
)
_PD_SPLITS_HELP = (
    "a --cluster file of one prefill and one decode group stands for every prefill:decode split "
    "of its replicas (1:N-1 ... N-1:1)"
)
_PRICE_HELP = (
    "hourly price of ONE replica, for the requests-per-dollar column (req/$); overrides the "
    "--hardware preset's (h100-sxm, a100-*: one provider's on-demand price) and applies to --cluster "
    "configurations too"
)
_WORKERS_HELP = (
    "worker processes (default: min(CPU count, configurations)); with --executor ray: searches in "
    "flight at once (default: all; a local Ray gets this many CPUs)"
)


@capacity_app.command()
def capacity(
    policy: Optional[str] = typer.Option(
        None,
        "--policy",
        "-p",
        help="comma-separated policies (bundled names or file.py:Class); required unless --cluster",
    ),
    trace: str = typer.Option(..., "--trace", "-t", help="trace file, or a bundled trace's bare name"),
    slo: str = typer.Option(..., "--slo", help=_SLO_HELP),
    attainment: float = typer.Option(
        0.99, "--attainment", help="share of ALL requests that must finish and meet every SLO, in (0, 1]"
    ),
    tolerance: float = typer.Option(
        0.02, "--tolerance", help="bisect until (hi - lo) / lo <= this (lo passes, hi fails)"
    ),
    router: Optional[str] = typer.Option(None, "--router", help=_ROUTER_HELP),
    router_option: Optional[List[str]] = typer.Option(
        None, "--router-option", help="router option key=value, for every router (repeatable)"
    ),
    replicas: str = typer.Option("1", "--replicas", help="comma-separated replica counts, e.g. 1,2,4"),
    cluster: Optional[List[str]] = typer.Option(
        None,
        "--cluster",
        help="a cluster file (TOML, see docs/cluster.md; or a bundled one's name), its own configuration (repeatable)",
    ),
    pd_splits: bool = typer.Option(False, "--pd-splits", help=_PD_SPLITS_HELP),
    option: Optional[List[str]] = typer.Option(
        None, "--option", "-o", help="policy option key=value, applied to every policy (repeatable)"
    ),
    profile: Optional[str] = typer.Option(
        None, "--profile", help="cost-model profile JSON (default: the bundled measured profile)"
    ),
    hardware: Optional[str] = typer.Option(
        None, "--hardware", help="analytic roofline model on a hardware preset (h100-sxm, a100-40gb-sxm, m4-max, ...)"
    ),
    model_config: Optional[str] = typer.Option(
        None, "--model-config", help="with --hardware: a bundled model config (llama-3.1-8b, ...) or a config.json"
    ),
    quant: Optional[int] = typer.Option(None, "--quant", help="with --hardware: weight bits (4, 8, 16)"),
    kv_tokens: Optional[int] = typer.Option(
        None, "--kv-tokens", help="KV cache capacity in tokens (default: the profile's, or what the memory holds)"
    ),
    block_size: int = typer.Option(16, "--block-size", help=BLOCK_SIZE_HELP),
    prefix_caching: bool = typer.Option(False, "--prefix-caching", help=PREFIX_HELP),
    start_rps: Optional[float] = typer.Option(
        None,
        "--start-rps",
        help="first rate tried, per replica (default: twice the trace's own mean rate; n replicas start at n times it)",
    ),
    price_per_hour: Optional[float] = typer.Option(None, "--price-per-hour", metavar="USD", help=_PRICE_HELP),
    workers: Optional[int] = typer.Option(None, "--workers", "-j", help=_WORKERS_HELP),
    executor: str = typer.Option("local", "--executor", help=EXECUTOR_HELP),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
    seed: int = typer.Option(0, "--seed", help="seed for trace loading (Mooncake tick jitter)"),
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        "-O",
        parser=out_path,
        help="write capacity.csv, capacity.json and the figures into this directory",
    ),
    fmt: str = typer.Option("png,svg", "--format", "-f", help="figure formats: png, svg or png,svg"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no table, no progress"),
) -> None:
    """Search the SLO capacity of every configuration on TRACE."""
    import schedlab

    if policy is None and not cluster:
        fail("give --policy and/or --cluster FILE (the configurations to search)", 2)
    progress = _Progress(quiet)
    try:
        table = schedlab.capacity(
            policy,
            trace,
            slo=slo,
            attainment=attainment,
            tolerance=tolerance,
            routers=router,
            router_options=parse_options(router_option) or None,
            replicas=replicas,
            clusters=cluster or None,
            pd_splits=pd_splits,
            options=parse_options(option) or None,
            profile=profile,
            hardware=hardware,
            model_config=model_config,
            quant=quant,
            kv_tokens=kv_tokens,
            block_size=block_size,
            prefix_caching=prefix_caching,
            start_rps=start_rps,
            price_per_hour=price_per_hour,
            seed=seed,
            workers=workers,
            executor=executor,
            ray_address=ray_address,
            out=out,
            formats=fmt,
            on_start=progress.started,
            on_done=progress.finished,
        )
    except KeyboardInterrupt:
        raise Interrupted(
            f"{progress.done} of {progress.total or '?'} configurations done, the rest cancelled; nothing written"
        ) from None
    rows = table.astype(object).where(table.notna(), None).to_dict("records")
    if not quiet:
        _print_results(table, rows)
    errors = [r for r in rows if r.get("error")]
    for r in errors:
        print(f"capacity: error: {r['configuration']}: {r['error']}", file=sys.stderr)
    if errors:
        raise typer.Exit(1)


class _Progress:
    """A line on stderr as the search starts and as each configuration's ends (on a terminal
    only: piped, stderr holds only errors), and the count of configurations searched."""

    def __init__(self, quiet: bool):
        self.show = not quiet and sys.stderr.isatty()
        self.done = 0
        self.total = 0

    def started(self, jobs: int, used: int) -> None:
        self.total = jobs
        if self.show:
            print(f"capacity: {jobs} configuration(s) on {used} worker(s)", file=sys.stderr, flush=True)

    def finished(self, row) -> None:
        self.done += 1
        if self.show:
            cap = row.get("capacity_rps")
            text = "none" if cap is None else ((">= " if row.get("limited") else "") + f"{cap:.4g} req/s")
            print(
                f"capacity: [{self.done}/{self.total}] {row['configuration']}: {text} "
                f"({row.get('runs', 0)} runs, {row.get('early_stops', 0)} stopped early)",
                file=sys.stderr,
                flush=True,
            )


def _print_results(table, rows) -> None:
    """What was searched, the table, the files written."""
    info = table.attrs["info"]
    slo_text = ", ".join(f"{k} <= {v:g}" for k, v in info["slo"].items())
    print(
        f"SLO capacity on {info['trace']} ({info['trace_requests']} requests): the highest rate at which at "
        f"least {info['attainment']:.4g} of all requests meet {slo_text} (within {info['tolerance']:.2%})"
    )
    _print_table(rows)
    for f in table.attrs["files"]:
        print(f)


def _print_table(rows) -> None:
    """The table: rich when stdout is a terminal, plain text otherwise."""
    from rich.console import Console

    from schedlab.analysis.capacity import format_table, table_cells

    console = Console()
    if not console.is_terminal:
        print(format_table(rows))
        return
    from rich.table import Table

    head, lines = table_cells(rows)
    t = Table(show_edge=False, header_style="bold")
    for i, h in enumerate(head):
        t.add_column(h, justify="left" if i == 0 else "right")
    for line in lines:
        t.add_row(*line)
    console.print(t)


def main() -> None:
    run_app(capacity_app, "capacity")
