"""``run-real``: run a policy over a trace on the real MLX engine (same loop as ``simulate``).

The policy, the request state machine, the metrics and the run directory are those of
``simulate``; only the backend (``engine.backend.MLXBackend``) and the clock (wall time)
differ. steps.csv holds each step's measured seconds and, when a cost profile is
available, the profile's predicted seconds for the same step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from .common import fail, make_app, parse_kv_floats, parse_options, run_app

real_app = make_app(
    "Run a scheduling policy over a trace on a real MLX model (CPU or Metal) and print the "
    "`vllm bench serve` summary, with measured and predicted step times.")

DEFAULT_KV_TOKENS = 262144


@real_app.command()
def run_real(
    policy: str = typer.Option(..., "--policy", "-p", help="bundled policy name or file.py:Class"),
    trace: str = typer.Option(..., "--trace", "-t", help="trace file, or a bundled trace's bare name (e.g. real-smoke)"),
    model: str = typer.Option("tiny", "--model", "-m", help="preset (micro, tiny, small, smollm2-135m), a llama .gguf file or a local mlx-lm checkpoint directory"),
    dtype: str = typer.Option("float32", "--dtype", help="float32, float16, bfloat16, quantized (keep a quantized model's packed weights) or auto"),
    option: Optional[List[str]] = typer.Option(None, "--option", "-o", help="policy option key=value (repeatable)"),
    profile: Optional[str] = typer.Option(None, "--profile", help="cost-model profile JSON for predicted_s (default: the bundled one, if any)"),
    kv_tokens: Optional[int] = typer.Option(None, "--kv-tokens", help=f"KV cache capacity in tokens (default: the profile's, else {DEFAULT_KV_TOKENS})"),
    seed: int = typer.Option(0, "--seed", help="seed for the trace and the prompt token ids"),
    model_seed: int = typer.Option(0, "--model-seed", help="seed of a preset's random weights"),
    sampling: str = typer.Option("greedy", "--sampling", help="greedy, or temperature=0.7,seed=1"),
    out: Optional[Path] = typer.Option(None, "--out", help="write summary.json, requests.csv, tokens.csv, steps.csv, meta.json here"),
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
    tr = traces.load(trace, seed=seed)
    slos = parse_kv_floats(slo, "SLO")
    check_spec(model, dtype)
    sampler = parse_sampling(sampling)
    if kv_tokens is not None and kv_tokens < 1:
        fail(f"--kv-tokens must be >= 1, got {kv_tokens}", 2)

    warnings: list[str] = []
    if profile is not None:
        from sim.profiles import resolve_profile

        resolve_profile(profile)  # a bad --profile fails before the model loads
    info = load_model(model, dtype=dtype, seed=model_seed)
    info.check_trace(tr.requests)
    cost, capacity, profile_path, profile_blas = _cost_model(profile, kv_tokens, warnings, info)
    engine_blas = blas.info()
    mismatch = _blas_mismatch(profile_blas, engine_blas)
    if mismatch:
        warnings.append(mismatch)
        print(f"run-real: warning: {mismatch}", file=sys.stderr)

    from engine.backend import MLXBackend
    from sim import run
    from sim.metrics import format_summary, summarize
    from sim.output import write_run

    from .cli import report_problems

    backend = MLXBackend(info, sampling=sampler, seed=seed)
    result = run(tr.requests, pol, cost, kv_capacity=capacity, backend=backend, trace_name=tr.name,
                 on_step=_progress(tr, quiet))
    if profile_path is None:
        # no profile: no prediction (an empty cell), not a zero one
        result.steps[:] = [s._replace(predicted_s=None) for s in result.steps]
    summary = summarize(result, slo=slos or None)
    if out is not None:
        get = getattr(pol, "options", None)
        write_run(out, result, summary, meta={
            "profile": str(profile_path) if profile_path else None,
            "kv_tokens": capacity, "seed": seed, "model_seed": model_seed,
            "policy_options": get() if callable(get) else {},
            "warnings": warnings,
        })
    if not quiet:
        print(format_summary(summary))
    report_problems(result, summary)


def _cost_model(profile: str | None, kv_tokens: int | None, warnings: list[str], info):
    """(cost model, KV capacity, profile path or None, the profile's BLAS or None).

    Without --profile, the bundled profile is used only when it was measured on this model
    and machine; otherwise predicted_s stays empty (a prediction for another model would
    only mislead). With --profile, the file is used, with a warning if it does not match.
    """
    from engine.calibrate import profile_mismatch
    from sim.cost import LinearCostModel, ProfileError, read_profile
    from sim.profiles import resolve_profile

    from .cli import load_cost_model

    if profile is None:
        why = None
        try:
            why = profile_mismatch(read_profile(resolve_profile(None)), info)
        except ProfileError:
            why = "no profile is bundled"
        if why:
            note = (f"no cost profile for model {info.name} on this machine ({why}): steps.csv's "
                    f"predicted_s is left empty (run `calibrate --model {info.name}` and give --profile)")
            warnings.append(note)
            print(f"run-real: note: {note}", file=sys.stderr)
            return LinearCostModel({}), kv_tokens or DEFAULT_KV_TOKENS, None, None
    cost, capacity, path = load_cost_model(profile, kv_tokens)
    if profile is not None:
        why = profile_mismatch(cost.meta, info)
        if why:
            note = f"profile {path.name} was not measured on this model and machine: {why}"
            warnings.append(note)
            print(f"run-real: warning: {note}", file=sys.stderr)
    return cost, capacity, path, cost.meta.get("blas")


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
