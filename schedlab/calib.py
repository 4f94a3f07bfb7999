"""``calibrate``: measure the real engine and write the cost-model profile simulate uses."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from .common import fail, make_app, run_app

calibrate_app = make_app(
    "Time real passes of the MLX engine over a grid (decode batch x context, prefill chunk x "
    "context, padded multi-prompt prefill, mixed passes, the real loop's per-step overhead), "
    "fit the simulator's cost model and write it, with its fit report, as a profile JSON.")


@calibrate_app.command()
def calibrate(
    out: Path = typer.Option(..., "--out", help="profile JSON to write"),
    model: str = typer.Option("tiny", "--model", "-m", help="preset (micro, tiny, small) or a local mlx-lm checkpoint directory"),
    dtype: str = typer.Option("float32", "--dtype", help="float32, float16 or bfloat16"),
    quick: bool = typer.Option(False, "--quick", help="a smaller grid (under a minute for tiny on 2 cores)"),
    seed: int = typer.Option(0, "--seed", help="seed of the grid's order and the prompt ids"),
    model_seed: int = typer.Option(0, "--model-seed", help="seed of a preset's random weights"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress lines"),
    analytic: bool = typer.Option(False, "--analytic", help="also fit the analytic roofline's cpu-local factors to the samples "
                                  "and store them in the profile (key analytic_cpu_local; validate --hardware cpu-local uses them)"),
    from_profile: Optional[Path] = typer.Option(None, "--from-profile", help="with --analytic: time nothing, fit the factors to "
                                                "this profile's stored samples (same model and machine) and write it to OUT"),
    from_runs: bool = typer.Option(False, "--from-runs", help="time nothing: fit the cost model to the real runs' steps "
                                   "(RUNS: run-real --out or validate directories, their features.parquet), holding out "
                                   "whole runs; with --grid, on top of that grid profile's fit"),
    grid: Optional[Path] = typer.Option(None, "--grid", help="with --from-runs: a grid profile (calibrate) of the same "
                                        "model and machine whose fit gives the passes' shape dependence"),
    replay: bool = typer.Option(False, "--replay", help="the default calibration (what validate and run-real make when no "
                                "profile matches): the quick grid, then a short real replay of a few policies on a small "
                                "synthetic trace, fitted together (~1-3 min)"),
    keep_runs: Optional[Path] = typer.Option(None, "--keep-runs", help="with --replay: keep the replay's run directories here"),
    runs: Optional[List[Path]] = typer.Argument(None, help="with --from-runs: run directories", show_default=False),
) -> None:
    """Calibrate the cost model on this machine and write the profile to OUT."""
    if runs and not from_runs:
        fail("run directories go with --from-runs", 2)
    if from_runs:
        _from_runs(runs or [], grid, out, quiet)
        return
    if grid is not None:
        fail("--grid goes with --from-runs", 2)
    import engine  # noqa: F401  (OpenBLAS before mlx)
    from engine import blas
    from engine.models import check_spec

    check_spec(model, dtype)
    if out.exists() and out.is_dir():
        fail(f"--out {out} is a directory; give a file name")
    if not out.parent.exists():
        fail(f"--out: directory {out.parent} does not exist")
    if from_profile is not None and not analytic:
        fail("--from-profile goes with --analytic", 2)
    if from_profile is not None and not from_profile.is_file():
        fail(f"--from-profile {from_profile}: no such file")
    from engine.calibrate import calibrate as run_calibration, grid_for, write_profile
    from analysis.fit import format_report
    from engine.models import load_model

    info = load_model(model, dtype=dtype, seed=model_seed)
    blas.notify_if_missing()
    grid = grid_for(info, quick=quick)
    if keep_runs is not None and not replay:
        fail("--keep-runs goes with --replay", 2)

    def say(msg: str) -> None:
        if not quiet:
            print(f"calibrate: {msg}", file=sys.stderr, flush=True)

    if from_profile is not None:
        profile = _stored_profile(from_profile, info)
    elif replay:
        from engine.calibrate import calibrate_default

        profile = calibrate_default(info, seed=seed, progress=say, keep=keep_runs)
    else:
        profile = run_calibration(info, grid, seed=seed, progress=say)
    if analytic:
        from engine.calibrate import fit_analytic

        say("analytic roofline: fitting cpu-local's factors to the samples")
        profile["analytic_cpu_local"] = fit_analytic(profile["samples"], info)
    try:
        write_profile(profile, out)
        if analytic:
            with out.with_suffix(".md").open("a") as fh:
                fh.write("\n" + analytic_markdown(profile["analytic_cpu_local"]))
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    print(format_report(profile))
    if analytic:
        print(format_analytic(profile["analytic_cpu_local"]))
    print(f"wrote {out}")


def _from_runs(runs: list[Path], grid: Optional[Path], out: Path, quiet: bool) -> None:
    """calibrate --from-runs: fit to real runs' features.parquet (no mlx needed)."""
    import json

    from analysis.fit import format_report, report_markdown
    from analysis.runfit import RunsError, load_runs, profile_from_runs

    if not runs:
        fail("--from-runs needs one or more run directories", 2)
    if out.exists() and out.is_dir():
        fail(f"--out {out} is a directory; give a file name")
    if not out.parent.exists():
        fail(f"--out: directory {out.parent} does not exist")
    grid_prof = None
    if grid is not None:
        try:
            grid_prof = json.loads(grid.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            fail(f"--grid {grid}: not a readable profile JSON ({exc})")
        if not isinstance(grid_prof, dict) or not isinstance(grid_prof.get("coefficients"), dict):
            fail(f"--grid {grid}: not a profile (no coefficients)")
    try:
        loaded = load_runs(runs)
        profile = profile_from_runs(loaded, grid_prof, kind="grid+runs" if grid_prof else "runs")
    except RunsError as exc:
        fail(str(exc))
    try:
        out.write_text(json.dumps(profile, indent=1) + "\n")
        out.with_suffix(".md").write_text(report_markdown(profile))
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    print(format_report(profile))
    print(f"wrote {out}")


def _stored_profile(path: Path, info) -> dict:
    """A profile JSON with samples, measured on this model and machine (else one-line exit)."""
    import json

    from engine.calibrate import profile_mismatch

    try:
        prof = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        fail(f"--from-profile {path}: not a readable profile JSON ({exc})")
    if not isinstance(prof, dict) or not isinstance(prof.get("samples"), list) or not prof["samples"]:
        fail(f"--from-profile {path}: the profile stores no samples")
    missing = [k for k in ("fit_report", "calibration", "coefficients") if k not in prof]
    if missing:
        fail(f"--from-profile {path}: not a calibrate profile (no {', '.join(missing)})")
    why = profile_mismatch(prof, info)
    if why:
        fail(f"--from-profile {path} was not measured on this model and machine: {why}")
    return prof


_FACTORS = (("compute", "compute", 1.0, "{:.3f}"), ("attention", "attention", 1.0, "{:.4f}"),
            ("decode attention", "decode_attention", 1.0, "{:.4f}"), ("bandwidth", "bandwidth", 1.0, "{:.3f}"),
            ("copy", "copy", 1.0, "{:.3f}"), ("overhead/layer (ms)", "overhead_per_layer_s", 1e3, "{:.3f}"),
            ("copy overhead/layer (ms)", "copy_overhead_per_layer_s", 1e3, "{:.3f}"),
            ("step overhead (ms)", "step_overhead_s", 1e3, "{:.3f}"))


def _fmt(eff: dict, key: str, scale: float, fmt: str) -> str:
    v = eff.get(key)
    return "-" if v is None else fmt.format(v * scale)


def format_analytic(block: dict) -> str:
    """The analytic fit as printed by calibrate --analytic."""
    lines = [f"analytic roofline on cpu-local ({block['peak_gflops']:.0f} GFLOP/s fp32, {block['bandwidth_gbs']:.1f} GB/s "
             f"measured), {block['samples']['fitted']} passes fitted, {block['samples']['held_out']} held out:"]
    for kind, label in (("plain", "plain roofline (3 factors)"), ("full", "with attention and copy factors")):
        m = block["models"][kind]
        e = m["efficiency"]
        facts = ", ".join(f"{name} {_fmt(e, key, sc, f)}" for name, key, sc, f in _FACTORS if e.get(key) is not None)
        lines.append(f"  {label}: {facts}")
        for what in ("all_passes", "held_out_passes"):
            r = m[what]
            if r.get("n"):
                lines.append(f"    {what.replace('_', ' ')}: median |error| {r['median_abs_pct']:.1f} %, "
                             f"max {r['max_abs_pct']:.1f} % over {r['n']}")
    return "\n".join(lines)


def analytic_markdown(block: dict) -> str:
    """The analytic fit's section of the profile's markdown report."""
    L = ["## Analytic roofline on cpu-local", "",
         f"Factors of `analysis/analytic`'s roofline fitted to this profile's samples (`calibrate --analytic`): peak "
         f"{block['peak_gflops']:.0f} GFLOP/s fp32 and {block['bandwidth_gbs']:.1f} GB/s as measured on "
         f"`{block['machine']}`; {block['samples']['fitted']} passes fitted, {block['samples']['held_out']} held out "
         f"(mixed passes only predicted), {block['samples']['skipped']} skipped.", "",
         "| factor | plain | full |", "|---|---:|---:|"]
    for name, key, sc, f in _FACTORS:
        L.append(f"| {name} | " + " | ".join(_fmt(block["models"][k]["efficiency"], key, sc, f)
                                            for k in ("plain", "full")) + " |")
    L += ["", "| pass error (median / max abs %) | plain | full |", "|---|---:|---:|"]

    def cell(r: dict) -> str:
        return f"{r['median_abs_pct']:.1f} / {r['max_abs_pct']:.1f}" if r.get("n") else "-"

    for label, key in (("all passes", "all_passes"), ("held-out passes", "held_out_passes")):
        L.append(f"| {label} | " + " | ".join(cell(block["models"][k][key]) for k in ("plain", "full")) + " |")
    for g in block["models"]["full"]["groups"]:
        L.append(f"| {g} | " + " | ".join(cell(block["models"][k]["groups"][g]) for k in ("plain", "full")) + " |")
    L.append("")
    return "\n".join(L)


def calibrate_main() -> None:
    run_app(calibrate_app, "calibrate")
