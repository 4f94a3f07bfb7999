"""Console scripts. Each is a small Typer app; errors are one line (schedlab.common)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import make_app, parse_options, parse_slo, pick_cost_model, policy_options, report_problems, run_app

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
    from policies import make_policy
    from sim import run
    from sim.metrics import format_summary, summarize
    from sim.output import write_run

    import traces

    pol = make_policy(policy, parse_options(option))
    slos = parse_slo(slo)
    tr = traces.load(trace, seed=seed)
    cost, capacity, cost_meta = pick_cost_model(profile, kv_tokens, hardware, model_config, quant)
    result = run(tr.requests, pol, cost, kv_capacity=capacity, trace_name=tr.name)
    summary = summarize(result, slo=slos or None)
    if out is not None:
        write_run(out, result, summary, meta={**cost_meta, "kv_tokens": capacity,
                                              "seed": seed, "policy_options": policy_options(pol)})
    if not quiet:
        print(format_summary(summary))
    report_problems(result)


def simulate_main() -> None:
    run_app(simulate_app, "simulate")
