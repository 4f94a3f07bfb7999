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

from .common import (check_kv_tokens, load_cost_model, make_app, parse_options, parse_slo, policy_options,
                     report_problems, run_app)

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
    seed: int = typer.Option(0, "--seed", help="seed for the trace and the prompt token ids"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="generate exactly each request's output_tokens, past the model's EOS (as vllm bench serve --ignore-eos)"),
    model_seed: int = typer.Option(0, "--model-seed", help="seed of a preset's random weights"),
    sampling: str = typer.Option("greedy", "--sampling", help="greedy, or temperature=0.7,seed=1"),
    out: Optional[Path] = typer.Option(None, "--out", help="write summary.json, requests.csv, texts.jsonl, steps/tokens/passes.parquet, meta.json here"),
    slo: Optional[str] = typer.Option(None, "--slo", help="goodput SLOs, e.g. ttft_ms=2000,tpot_ms=100"),
    noise: Optional[str] = typer.Option(None, "--noise", help="settings that may lower the real runs' spread, to compare: "
                                        "gc-off, pin=CPUS (0-1), warmup=N (comma-separated; see engine/noise.py; also "
                                        "$SCHEDLAB_NOISE)"),
    residuals: bool = typer.Option(False, "--residuals", help="print the per-step residual table (measured/predicted "
                                   "by rows, tokens, context, joins/leaves, idle gap, batch change)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors and warnings"),
) -> None:
    """Run POLICY on TRACE with a real model and print the summary."""
    # Fast checks first: nothing here imports mlx (engine loads OpenBLAS before mlx). The
    # trace is read once the model is loaded: text prompts are counted with its tokenizer.
    from engine import blas
    from engine.models import check_spec, load_model
    from engine.sampling import parse_sampling
    from policies import make_policy

    import traces

    pol = make_policy(policy, parse_options(option))
    slos = parse_slo(slo)
    check_spec(model, dtype)
    sampler = parse_sampling(sampling)
    check_kv_tokens(kv_tokens)
    noise = _noise_option(noise)

    warnings: list[str] = []
    if profile is not None:
        from sim.profiles import resolve_profile

        resolve_profile(profile)  # a bad --profile fails before the model loads
    info = load_model(model, dtype=dtype, seed=model_seed)
    tok = info.tokenizer
    tr = traces.load(trace, seed=seed, tokenizer=tok, recount=tok is not None)
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

    backend = MLXBackend(info, sampling=sampler, seed=seed, ignore_eos=ignore_eos)
    result = run(tr.requests, pol, cost, kv_capacity=capacity, backend=backend, trace_name=tr.name,
                 on_step=_progress(tr, quiet))
    summary = summarize(result, slo=slos or None)
    from analysis.residuals import bias, bias_line
    from sim.features import step_table

    step_bias = bias(step_table(result))
    if out is not None:
        write_run(out, result, summary, meta={
            "profile": str(profile_path), "kv_tokens": capacity, "seed": seed, "model_seed": model_seed,
            "policy_options": policy_options(pol), "warnings": warnings, "step_bias": step_bias,
            "noise": noise.describe(),
        })
        backend.write_texts(Path(out) / "texts.jsonl", result.requests)
    if not quiet:
        print(format_summary(summary))
        line = bias_line(step_bias)
        if line:
            print(line)
        if residuals:
            from analysis.residuals import format_residuals, residual_table

            print(format_residuals(residual_table(step_table(result)), "per-step residuals (measured / predicted):"))
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


def _noise_option(spec: str | None):
    """The --noise settings (engine.noise), checked; set in the environment so that a calibration
    made in this process runs under them too."""
    import os

    from engine.noise import ENV, Noise

    noise = Noise.parse(spec if spec is not None else os.environ.get(ENV))
    if spec is not None:
        os.environ[ENV] = spec
    return noise


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
