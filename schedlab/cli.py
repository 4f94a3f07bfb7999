"""The ``schedlab`` command and its subcommands. Each subcommand is a small Typer app over
``schedlab.api`` in its own module, imported only when it runs (``schedlab simulate`` never
imports the server or MLX); errors are one line (schedlab.common)."""

from __future__ import annotations

import gc
import os
import sys

from pathlib import Path
from typing import List, Optional

import typer

from .common import fail, make_app, parse_options, report_problems, run_app

# options shared by simulate, run-real and sweep
BLOCK_SIZE_HELP = "KV block size in tokens: KV is allocated in blocks (a request holds ceil(tokens / block))"
PREFIX_HELP = "block-level prefix caching (vLLM's automatic prefix caching): cached prefixes are not computed again"
CONCURRENCY_HELP = ("closed-loop clients: at most C requests in flight, the next one sent when one finishes "
                    "(vllm bench serve --max-concurrency)")
RATE_HELP = ("issue requests at this rate (req/s; inf: all at once) in trace order, replacing the trace's "
             "arrival times (vllm bench serve --request-rate)")
BURST_HELP = "with --request-rate: gamma shape of the gaps (1: Poisson, the default; vllm bench serve --burstiness)"
THINK_HELP = "with --max-concurrency: seconds a client waits after a response before its slot is free again"

simulate_app = make_app(
    "Simulate a scheduling policy over a trace with a calibrated cost model and print the "
    "`vllm bench serve` summary.")


@simulate_app.command()
def simulate(
    policy: str = typer.Option(..., "--policy", "-p", help="mlx-default, prefer-prefill, static, slots, chunked-prefill, unified, or file.py:Class / module:Class"),
    trace: str = typer.Option(..., "--trace", "-t", help="trace file, or a bundled trace's bare name (e.g. mixed.json)"),
    option: Optional[List[str]] = typer.Option(None, "--option", "-o", help="policy option key=value (repeatable)"),
    profile: Optional[str] = typer.Option(None, "--profile", help="cost-model profile JSON (default: the bundled measured profile)"),
    kv_tokens: Optional[int] = typer.Option(None, "--kv-tokens", help="KV cache capacity in tokens (default: the profile's, or what --hardware's memory holds)"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="analytic roofline model on a hardware preset (m4-max, h100-sxm, cpu-local, ...) instead of a measured profile"),
    model_config: Optional[str] = typer.Option(None, "--model-config", help="with --hardware: a bundled model config (llama-3.1-8b, qwen3-30b-a3b, ...) or a config.json path"),
    quant: Optional[int] = typer.Option(None, "--quant", help="with --hardware: weight bits (4, 8, 16; default: the config's dtype)"),
    block_size: int = typer.Option(16, "--block-size", help=BLOCK_SIZE_HELP),
    prefix_caching: bool = typer.Option(False, "--prefix-caching", help=PREFIX_HELP),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help=CONCURRENCY_HELP),
    request_rate: Optional[str] = typer.Option(None, "--request-rate", help=RATE_HELP),
    burstiness: Optional[float] = typer.Option(None, "--burstiness", help=BURST_HELP),
    think_time: Optional[float] = typer.Option(None, "--think-time", help=THINK_HELP),
    seed: int = typer.Option(0, "--seed", help="seed for trace jitter/thinning and the --request-rate schedule"),
    out: Optional[Path] = typer.Option(None, "--out", help="write summary.json, requests.csv, steps/tokens.parquet, meta.json here"),
    passes: bool = typer.Option(False, "--passes", help="with --out: also write passes.parquet (one row per request per pass: exact timelines for plot; ~4 M rows for an hour of traffic)"),
    slo: Optional[str] = typer.Option(None, "--slo", help="goodput SLOs, e.g. ttft_ms=2000,tpot_ms=100"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors"),
) -> None:
    """Simulate POLICY on TRACE and print the summary."""
    from . import api

    if passes and out is None:
        fail("--passes writes passes.parquet into the --out directory: give --out DIR too", 2)
    run = api.simulate(policy, trace, options=parse_options(option), profile=profile, kv_tokens=kv_tokens,
                       hardware=hardware, model_config=model_config, quant=quant, seed=seed, slo=slo,
                       block_size=block_size, prefix_caching=prefix_caching,
                       max_concurrency=max_concurrency, request_rate=request_rate, burstiness=burstiness,
                       think_time=think_time, passes=passes)
    if out is not None:
        run.save(out)
    if not quiet:
        print(run.report())
    report_problems(run)


def simulate_main() -> None:
    # one run per process: the cyclic collector would only walk the run's millions of objects
    # again and again (they hold almost no cycles, and the process ends with the run)
    gc.disable()
    run_app(simulate_app, "simulate")
    # done and written: leave without freeing the run's millions of objects one by one (a
    # tenth of a second on an hour of traffic); errors left above through SystemExit as usual
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# name -> (module, entry function, one line for ``schedlab --help``)
COMMANDS = {
    "simulate": ("schedlab.cli", "simulate_main", "simulate a policy over a trace with a calibrated cost model"),
    "run-real": ("schedlab.real", "run_real_main", "run the same policy on the real MLX engine"),
    "serve": ("schedlab.server", "serve_main", "serve a policy on the real engine behind an OpenAI-compatible HTTP server"),
    "validate": ("schedlab.validate", "validate_main", "run-real and simulate on one trace: prediction against measurement"),
    "calibrate": ("schedlab.calib", "calibrate_main", "time the real engine and fit the cost-model profile simulate uses"),
    "sweep": ("schedlab.viz", "sweep_main", "every policy at every request rate: latency against load, SLO capacity"),
    "plot": ("schedlab.viz", "plot_main", "TTFT/ITL CDFs, decode rates and step timelines of run directories"),
    "export-mlx": ("schedlab.export", "export_main", "write a GGUF model as an mlx-lm checkpoint directory"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: schedlab COMMAND [OPTIONS]   (schedlab COMMAND --help: its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, _, about) in COMMANDS.items()]
    return "\n".join(lines)


def main() -> None:
    """``schedlab COMMAND ...``: run one subcommand (its own Typer app, prog ``schedlab COMMAND``)."""
    import importlib

    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        raise SystemExit(0 if args else 2)
    if args[0] == "--version":
        from . import __version__

        print(f"schedlab {__version__}")
        raise SystemExit(0)
    name = args[0]
    if name not in COMMANDS:
        print(f"schedlab: error: no command {name!r}; one of: {', '.join(COMMANDS)} (see schedlab --help)",
              file=sys.stderr)
        raise SystemExit(2)
    module, entry, _ = COMMANDS[name]
    sys.argv = [f"schedlab {name}", *args[1:]]
    getattr(importlib.import_module(module), entry)()
