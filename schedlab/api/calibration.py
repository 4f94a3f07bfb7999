"""``calibrate``: time the real engine over a grid (or fit real runs) and fit the cost model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import opt
from ._base import (
    Log,
    TraceLike,
    as_path,
    check_bool,
    check_callable,
    check_model,
    check_model_seed,
    check_seed,
    fail,
    logger,
    public,
)
from .profiles import Profile
from .runs import Run


def _grid(grid: str | Mapping[str, Any] | None, quick: bool, info=None):
    """The calibration grid: ``grid`` by name, or the model's grid (the compact one for large
    models, else quick or default; ``engine.calibrate.grid_for``) with ``grid``'s fields."""
    import dataclasses

    from schedlab.engine.calibrate import GRIDS, grid_for

    base = grid_for(info, quick=quick) if info is not None else GRIDS["quick" if quick else "default"]
    if grid is None:
        return base
    if isinstance(grid, str):
        if grid not in GRIDS:
            fail(f"unknown grid {grid!r} (grids: {', '.join(GRIDS)}, or a mapping of grid fields)", 2)
        return GRIDS[grid]
    if not isinstance(grid, Mapping):
        fail(f"grid is a name ({', '.join(GRIDS)}) or a mapping of grid fields, got {type(grid).__name__}", 2)
    fields = {f.name for f in dataclasses.fields(base)}
    bad = sorted(set(grid) - fields)
    if bad:
        fail(f"grid: unknown field(s) {', '.join(map(str, bad))} (fields: {', '.join(sorted(fields))})", 2)
    return dataclasses.replace(base, **{"name": f"{base.name}+custom", **grid})


def _from_runs(runs: Sequence[Any], grid: Any, out: str | Path | None) -> Profile:
    """calibrate --from-runs: a profile fitted to real runs' features.parquet (no mlx needed)."""
    import json

    from schedlab.analysis.runfit import RunsError, load_runs, profile_from_runs

    if isinstance(runs, (str, Path)):
        runs = [runs]
    dirs = [r._dir if isinstance(r, Run) and r._dir is not None else r for r in runs]
    if any(isinstance(d, Run) for d in dirs):
        fail("from_runs takes run directories: save() a Run first", 2)
    if not dirs:
        fail(f"{opt('from_runs')} needs one or more run directories", 2)
    out = _checked_out(out)
    grid_prof = None
    if isinstance(grid, Profile):
        grid_prof = grid.data
    elif grid is not None:
        if not isinstance(grid, (str, Path)):
            fail(f"with from_runs, grid is a grid profile (a path or a Profile), got {type(grid).__name__}", 2)
        try:
            grid_prof = json.loads(Path(grid).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            fail(f"{opt('grid')} {grid}: not a readable profile JSON ({exc})")
        if not isinstance(grid_prof, dict) or not isinstance(grid_prof.get("coefficients"), dict):
            fail(f"{opt('grid')} {grid}: not a profile (no coefficients)")
    try:
        data = profile_from_runs(
            load_runs([Path(d) for d in dirs]), grid_prof, kind="grid+runs" if grid_prof else "runs"
        )
    except RunsError as exc:
        fail(str(exc))
    prof = Profile(data)
    if out is not None:
        prof.save(out)
    return prof


def _acceptance_spec(speculative, trace, acceptance_only, analytic, from_profile, replay, from_runs):
    """``parse_speculative``'s answer for the acceptance calibrate measures (None: none), and
    what goes with it checked (one line, exit status 2)."""
    from .deployments import parse_speculative

    spec = parse_speculative(speculative)
    if spec is None:
        if trace is not None:
            fail(
                f"{opt('trace')} goes with {opt('speculative')} (the workload whose drafts' acceptance it measures)", 2
            )
        if acceptance_only:
            fail(f"{opt('acceptance_only')} goes with {opt('speculative')} and {opt('trace')}", 2)
        return None
    if trace is None:
        fail(f"{opt('speculative')} goes with {opt('trace')}: the workload whose drafts' acceptance it measures", 2)
    if from_runs is not None:
        fail(f"{opt('speculative')} does not go with {opt('from_runs')} (it runs the engine on the trace)", 2)
    if acceptance_only:
        given = [n for n, v in (("analytic", analytic), ("from_profile", from_profile), ("replay", replay)) if v]
        if given:
            fail(f"{opt('acceptance_only')} times nothing: drop {opt(given[0])}", 2)
    return spec


def _stored_profile(path: Path, info) -> dict:
    """A profile JSON with samples, measured on this model and machine."""
    import json

    from schedlab.engine.calibrate import profile_mismatch

    name = opt("from_profile")
    try:
        prof = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        fail(f"{name} {path}: not a readable profile JSON ({exc})")
    if not isinstance(prof, dict) or not isinstance(prof.get("samples"), list) or not prof["samples"]:
        fail(f"{name} {path}: the profile stores no samples")
    missing = [k for k in ("fit_report", "calibration", "coefficients") if k not in prof]
    if missing:
        fail(f"{name} {path}: not a calibrate profile (no {', '.join(missing)})")
    why = profile_mismatch(prof, info)
    if why:
        fail(f"{name} {path} was not measured on this model and machine: {why}")
    return prof


def _checked_out(out: str | Path | None) -> Path | None:
    """``out`` as a path whose directory exists (one line if not)."""
    out = as_path(out) if out is not None else None
    if out is not None:
        if out.exists() and out.is_dir():
            fail(f"{opt('out')} {out} is a directory; give a file name")
        above = next((p for p in out.parents if p.exists()), None)  # the nearest folder there is
        if above is not None and not above.is_dir():
            fail(f"cannot write {out}: {above} is a file")
        if not out.parent.exists():
            fail(f"{opt('out')}: directory {out.parent} does not exist")
    return out


def _check_pairs(from_profile, analytic: bool, add_verify: bool, speculative: bool, keep_runs, replay: bool) -> None:
    """The options that go only with others: one line for any alone."""
    if from_profile is not None and not (analytic or add_verify or speculative):
        fail(
            f"{opt('from_profile')} goes with {opt('analytic')} or {opt('add_verify')} (or {opt('speculative')}: "
            f"the acceptance added to it)",
            2,
        )
    if add_verify and from_profile is None:
        fail(f"{opt('add_verify')} goes with {opt('from_profile')} (a full calibration times verify passes anyway)", 2)
    if from_profile is not None and not Path(from_profile).is_file():
        fail(f"{opt('from_profile')} {from_profile}: no such file")
    if keep_runs is not None and not replay:
        fail(f"{opt('keep_runs')} goes with {opt('replay')}", 2)


@public
def calibrate(
    *,
    model: str = "tiny",
    dtype: str = "float32",
    quick: bool = False,
    grid: str | Mapping[str, Any] | Path | Profile | None = None,
    seed: int = 0,
    model_seed: int = 0,
    analytic: bool = False,
    from_profile: str | Path | None = None,
    add_verify: bool = False,
    replay: bool = False,
    keep_runs: str | Path | None = None,
    from_runs: Sequence[str | Path] | None = None,
    speculative: str | Mapping[str, Any] | None = None,
    trace: TraceLike | None = None,
    acceptance_only: bool = False,
    out: str | Path | None = None,
    log: Log | None = None,
) -> Profile:
    """Time real passes over a grid and fit the cost model (the ``calibrate`` command).

    ``quick``: the smaller grid (models above 50M parameters use the compact one); ``grid``: a
    grid by name (``quick``, ``default``, ``compact``) or a mapping of ``engine.calibrate.Grid``
    fields replacing those of the chosen grid (e.g.
    ``{"decode_batches": (1, 2, 4), "rounds": 2}``); ``analytic``: also fit the cpu-local
    roofline's factors; ``from_profile``: with ``analytic``, time nothing and fit those factors
    to this profile's samples; ``add_verify``: with ``from_profile``, time only the verify passes
    of speculative decoding and add their terms to that profile (every other coefficient kept;
    a full calibration times them anyway); ``replay``: the default calibration (what ``validate`` and
    ``run_real`` make when no profile matches: the quick grid, then a short real replay of a few
    policies, fitted together), ``keep_runs``: keep the replay's run directories there;
    ``from_runs``: time nothing, fit to these real runs' steps (``run_real``/``validate`` output
    directories, their features.parquet), whole runs held out, on top of ``grid``'s fit when
    ``grid`` is then a grid profile (a path or ``Profile``); ``out``: write the profile JSON (and
    its .md report) there. ``log`` hears progress lines.

    ``speculative`` (``"ngram:k=4"``) with ``trace``: also measure the acceptance of those drafts
    on the trace's requests (the real engine, greedy: ``api.acceptance.measure_acceptance``) and
    keep it in the profile under ``acceptance`` (``simulate --speculative ngram:k=4,accept=PROFILE``
    reads it); with ``from_profile``, that profile with the acceptance added (nothing else timed);
    ``acceptance_only``: time nothing else, the profile only that (a small JSON, ``schema``
    ``schedlab-acceptance/1``)."""
    for name, flag in (("quick", quick), ("analytic", analytic), ("add_verify", add_verify), ("replay", replay)):
        check_bool(flag, name)
    check_bool(acceptance_only, "acceptance_only")
    check_callable(log, "log")
    spec = _acceptance_spec(speculative, trace, acceptance_only, analytic, from_profile, replay, from_runs)
    if from_runs is not None:
        return _from_runs(from_runs, grid, out)
    from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
    from schedlab.engine import blas

    log = logger(log)
    seed, model_seed = check_seed(seed), check_model_seed(model_seed)
    check_model(model, dtype)
    out = _checked_out(out)
    _check_pairs(from_profile, analytic, add_verify, spec is not None, keep_runs, replay)
    _grid(grid, quick)  # a bad grid fails before the model loads
    from schedlab.engine.calibrate import calibrate as run_calibration
    from schedlab.engine.models import load_model

    info = load_model(str(model), dtype=dtype, seed=model_seed)
    blas.notify_if_missing()
    chosen = _grid(grid, quick, info)

    def say(msg: str) -> None:
        log("progress", msg)

    acceptance = None
    if spec is not None:  # (first: a trace with no drafts fails before minutes of timing)
        from schedlab.analysis.speculation import ACCEPTANCE_SCHEMA

        from .acceptance import measure_acceptance

        acceptance = measure_acceptance(info, trace, spec, seed, say)
        if acceptance_only:
            data = {"schema": ACCEPTANCE_SCHEMA, "model": str(info.name), "dtype": dtype, "acceptance": acceptance}
            prof = Profile(data)
            if out is not None:
                prof.save(out)
            return prof
    if from_profile is not None:
        data = _stored_profile(Path(from_profile), info)
        if add_verify:
            from schedlab.engine.calibrate import GRIDS, add_verify_terms

            try:
                data = add_verify_terms(
                    info, data, GRIDS.get(data["calibration"].get("grid"), chosen), seed=seed, progress=say
                )
            except ValueError as exc:
                fail(str(exc), 2)
    elif replay:
        from schedlab.engine.calibrate import calibrate_default

        data = calibrate_default(info, seed=seed, progress=say, keep=Path(keep_runs) if keep_runs is not None else None)
    else:
        data = run_calibration(info, chosen, seed=seed, progress=say)
    if analytic:
        from schedlab.engine.calibrate import fit_analytic

        say("analytic roofline: fitting cpu-local's factors to the samples")
        data["analytic_cpu_local"] = fit_analytic(data["samples"], info)
    if acceptance is not None:
        data["acceptance"] = acceptance
    prof = Profile(data)
    if out is not None:
        prof.save(out)
    return prof
