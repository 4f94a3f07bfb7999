"""Console scripts. Each is a small Typer app over ``schedlab.api``; errors are one line
(schedlab.common)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import make_app, parse_options, report_problems, run_app

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
    seed: int = typer.Option(0, "--seed", help="seed for trace jitter/thinning"),
    out: Optional[Path] = typer.Option(None, "--out", help="write summary.json, requests.csv, steps/tokens/passes.parquet, meta.json here"),
    slo: Optional[str] = typer.Option(None, "--slo", help="goodput SLOs, e.g. ttft_ms=2000,tpot_ms=100"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors"),
) -> None:
    """Simulate POLICY on TRACE and print the summary."""
    from . import api

    run = api.simulate(policy, trace, options=parse_options(option), profile=profile, kv_tokens=kv_tokens,
                       hardware=hardware, model_config=model_config, quant=quant, seed=seed, slo=slo)
    if out is not None:
        run.save(out)
    if not quiet:
        print(run.report())
    report_problems(run)


def simulate_main() -> None:
    run_app(simulate_app, "simulate")
