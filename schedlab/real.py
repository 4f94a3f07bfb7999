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

from .cli import BLOCK_SIZE_HELP, BURST_HELP, CONCURRENCY_HELP, PREFIX_HELP, RATE_HELP, THINK_HELP
from .common import (check_client_options, check_kv_layout, check_kv_tokens, load_cost_model, make_app,
                     make_arrivals, parse_options, parse_rate, parse_slo, policy_options, report_problems, run_app)

real_app = make_app(
    "Run a scheduling policy over a trace on a real MLX model (CPU or Metal) and print the "
    "`vllm bench serve` summary, with measured and predicted step times.")

@real_app.command()
def run_real(
    policy: str = typer.Option(..., "--policy", "-p", help="bundled policy name or file.py:Class"),
    trace: str = typer.Option(..., "--trace", "-t", help="trace file, or a bundled trace's bare name (e.g. real-smoke)"),
    model: str = typer.Option("tiny", "--model", "-m", help="preset (micro, tiny, small, smollm2-135m), a llama .gguf file or a local mlx-lm checkpoint directory"),
    dtype: str = typer.Option("float32", "--dtype", help="float32, float16, bfloat16, quantized (keep a quantized model's packed weights) or auto"),
    option: Optional[List[str]] = typer.Option(None, "--option", "-o", help="policy option key=value (repeatable)"),
    profile: Optional[str] = typer.Option(None, "--profile", help="cost-model profile JSON (default: one measured on this model and machine, else calibrate --quick first)"),
    no_calibrate: bool = typer.Option(False, "--no-calibrate", help="without a matching profile, use the bundled default profile instead of calibrating first"),
    kv_tokens: Optional[int] = typer.Option(None, "--kv-tokens", help="KV cache capacity in tokens (default: the profile's)"),
    block_size: int = typer.Option(16, "--block-size", help=BLOCK_SIZE_HELP),
    prefix_caching: bool = typer.Option(False, "--prefix-caching", help=PREFIX_HELP + "; the engine copies a cached prefix's keys/values"),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help=CONCURRENCY_HELP),
    request_rate: Optional[str] = typer.Option(None, "--request-rate", help=RATE_HELP),
    burstiness: Optional[float] = typer.Option(None, "--burstiness", help=BURST_HELP),
    think_time: Optional[float] = typer.Option(None, "--think-time", help=THINK_HELP),
    seed: int = typer.Option(0, "--seed", help="seed for the trace, the --request-rate schedule and the prompt token ids"),
    model_seed: int = typer.Option(0, "--model-seed", help="seed of a preset's random weights"),
    sampling: str = typer.Option("greedy", "--sampling", help="greedy, or temperature=0.7,seed=1"),
    out: Optional[Path] = typer.Option(None, "--out", help="write summary.json, requests.csv, steps/tokens/passes.parquet, meta.json here"),
    slo: Optional[str] = typer.Option(None, "--slo", help="goodput SLOs, e.g. ttft_ms=2000,tpot_ms=100"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors and warnings"),
) -> None:
    """Run POLICY on TRACE with a real model and print the summary."""
    # Fast checks first: nothing here imports mlx (engine loads OpenBLAS before mlx).
    from engine import blas
    from engine.models import check_spec, load_model
    from engine.sampling import parse_sampling
    from policies import make_policy

    import traces

    pol = make_policy(policy, parse_options(option))
    slos = parse_slo(slo)
    tr = traces.load(trace, seed=seed)
    check_spec(model, dtype)
    sampler = parse_sampling(sampling)
    check_kv_tokens(kv_tokens)
    check_kv_layout(block_size)
    rate = parse_rate(request_rate)
    check_client_options(max_concurrency, rate, burstiness, think_time)  # bad client options fail here

    warnings: list[str] = []
    if profile is not None:
        from sim.profiles import resolve_profile

        resolve_profile(profile)  # a bad --profile fails before the model loads
    info = load_model(model, dtype=dtype, seed=model_seed)
    info.check_trace(tr.requests)
    cost, capacity, profile_path = _cost_model(profile, kv_tokens, no_calibrate, warnings, info, quiet)
    mismatch = _blas_mismatch(cost.meta.get("blas"), blas.info())
    if mismatch:
        warnings.append(mismatch)
        print(f"run-real: warning: {mismatch}", file=sys.stderr)

    from engine.backend import MLXBackend
    from sim import run
    from sim.metrics import format_summary, summarize
    from sim.output import write_run

    backend = MLXBackend(info, sampling=sampler, seed=seed)
    arrivals = make_arrivals(tr.requests, max_concurrency, rate, burstiness, think_time, seed)
    result = run(arrivals, pol, cost, kv_capacity=capacity, backend=backend, trace_name=tr.name,
                 on_step=_progress(tr, quiet), block_size=block_size, prefix_caching=prefix_caching)
    summary = summarize(result, slo=slos or None)
    if out is not None:
        write_run(out, result, summary, meta={
            "profile": str(profile_path), "kv_tokens": capacity, "block_size": block_size,
            "prefix_caching": prefix_caching, "seed": seed, "model_seed": model_seed,
            "policy_options": policy_options(pol), "warnings": warnings,
        })
    if not quiet:
        print(format_summary(summary))
    report_problems(result)


def _cost_model(profile: str | None, kv_tokens: int | None, no_calibrate: bool, warnings: list[str],
                info, quiet: bool):
    """(cost model, KV capacity, profile path): the one the policy sees and steps are predicted with.

    ``--profile``: that file (a warning when it was measured elsewhere). Otherwise one measured
    on this model and machine (bundled, or calibrate's cache), else a quick calibration now
    (cached for the next run), as ``validate`` does; with ``--no-calibrate`` the bundled default
    profile, which ``simulate`` uses, with a warning that its predictions are for another setup.
    """
    from engine.calibrate import candidate_profiles, find_or_calibrate, profile_mismatch
    from sim.cost import read_profile
    from sim.profiles import resolve_profile

    def note(kind: str, text: str) -> None:
        warnings.append(text)
        print(f"run-real: {kind}: {text}", file=sys.stderr)

    if profile is None and no_calibrate:
        matching = []
        for p in candidate_profiles(info):
            try:
                if profile_mismatch(read_profile(p), info) is None:
                    matching.append(p)
            except Exception:  # a broken cache file is no match
                continue
        path = matching[0] if matching else resolve_profile(None)
        if not matching:
            note("warning", f"no cost profile for model {info.name} on this machine: the policy plans and "
                            f"steps.parquet's predicted_s come from the bundled {path.name} (measured elsewhere)")
    else:
        def say(msg: str) -> None:
            if not quiet:
                print(f"run-real: {msg}", file=sys.stderr, flush=True)

        path, why = find_or_calibrate(profile, info, None, say)
        if why:
            note("note" if profile is None else "warning", why)
    cost, capacity, path = load_cost_model(path, kv_tokens)
    return cost, capacity, path


def _blas_mismatch(profile_blas, engine_blas) -> str | None:
    """A one-line warning when the profile was measured under another BLAS or thread count."""
    if not isinstance(profile_blas, dict):
        return None
    want = (profile_blas.get("name"), profile_blas.get("threads"))
    have = (engine_blas.get("name"), engine_blas.get("threads"))
    if want[0] is None:
        return None
    if want[0] != have[0] or (want[1] is not None and want[1] != have[1]):
        return (f"the profile was measured with BLAS {want[0]} ({want[1]} threads) but the engine "
                f"uses {have[0]} ({have[1]} threads): predicted_s will be off")
    return None


def _progress(tr, quiet: bool):
    """A one-line progress display on a terminal (nothing otherwise)."""
    if quiet or not sys.stderr.isatty():
        return None
    last = [-1]

    def on_step(state) -> None:
        total = state.n_accepted
        if state.finished != last[0]:
            last[0] = state.finished
            print(f"\r run-real: {state.finished}/{total} requests finished", end="",
                  file=sys.stderr, flush=True)
            if state.finished >= total:
                print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)

    return on_step


def run_real_main() -> None:
    run_app(real_app, "run-real")
