"""``validate``: run-real and simulate on the same trace, policy, options and profile.

Prints, per policy, simulated vs measured metrics with their error and the cost model's
per-step error; writes validation.json beside both runs' directories::

    OUT/validation.json  OUT/sim/  OUT/real/ [OUT/real-2/ ...]      (one policy)
    OUT/validation.json  OUT/<policy>/{validation.json,sim,real}     (--policy all)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from .common import check_kv_tokens, fail, make_app, parse_options, run_app

validate_app = make_app(
    "Run a policy for real (MLX) and in simulation on the same trace and profile, and print "
    "how far the simulation is from the measurement (metrics and per-step cost-model error).")


@validate_app.command()
def validate(
    policy: str = typer.Option(..., "--policy", "-p", help="a policy name, several (a,b), or 'all' (the six bundled)"),
    trace: str = typer.Option(..., "--trace", "-t", help="trace file, or a bundled trace's bare name (e.g. real-smoke)"),
    model: str = typer.Option("tiny", "--model", "-m", help="preset (micro, tiny, small) or a local mlx-lm checkpoint directory"),
    dtype: str = typer.Option("float32", "--dtype", help="float32, float16 or bfloat16"),
    option: Optional[List[str]] = typer.Option(None, "--option", "-o", help="policy option key=value (repeatable)"),
    profile: Optional[str] = typer.Option(None, "--profile", help="cost profile (default: the bundled one if it matches this model and machine, else calibrate --quick first)"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="use the analytic roofline model of this hardware preset instead of a profile, for the simulation and the real runs' predictions (cpu-local: this machine, with factors fitted by calibrate --analytic where a matching profile has them)"),
    kv_tokens: Optional[int] = typer.Option(None, "--kv-tokens", help="KV capacity in tokens (default: the profile's)"),
    seed: int = typer.Option(0, "--seed", help="seed for the trace and the prompt ids"),
    repeat: int = typer.Option(1, "--repeat", help="real runs per policy (reports their spread)"),
    out: Optional[Path] = typer.Option(None, "--out", help="output directory (default: validate-<trace>)"),
    noise: Optional[str] = typer.Option(None, "--noise", help="settings that may lower the real runs' spread, to compare: "
                                        "gc-off, pin=CPUS (0-1), warmup=N (comma-separated; see engine/noise.py; also "
                                        "$SCHEDLAB_NOISE)"),
    residuals: bool = typer.Option(False, "--residuals", help="print the per-step residual table (measured/predicted "
                                   "by rows, tokens, context, joins/leaves, idle gap, batch change)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="only the tables"),
) -> None:
    """Validate the simulator against the real engine for POLICY on TRACE."""
    from engine import blas  # OpenBLAS before mlx
    from engine.models import check_spec
    from policies import POLICIES, make_policy

    import traces

    names = list(POLICIES) if policy == "all" else [p.strip() for p in policy.split(",") if p.strip()]
    if not names:
        fail("--policy is empty", 2)
    opts = parse_options(option)
    policies = {n: make_policy(n, opts) for n in names}  # bad names/options fail here, before any run
    tr = traces.load(trace, seed=seed)
    check_spec(model, dtype)
    if repeat < 1:
        fail(f"--repeat must be >= 1, got {repeat}", 2)
    if hardware and profile:
        fail("give either --profile or --hardware, not both", 2)
    if hardware:
        from analysis.analytic import list_hardware

        if hardware.strip().lower() not in list_hardware():
            fail(f"unknown hardware '{hardware}' (presets: {', '.join(list_hardware())}; "
                 "cpu-local is this machine)", 2)
    check_kv_tokens(kv_tokens)
    from .real import _noise_option

    _noise_option(noise)  # checked, and in the environment: every backend and calibration here uses it
    out = out or Path(f"validate-{tr.name}")
    if out.exists() and not out.is_dir():
        fail(f"--out {out} exists and is not a directory")

    from engine.models import load_model

    info = load_model(model, dtype=dtype)
    info.check_trace(tr.requests)
    blas.notify_if_missing()

    def say(msg: str) -> None:
        if not quiet:
            print(f"validate: {msg}", file=sys.stderr, flush=True)

    out.mkdir(parents=True, exist_ok=True)
    cost, capacity, cost_meta = _pick_cost(profile, hardware, kv_tokens, info, out, say)

    from analysis.validation import format_table

    results = {}
    for name, pol in policies.items():
        pdir = out if len(policies) == 1 else out / name
        v = validate_one(pol, tr, info, cost, capacity, pdir, repeat, seed, cost_meta, say)
        results[name] = v
        print(format_table(v))
        if residuals and v.get("residuals"):
            from analysis.residuals import format_residuals

            print(format_residuals(v["residuals"], "per-step residuals over the real runs (measured / predicted):"))
        print()
    if len(results) > 1:
        summary = {"trace": tr.name, "model": info.name, "cost_model": cost_meta, "policies": {
            n: {k: v[k] for k in ("median_abs_error_pct", "max_abs_error_pct", "step_error_pct", "machine_speed")
                if k in v}
            for n, v in results.items()}}
        (out / "validation.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(format_overview(results))
    print(f"wrote {out}")


def validate_one(pol, tr, info, cost, capacity, pdir: Path, repeat: int, seed: int,
                 cost_meta: dict, say, speed_check_runs: bool = True) -> dict:
    """One policy: the simulation and ``repeat`` real runs. The real runs plan and predict with
    the same cost model as the simulation: the policy sees the same estimates on both sides, and
    steps.parquet's predicted_s (the per-step error) is that model's, analytic with --hardware."""
    from engine.backend import MLXBackend
    from engine.calibrate import speed_check
    from sim import run
    from sim.metrics import summarize
    from sim.features import step_table
    from sim.output import write_run
    from analysis.residuals import bias, concat, residual_table
    from analysis.validation import compare

    meta = {"cost_model": cost_meta, "kv_tokens": capacity, "seed": seed, "policy_options": pol.options()}
    say(f"{pol.name}: simulating")
    sim_res = run(tr.requests, pol, cost, kv_capacity=capacity, trace_name=tr.name)
    sim_sum = summarize(sim_res)
    write_run(pdir / "sim", sim_res, sim_sum, meta=meta)
    speed_ref = _speed_reference(cost_meta) if speed_check_runs else None
    speed = {}
    if speed_ref is not None:
        say(f"{pol.name}: timing the profile's reference passes (the machine's speed now)")
        speed["before"] = speed_check(info, speed_ref, seed=seed)
    reals, steps, tables = [], [], []
    for k in range(repeat):
        say(f"{pol.name}: real run {k + 1}/{repeat}")
        res = run(tr.requests, pol, cost, kv_capacity=capacity,
                  backend=MLXBackend(info, seed=seed, ignore_eos=True), trace_name=tr.name)
        s = summarize(res)
        write_run(pdir / ("real" if k == 0 else f"real-{k + 1}"), res, s, meta=meta)
        if res.error:
            fail(f"{pol.name}: real run stopped: {res.error}")
        reals.append(s)
        steps.extend(res.steps)
        tables.append(step_table(res))
    if speed_ref is not None:
        speed["after"] = speed_check(info, speed_ref, seed=seed)
    v = compare(sim_sum, reals, policy=pol.name, trace=tr.name, real_steps=steps)
    feats = concat(tables)
    v["step_bias"] = bias(feats)
    v["residuals"] = residual_table(feats)
    if speed_ref is not None:
        v["machine_speed"] = speed
        adj = drift_adjusted(pol, tr, cost, capacity, speed, reals, steps)
        if adj is not None:
            v["drift_adjusted"] = adj
    v["model"] = info.name
    v["cost_model"] = cost_meta
    v["sim_dir"] = "sim"
    v["real_dirs"] = ["real" if k == 0 else f"real-{k + 1}" for k in range(repeat)]
    (pdir / "validation.json").write_text(json.dumps(v, indent=2) + "\n")
    return v


def drift_adjusted(pol, tr, cost, capacity, speed: dict, reals: list, steps: list) -> dict | None:
    """The simulation again with every pass scaled by the machine's measured speed during the
    real runs (the mean of the before/after ratios), compared with the same real runs: how far
    the model is once the machine's drift is taken out. Reported beside the plain comparison,
    never instead of it."""
    from sim import run
    from sim.cost import ScaledCostModel
    from sim.metrics import summarize
    from analysis.validation import compare

    ratios = [r["ratio"] for r in (speed.get("before"), speed.get("after")) if r and r.get("ratio")]
    if not ratios:
        return None
    factor = sum(ratios) / len(ratios)
    res = run(tr.requests, pol, ScaledCostModel(cost, factor), kv_capacity=capacity, trace_name=tr.name)
    scaled = [s._replace(predicted_s=s.predicted_s * factor) for s in steps]
    c = compare(summarize(res), reals, policy=pol.name, trace=tr.name, real_steps=scaled)
    return {"speed_factor": factor, "median_abs_error_pct": c["median_abs_error_pct"],
            "max_abs_error_pct": c["max_abs_error_pct"], "step_error_pct": c["step_error_pct"],
            "error_pct": {k: r["error_pct"] for k, r in c["metrics"].items()}}


def _speed_reference(cost_meta: dict) -> dict | None:
    """The measured profile the speed check times against (None for an analytic model)."""
    path = cost_meta.get("profile")  # analytic: only cpu-local factors fitted to a profile name one
    if not path:
        return None
    try:
        prof = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return prof if isinstance(prof, dict) and prof.get("samples") else None


def _pick_cost(profile, hardware, kv_tokens, info, out: Path, say):
    """(cost model, KV capacity, description) for both sides of the validation.

    Without ``hardware``: the linear model of a measured profile (``find_or_calibrate``).
    With it: the analytic roofline of the engine's model (its config; the dtype's width for
    weights and KV) on that hardware preset. On ``cpu-local`` its factors are the ones fitted
    to this model on this machine where a matching profile has them (``calibrate
    --analytic``), else fitted now to a matching profile's stored samples, else the priors;
    one line says which.
    """
    from sim.cost import DEFAULT_KV_TOKENS

    if hardware:
        cost, meta = analytic_cost(hardware, info)
        print(f"validate: note: {meta['factors_note']}", file=sys.stderr)
        return cost, kv_tokens or DEFAULT_KV_TOKENS, meta
    from sim.cost import LinearCostModel
    from engine.calibrate import find_or_calibrate

    path, note = find_or_calibrate(profile, info, out, say)
    if note:
        print(f"validate: note: {note}", file=sys.stderr)
    cost = LinearCostModel.from_profile(path)
    capacity = kv_tokens or int(cost.meta.get("kv_tokens", DEFAULT_KV_TOKENS))
    return cost, capacity, {"kind": "linear", "profile": str(path)}


def _matching_profiles(info):
    """Profiles measured on this model and machine: bundled ones, then calibrate's cache."""
    from engine.calibrate import candidate_profiles, profile_mismatch

    for path in candidate_profiles(info):
        try:
            prof = json.loads(path.read_text())
            if isinstance(prof, dict) and profile_mismatch(prof, info) is None:
                yield path, prof
        except Exception:  # a broken file is no match
            continue


def analytic_cost(hardware: str, info):
    """(analytic cost model, description) of ``info``'s model on ``hardware``."""
    from engine.calibrate import analytic_bits
    from analysis.analytic import analytic_from_config, load_hardware
    from analysis.analytic.local import BLOCK_KEY, block_mismatch, efficiency_from_block, fit_local

    bits, kv_bits = analytic_bits(info)
    hw = load_hardware(hardware)
    name = str(info.name)
    factors, source = "preset", f"{hw.name}'s preset factors ({hw.efficiency.basis}); not measured on this machine"
    fitted_from = None
    if hw.name == "cpu-local":
        factors, source = "prior", (f"no profile of {name} measured on this machine: cpu-local's prior factors "
                                    f"(fit them with calibrate --analytic)")
        for path, prof in _matching_profiles(info):
            block = prof.get(BLOCK_KEY)
            why = block_mismatch(block, name, bits, kv_bits) if block is not None else "none"
            if block is not None and why is None:
                hw, _ = efficiency_from_block(block, hw)
                factors, source = "fitted", f"cpu-local factors fitted for {name} on this machine, from {path}"
                fitted_from = path
                break
            if isinstance(prof.get("samples"), list) and prof["samples"]:
                try:
                    block = fit_local(prof["samples"], info.config, name=name, quant=bits, kv_bits=kv_bits, hardware=hw)
                except ValueError:
                    continue
                hw, _ = efficiency_from_block(block, hw)
                factors, source = "fitted-now", (f"cpu-local factors fitted now to the samples of {path} "
                                                 f"(store them with calibrate --analytic)")
                fitted_from = path
                break
    cost = analytic_from_config(hw, info.config, bits, name=name, kv_bits=kv_bits)
    meta = {"kind": "analytic", "hardware": hw.name, "factors": factors, "factors_note": source,
            "analytic": cost.meta()}
    if fitted_from is not None:  # the profile whose passes the factors were fitted to
        meta["profile"] = str(fitted_from)
    return cost, meta


def format_overview(results: dict) -> str:
    lines = [f"{'policy':<18}{'median |err| %':>16}{'max |err| %':>13}{'step p50 %':>12}{'step p90 %':>12}"]
    for n, v in results.items():
        se = v["step_error_pct"]

        def f(x):
            return "-" if x is None else f"{x:.1f}"
        lines.append(f"{n:<18}{f(v['median_abs_error_pct']):>16}{f(v['max_abs_error_pct']):>13}"
                     f"{f(se.get('p50')):>12}{f(se.get('p90')):>12}")
    return "\n".join(lines)


def validate_main() -> None:
    run_app(validate_app, "validate")
