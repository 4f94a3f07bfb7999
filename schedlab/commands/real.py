"""``run-real``: run a policy over a trace on the real MLX engine (same loop as ``simulate``).

The policy, the request state machine, the metrics and the run directory are those of
``simulate``; only the backend (``engine.backend.MLXBackend``) and the clock (wall time)
differ. The policy sees the same cost model as in ``simulate`` and ``validate``: the given
profile, else one measured on this model and machine (bundled or cached), else a quick
calibration made first (``--no-calibrate``: the bundled default profile, with a warning).
steps.parquet holds each step's measured seconds and that model's predicted seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import SchedlabError
from ._app import (
    BLOCK_SIZE_HELP,
    BURST_HELP,
    CONCURRENCY_HELP,
    DECODE_HELP,
    MODEL_HELP,
    NOISE_HELP,
    PREFILL_HELP,
    PREFIX_HELP,
    RATE_HELP,
    RAY_ADDRESS_HELP,
    THINK_HELP,
    log_to_stderr,
    make_app,
    out_path,
    parse_options,
    report_problems,
    replicas_stopped,
    run_app,
)

real_app = make_app(
    "Run a scheduling policy over a trace on a real MLX model (CPU or Metal) and print the "
    "`vllm bench serve` summary, with measured and predicted step times."
)


SPECULATIVE_HELP = (
    "speculative decoding: ngram:k=4 (every decode row verifies up to k draft tokens found by n-gram prompt "
    "lookup) or draft:model=M,k=3 (drafted by model M, a smaller one of the same vocabulary: a preset, a .gguf "
    "file or a checkpoint directory); greedy rows only; adaptive=true,accept=P1/P2/...: k chosen per step from "
    "that acceptance prior"
)


OUT_HELP = "write summary.json, requests.csv, texts.jsonl, steps/tokens/passes.parquet, meta.json here"


@real_app.command()
def run_real(
    policy: str = typer.Option(..., "--policy", "-p", help="bundled policy name or file.py:Class"),
    trace: str = typer.Option(
        ..., "--trace", "-t", help="trace file, or a bundled trace's bare name (e.g. real-smoke)"
    ),
    model: str = typer.Option(
        "tiny",
        "--model",
        "-m",
        help=MODEL_HELP,
    ),
    dtype: str = typer.Option(
        "float32",
        "--dtype",
        help="float32, float16, bfloat16, quantized (keep a quantized model's packed weights) or auto",
    ),
    option: Optional[List[str]] = typer.Option(None, "--option", "-o", help="policy option key=value (repeatable)"),
    profile: Optional[str] = typer.Option(
        None,
        "--profile",
        help="cost-model profile JSON (default: one measured on this model and machine, else calibrate --quick first)",
    ),
    no_calibrate: bool = typer.Option(
        False,
        "--no-calibrate",
        help="without a matching profile, use the bundled default profile instead of calibrating first",
    ),
    kv_tokens: Optional[int] = typer.Option(
        None, "--kv-tokens", help="KV cache capacity in tokens (default: the profile's)"
    ),
    block_size: int = typer.Option(16, "--block-size", help=BLOCK_SIZE_HELP),
    prefix_caching: bool = typer.Option(
        False, "--prefix-caching", help=PREFIX_HELP + "; the engine copies a cached prefix's keys/values"
    ),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help=CONCURRENCY_HELP),
    request_rate: Optional[str] = typer.Option(None, "--request-rate", help=RATE_HELP),
    burstiness: Optional[float] = typer.Option(None, "--burstiness", help=BURST_HELP),
    think_time: Optional[float] = typer.Option(None, "--think-time", help=THINK_HELP),
    seed: int = typer.Option(0, "--seed", help="seed for the trace and the prompt token ids"),
    ignore_eos: bool = typer.Option(
        False,
        "--ignore-eos",
        help="generate exactly each request's output_tokens, past the model's EOS (as vllm bench serve --ignore-eos)",
    ),
    model_seed: int = typer.Option(0, "--model-seed", help="seed of a preset's random weights"),
    sampling: str = typer.Option("greedy", "--sampling", help="greedy, or temperature=0.7,seed=1"),
    out: Optional[Path] = typer.Option(None, "--out", parser=out_path, help=OUT_HELP),
    slo: Optional[str] = typer.Option(None, "--slo", help="goodput SLOs, e.g. ttft_ms=2000,tpot_ms=100"),
    noise: Optional[str] = typer.Option(None, "--noise", help=NOISE_HELP),
    residuals: bool = typer.Option(
        False,
        "--residuals",
        help="print the per-step residual table (measured/predicted "
        "by rows, tokens, context, joins/leaves, idle gap, batch change)",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors and warnings"),
    replicas: int = typer.Option(
        1,
        "--replicas",
        help="replica processes behind a router (serve --replicas), fed the trace over HTTP at its arrival times",
    ),
    router: Optional[str] = typer.Option(
        None, "--router", help="with --replicas: which replica serves each request, as simulate --router"
    ),
    router_option: Optional[List[str]] = typer.Option(
        None, "--router-option", help="router option key=value (repeatable)"
    ),
    prefill: int = typer.Option(0, "--prefill", help=PREFILL_HELP),
    decode: int = typer.Option(0, "--decode", help=DECODE_HELP),
    executor: str = typer.Option(
        "local", "--executor", help="with --replicas: local (processes here) or ray (Ray actors, as serve --executor)"
    ),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help=RAY_ADDRESS_HELP),
    speculative: Optional[str] = typer.Option(None, "--speculative", help=SPECULATIVE_HELP),
) -> None:
    """Run POLICY on TRACE with a real model and print the summary."""
    import schedlab

    engine = schedlab.EngineOptions(
        model=model, dtype=dtype, sampling=sampling, noise=noise, model_seed=model_seed, ignore_eos=ignore_eos
    )
    replica = schedlab.ReplicaOptions(kv_tokens=kv_tokens, block_size=block_size, prefix_caching=prefix_caching)
    clients = schedlab.ClientOptions(
        max_concurrency=max_concurrency, request_rate=request_rate, burstiness=burstiness, think_time=think_time
    )
    cluster = replicas > 1 or bool(prefill or decode)
    if cluster and residuals:
        raise SchedlabError("--residuals does not go with --replicas (yet): see each replica's run directory", 2)
    with replicas_stopped(cluster):
        run = schedlab.run_real(
            policy,
            trace,
            options=parse_options(option),
            profile=profile,
            no_calibrate=no_calibrate,
            seed=seed,
            slo=slo,
            log=log_to_stderr("run-real", quiet),
            on_step=None if cluster else _progress(quiet),
            engine=engine,
            replica=replica,
            clients=clients,
            replicas=replicas,
            router=router,
            router_options=parse_options(router_option),
            prefill=prefill,
            decode=decode,
            out=out,
            executor=executor,
            ray_address=ray_address,
            speculative=speculative,
        )
    if cluster:  # (schedlab.serving.cluster: the front's summary; each replica's run directory in OUT)
        _cluster_report(run, quiet)
    else:
        _report(run, quiet, residuals)


def _cluster_report(run, quiet: bool) -> None:
    """A cluster's summary; the requests that failed, one line each, and exit status 1 if any."""
    if not quiet:
        print(run.report())
    for line in run.problems:
        print(f"run-real: error: {line}", file=sys.stderr)
    if run.problems:
        raise typer.Exit(1)


def _report(run, quiet: bool, residuals: bool) -> None:
    """One replica's summary, its steps' bias (and residuals); rejected requests and aborted runs."""
    if not quiet:
        from schedlab.analysis.residuals import bias_line, format_residuals

        print(run.report())
        line = bias_line(run.meta.get("step_bias"))
        if line:
            print(line)
        if residuals:
            table = run.residuals()
            print(
                format_residuals(
                    table.to_dict("records") if table is not None else [], "per-step residuals (measured / predicted):"
                )
            )
    report_problems(run)


def _progress(quiet: bool):
    """A one-line progress display on a terminal (nothing otherwise)."""
    if quiet or not sys.stderr.isatty():
        return None
    last = [-1]

    def on_step(finished: int, total: int) -> None:
        if finished != last[0]:
            last[0] = finished
            print(f"\r run-real: {finished}/{total} requests finished", end="", file=sys.stderr, flush=True)
            if finished >= total:
                print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)

    return on_step


def main() -> None:
    run_app(real_app, "run-real")
