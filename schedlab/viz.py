"""Console scripts ``plot`` and ``sweep``: pictures of schedules. Errors are one line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from .common import (Interrupted, check_client_options, check_kv_layout, fail, load_cost_model, make_app, parse_options,
                     parse_rate, parse_slo, run_app)

plot_app = make_app(
    "Draw figures from run directories (simulate --out DIR) and validation directories "
    "(DIR/validation.json + DIR/sim/ + DIR/real/): TTFT and ITL CDFs, per-request decode "
    "rates, a step timeline per run, and simulated-vs-measured overlays.")

sweep_app = make_app(
    "Simulate policies over one trace rescaled to several request rates and/or behind several "
    "numbers of closed-loop clients; print a table, write sweep.csv, sweep.json and "
    "latency-vs-load curves.")


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


def _rates(text: str) -> list[float]:
    import math

    rates = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            v = float(item)
        except ValueError:
            fail(f"--rates: {item!r} is not a number", 2)
        if not (v > 0 and math.isfinite(v)):
            fail(f"--rates: every rate must be a finite number > 0 (requests/s), got {item}", 2)
        rates.append(v)
    if not rates:
        fail("--rates needs at least one rate, e.g. --rates 0.5,1,2", 2)
    return sorted(set(rates))


def _concurrency(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if not (item.isascii() and item.isdigit()) or int(item) < 1:
            fail(f"--concurrency: every value must be an integer >= 1 (clients), got {item!r}", 2)
        out.append(int(item))
    if not out:
        fail("--concurrency needs at least one value, e.g. --concurrency 1,2,4,8", 2)
    return sorted(set(out))


@sweep_app.command()
def sweep(
    policy: str = typer.Option(..., "--policy", "-p", help="comma-separated policies (bundled names or file.py:Class)"),
    trace: str = typer.Option(..., "--trace", "-t", help="trace file, or a bundled trace's bare name"),
    rates: Optional[str] = typer.Option(None, "--rates", "-r", help="comma-separated request rates (req/s) to rescale the trace to"),
    concurrency: Optional[str] = typer.Option(None, "--concurrency", "-c", help="comma-separated numbers of closed-loop clients (max concurrency) to put in front of the replica"),
    request_rate: Optional[str] = typer.Option(None, "--request-rate", help="with --concurrency: issue requests at this rate (req/s; inf: all at once) instead of the trace's times"),
    burstiness: Optional[float] = typer.Option(None, "--burstiness", help="with --request-rate: gamma shape of the gaps (1: Poisson)"),
    think_time: Optional[float] = typer.Option(None, "--think-time", help="with --concurrency: seconds a client waits after a response"),
    block_size: int = typer.Option(16, "--block-size", help="KV block size in tokens"),
    prefix_caching: bool = typer.Option(False, "--prefix-caching", help="block-level prefix caching"),
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
    """Sweep POLICIES x RATES (x CONCURRENCY) on TRACE and report latency against load."""
    from concurrent.futures.process import BrokenProcessPool

    from schedlab import traces
    from schedlab.policies import make_policy
    from schedlab.analysis.sweep import default_workers, format_table, max_sustained_rate, plot_sweep, rescale, write_results
    from schedlab.analysis.sweep import sweep as run_sweep

    pols = list(dict.fromkeys(p.strip() for p in policy.split(",") if p.strip()))
    if not pols:
        fail("--policy needs at least one policy", 2)
    if rates is None and concurrency is None:
        fail("give --rates (request rates to rescale the trace to) and/or --concurrency (numbers of clients)", 2)
    rate_list = _rates(rates) if rates is not None else None
    conc_list = _concurrency(concurrency) if concurrency is not None else None
    client_rate = parse_rate(request_rate)
    if (client_rate is not None or think_time is not None) and conc_list is None:
        fail("--request-rate and --think-time shape the clients of --concurrency: give --concurrency too", 2)
    if client_rate is not None and rate_list is not None:
        fail("give either --rates (rescale the trace) or --request-rate (the clients' schedule), not both", 2)
    check_client_options(conc_list[0] if conc_list else None, client_rate, burstiness, think_time)
    check_kv_layout(block_size)
    formats = _formats(fmt)
    opts = parse_options(option)
    slos = parse_slo(slo)
    if not 0 < attainment <= 1:
        fail(f"--attainment must be in (0, 1], got {attainment:g}", 2)
    if workers is not None and workers < 1:
        fail(f"--workers must be >= 1, got {workers}", 2)
    for p in pols:  # bad names and options fail here, once, not in every worker
        make_policy(p, opts)
    tr = traces.load(trace, seed=seed)
    if rate_list:
        rescale(tr, rate_list[0])  # a trace whose rate cannot be set fails here
    cost, capacity, profile_path = load_cost_model(profile, kv_tokens)
    if out is None:
        out = Path(f"sweep-{tr.name}")
    if out.exists() and not out.is_dir():
        fail(f"--out {out} exists and is not a directory")

    n_jobs = len(pols) * len(rate_list or [None]) * len(conc_list or [None])
    n_workers = workers or default_workers(n_jobs)
    dims = f"{len(pols)} policies"
    if rate_list:
        dims += f" x {len(rate_list)} rates"
    if conc_list:
        dims += f" x {len(conc_list)} concurrencies"
    settings = {"block_size": block_size, "prefix_caching": prefix_caching, "request_rate": client_rate,
                "burstiness": burstiness, "think_s": think_time or 0.0, "seed": seed}

    def started(jobs: int, used: int) -> None:  # after the workers exist (see analysis.sweep._parallel)
        if not quiet:
            print(f"sweep: {dims} = {jobs} simulations of "
                  f"{tr.name} ({len(tr)} requests) on {used} worker(s)", file=sys.stderr, flush=True)

    finished = [0]

    def work(cb):
        def done(row):
            finished[0] += 1
            if cb is not None:
                cb(row)

        return run_sweep(tr, pols, rate_list, cost, capacity, options=opts, slo=slos or None,
                         workers=n_workers, on_done=done, on_start=started, concurrency=conc_list,
                         settings=settings)

    try:
        rows = _with_progress(quiet, n_jobs, work)
    except KeyboardInterrupt:
        # typer turns Ctrl-C into a silent exit 130; say what was dropped, in one line
        raise Interrupted(f"{finished[0]} of {n_jobs} simulations done, the rest cancelled; "
                          "nothing written") from None
    except BrokenProcessPool:
        fail("a worker process died (killed, or out of memory); try fewer --workers")

    sustained = max_sustained_rate(rows, attainment) if slos and rate_list and not conc_list else None
    mean_out = sum(r.output_tokens for r in tr.requests) / len(tr)
    info = {
        "trace": tr.name, "trace_requests": len(tr), "trace_rate_rps": traces.mean_rate(tr),
        "rate_definition": "(requests - 1) / (last arrival - first arrival); arrivals rescaled with traces.to_rate",
        "profile": str(profile_path), "kv_tokens": capacity, "seed": seed, "policies": pols,
        "rates_rps": rate_list, "options": opts, "slo": slos or None,
        "concurrency": conc_list, "block_size": block_size, "prefix_caching": prefix_caching,
        "clients": {"request_rate": client_rate, "burstiness": burstiness, "think_s": think_time or 0.0}
        if conc_list else None,
    }
    if sustained is not None:
        info["attainment"] = attainment
        info["max_sustained_rate"] = sustained
        info["max_sustained_rate_definition"] = (
            f"largest swept rate r such that at r and at every lower swept rate at least {attainment:g} "
            f"of all requests finished and met every SLO (vllm bench serve --goodput rule)")
    try:
        files = write_results(out, rows, info)
        title = (f"{tr.name}: {len(tr)} requests, KV {capacity} tokens in blocks of {block_size}, "
                 f"profile {Path(profile_path).name}")
        fig = plot_sweep(rows, out, slo=slos or None, attainment=attainment, sustained=sustained,
                         offered_tok_per_req=mean_out, title=title, formats=formats)
    except OSError as exc:
        fail(f"cannot write to {out}: {exc.strerror or exc}")
    files += fig["files"]

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
        for f in files:
            print(f)
    errors = [r for r in rows if r.get("error")]
    for r in errors[:5]:
        where = [] if r.get("rate_rps") is None else [f"{r['rate_rps']:g} req/s"]
        where += [] if r.get("max_concurrency") is None else [f"{r['max_concurrency']} clients"]
        print(f"sweep: error: {r['policy']} at {', '.join(where) or 'the trace times'}: {r['error']}", file=sys.stderr)
    rejected = [r for r in rows if r.get("rejected")]
    if rejected:
        print(f"sweep: warning: {rejected[0]['rejected']} request(s) rejected in every run: their prompt + "
              f"output exceeds the KV capacity of {capacity} tokens (they count as SLO misses)", file=sys.stderr)
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
            at = [] if row.get("rate_rps") is None else [f"{row['rate_rps']:g} req/s"]
            at += [] if row.get("max_concurrency") is None else [f"{row['max_concurrency']} clients"]
            bar.update(task, advance=1, description=f"last done: {row['policy']} @ {', '.join(at) or 'trace times'}")

        return work(done)


def plot_main() -> None:
    run_app(plot_app, "plot")


def sweep_main() -> None:
    run_app(sweep_app, "sweep")
