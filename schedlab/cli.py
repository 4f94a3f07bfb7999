"""Console scripts. Each is a small Typer app; errors are one line (schedlab.common)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from .common import fail, make_app, parse_kv_floats, parse_options, run_app

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
    out: Optional[Path] = typer.Option(None, "--out", help="write summary.json, requests.csv, tokens.csv, steps.csv here"),
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
    tr = traces.load(trace, seed=seed)
    cost, capacity, cost_meta = pick_cost_model(profile, kv_tokens, hardware, model_config, quant)
    slos = parse_kv_floats(slo, "SLO")
    result = run(tr.requests, pol, cost, kv_capacity=capacity, trace_name=tr.name)
    summary = summarize(result, slo=slos or None)
    if out is not None:
        write_run(out, result, summary, meta={**cost_meta, "kv_tokens": capacity,
                                              "seed": seed, "policy_options": _options(pol)})
    if not quiet:
        print(format_summary(summary))
    report_problems(result, summary)


def pick_cost_model(profile, kv_tokens, hardware, model_config, quant):
    """A measured profile (default), or the analytic model of --hardware/--model-config."""
    if hardware is None and model_config is None:
        if quant is not None:
            fail("--quant goes with --hardware and --model-config", 2)
        cost, capacity, path = load_cost_model(profile, kv_tokens)
        return cost, capacity, {"profile": str(path)}
    if not (hardware and model_config):
        fail("--hardware and --model-config go together", 2)
    if profile is not None:
        fail("give either --profile or --hardware/--model-config, not both", 2)
    from analysis.analytic import make_analytic_cost_model

    cost, capacity, meta = make_analytic_cost_model(hardware, model_config, quant)
    if kv_tokens is not None:
        if kv_tokens < 1:
            fail(f"--kv-tokens must be >= 1, got {kv_tokens}", 2)
        capacity = kv_tokens
    return cost, capacity, {"analytic": meta}


def load_cost_model(profile: str | None, kv_tokens: int | None):
    from sim.cost import LinearCostModel
    from sim.profiles import resolve_profile

    path = resolve_profile(profile)
    cost = LinearCostModel.from_profile(path)
    capacity = kv_tokens if kv_tokens is not None else int(cost.meta.get("kv_tokens", 262144))
    if capacity < 1:
        fail(f"--kv-tokens must be >= 1, got {capacity}", 2)
    return cost, capacity, path


def _options(pol) -> dict:
    get = getattr(pol, "options", None)
    return get() if callable(get) else {}


def report_problems(result, summary) -> None:
    """Rejected requests and aborted runs: one line each, non-zero exit (the rest is kept)."""
    import sys

    lines = []
    if result.rejected:
        shown = ", ".join(f"{r.id} ({r.kv_footprint})" for r, _ in result.rejected[:5])
        more = f" and {len(result.rejected) - 5} more" if len(result.rejected) > 5 else ""
        lines.append(f"{len(result.rejected)} request(s) rejected: their prompt + output exceeds "
                     f"the KV capacity of {result.rejected[0][1].split('capacity is ')[-1]} tokens: "
                     f"{shown}{more}; the other requests ran")
    if result.error:
        lines.append(result.error)
    for line in lines:
        print(f"{Path(sys.argv[0]).name}: error: {line}", file=sys.stderr)
    if lines:
        raise typer.Exit(1)


def simulate_main() -> None:
    run_app(simulate_app, "simulate")
