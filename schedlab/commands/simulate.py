"""``simulate``: a scheduling policy over a trace with a calibrated cost model (``schedlab.simulate``)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ._app import (
    BLOCK_SIZE_HELP,
    BURST_HELP,
    CONCURRENCY_HELP,
    PREFIX_HELP,
    RATE_HELP,
    THINK_HELP,
    fail,
    make_app,
    out_path,
    parse_options,
    report_problems,
    run_app,
)

SPECULATIVE_HELP = (
    "speculative decoding, every replica's policy drafting tokens: ngram:k=4,accept=0.8/0.6/0.4/0.3 (accept: the "
    "acceptance of each draft position the simulation draws from, or a JSON file holding it: a run's summary.json, "
    "a calibrate --speculative profile, a trace; without accept=, the trace's own speculative_acceptance; "
    "adaptive=true: k chosen per step, at most k; seed=N: the draws' seed); draft:model=M,k=3,accept=...: drafted "
    "by draft model M, whose passes are priced by its bundled profile or draft_profile=PATH"
)

simulate_app = make_app(
    "Simulate a scheduling policy over a trace with a calibrated cost model and print the `vllm bench serve` summary."
)


KV_TOKENS_HELP = (
    "KV cache capacity in tokens, in whole --block-size blocks (rounded down; default: the profile's, or what "
    "--hardware's memory holds)"
)
QUANT_HELP = (
    "with --hardware: weight bits (4, 8, 16; default: as the config ships them, its dtype, gpt-oss's experts MXFP4)"
)


@simulate_app.command()
def simulate(
    policy: Optional[str] = typer.Option(
        None,
        "--policy",
        "-p",
        help="mlx-default, prefer-prefill, static, slots, chunked-prefill, unified, vllm, or file.py:Class / "
        "module:Class (required unless --cluster)",
    ),
    trace: str = typer.Option(
        ..., "--trace", "-t", help="trace file, or a bundled trace's bare name (e.g. mixed.json)"
    ),
    option: Optional[List[str]] = typer.Option(None, "--option", "-o", help="policy option key=value (repeatable)"),
    profile: Optional[str] = typer.Option(
        None, "--profile", help="cost-model profile JSON (default: the bundled measured profile)"
    ),
    kv_tokens: Optional[int] = typer.Option(
        None,
        "--kv-tokens",
        help=KV_TOKENS_HELP,
    ),
    hardware: Optional[str] = typer.Option(
        None,
        "--hardware",
        help="analytic roofline model on a hardware preset (m4-max, h100-sxm, cpu-local, ...) instead of a measured profile",
    ),
    model_config: Optional[str] = typer.Option(
        None,
        "--model-config",
        help="with --hardware: a bundled model config (llama-3.1-8b, qwen3-30b-a3b, ...) or a config.json path",
    ),
    quant: Optional[int] = typer.Option(None, "--quant", help=QUANT_HELP),
    block_size: int = typer.Option(16, "--block-size", help=BLOCK_SIZE_HELP),
    prefix_caching: bool = typer.Option(False, "--prefix-caching", help=PREFIX_HELP),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help=CONCURRENCY_HELP),
    request_rate: Optional[str] = typer.Option(None, "--request-rate", help=RATE_HELP),
    burstiness: Optional[float] = typer.Option(None, "--burstiness", help=BURST_HELP),
    think_time: Optional[float] = typer.Option(None, "--think-time", help=THINK_HELP),
    seed: int = typer.Option(0, "--seed", help="seed for trace jitter/thinning and the --request-rate schedule"),
    out: Optional[Path] = typer.Option(
        None, "--out", parser=out_path, help="write summary.json, requests.csv, steps/tokens.parquet, meta.json here"
    ),
    passes: bool = typer.Option(
        False,
        "--passes",
        help="with --out: also write passes.parquet (one row per request per pass: exact timelines for plot; ~4 M rows for an hour of traffic)",
    ),
    slo: Optional[str] = typer.Option(None, "--slo", help="goodput SLOs, e.g. ttft_ms=2000,tpot_ms=100"),
    replicas: int = typer.Option(
        1, "--replicas", help="replicas behind a router, each with its own copy of the policy, KV cache and backend"
    ),
    router: Optional[str] = typer.Option(
        None,
        "--router",
        help="which replica serves each arrival: round-robin (the default with --replicas), random, least-requests, "
        "least-tokens, least-kv, power-of-two, prefix-affinity, weighted, or file.py:Class",
    ),
    router_option: Optional[List[str]] = typer.Option(
        None, "--router-option", help="router option key=value (repeatable), e.g. seed=1 or max_requests=8"
    ),
    router_delay: Optional[float] = typer.Option(
        None,
        "--router-delay",
        help="seconds by which the router's view of each replica lags (stale signals; default 0)",
        show_default=False,
    ),
    fail_at: Optional[List[str]] = typer.Option(
        None,
        "--fail",
        help="REPLICA@SECONDS: that replica dies then (repeatable): the router sees it down, its requests with no "
        "token yet go to another replica once, those with tokens are refused",
    ),
    cluster_file: Optional[Path] = typer.Option(
        None,
        "--cluster",
        help="a cluster file (TOML, see docs/cluster.md): [[group]] tables of replicas, each group its own policy, "
        "options, cost model (profile, or hardware + model_config) and kv_tokens, and the router. The file names the "
        "policies and cost models: --policy, -o, --profile, --hardware, --model-config, --quant, --kv-tokens and "
        "--replicas are errors beside it; --router, --router-option and --router-delay override the file's",
    ),
    speculative: Optional[str] = typer.Option(None, "--speculative", help=SPECULATIVE_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors"),
) -> None:
    """Simulate POLICY on TRACE and print the summary."""
    import schedlab

    if passes and out is None:
        fail("--passes writes passes.parquet into the --out directory: give --out DIR too", 2)
    if policy is None and cluster_file is None:
        fail("Missing option '--policy' / '-p' (or give --cluster FILE)", 2)
    replica = schedlab.ReplicaOptions(kv_tokens=kv_tokens, block_size=block_size, prefix_caching=prefix_caching)
    clients = schedlab.ClientOptions(
        max_concurrency=max_concurrency, request_rate=request_rate, burstiness=burstiness, think_time=think_time
    )
    _refuse_beside_file(cluster_file, policy, option, profile, hardware, model_config, quant, kv_tokens, replicas)
    cluster = _cluster_options(cluster_file, replicas, router, router_option, router_delay, fail_at)
    run = schedlab.simulate(
        policy,
        trace,
        options=parse_options(option),
        profile=profile,
        hardware=hardware,
        model_config=model_config,
        quant=quant,
        seed=seed,
        slo=slo,
        replica=replica,
        clients=clients,
        cluster=cluster,
        passes=passes,
        speculative=speculative,
    )
    if out is not None:
        run.save(out)
    if not quiet:
        print(run.report())
    report_problems(run)


def _refuse_beside_file(cluster_file, policy, option, profile, hardware, model_config, quant, kv_tokens, replicas):
    """A cluster file names the policies and cost models: the first flag given that would too
    is an error (exit 2) beside it."""
    if cluster_file is None:
        return
    given = {
        "--policy": policy is not None,
        "-o/--option": bool(option),
        "--profile": profile is not None,
        "--hardware": hardware is not None,
        "--model-config": model_config is not None,
        "--quant": quant is not None,
        "--kv-tokens": kv_tokens is not None,
        "--replicas": replicas != 1,
    }
    clash = [flag for flag, g in given.items() if g]
    if clash:
        fail(f"--cluster {cluster_file} says {_CLUSTER_SAYS[clash[0]]}: drop {clash[0]}, or change the file", 2)


def _cluster_options(cluster_file, replicas, router, router_option, router_delay, fail_at):
    """The replicas, router and faults: the cluster file's (the command line's router settings
    and --fail over its), or the flags' alone."""
    import dataclasses

    import schedlab

    if cluster_file is not None:
        cluster = _from_file(cluster_file, router, router_option, router_delay)
        return dataclasses.replace(cluster, fail=tuple(fail_at)) if fail_at else cluster
    return schedlab.ClusterOptions(
        replicas=replicas,
        router=router,
        router_options=parse_options(router_option),
        router_delay=router_delay if router_delay is not None else 0.0,
        fail=tuple(fail_at or ()),
    )


_CLUSTER_SAYS = {
    "--policy": "each group's policy",
    "-o/--option": "each group's policy options (options = { ... })",
    "--profile": "each group's cost model",
    "--hardware": "each group's cost model",
    "--model-config": "each group's cost model",
    "--quant": "each group's cost model",
    "--kv-tokens": "each group's KV capacity (kv_tokens)",
    "--replicas": "how many replicas (each group's count)",
}


def _from_file(path, router, router_option, router_delay):
    """The cluster file's options, with the command line's router settings over the file's:
    --router replaces its router and router_options, --router-option sets options over the
    file's (or over none, with --router), --router-delay replaces its router_delay."""
    import dataclasses

    import schedlab

    base = schedlab.ClusterOptions.from_file(path)
    changes: dict = {}
    if router is not None:
        changes["router"], changes["router_options"] = router, None
    if router_option:
        kept = {} if router is not None else dict(base.router_options or {})
        changes["router_options"] = {**kept, **parse_options(router_option)}
    if router_delay is not None:
        changes["router_delay"] = router_delay
    return dataclasses.replace(base, **changes) if changes else base


def main() -> None:
    # one run per process: the cyclic collector would only walk the run's millions of objects
    # again and again (they hold almost no cycles, and the process ends with the run)
    gc.disable()
    run_app(simulate_app, "simulate")
    # done and written: leave without freeing the run's millions of objects one by one (a
    # tenth of a second on an hour of traffic); errors left above through SystemExit as usual
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
