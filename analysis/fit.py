"""Fitting the linear cost model to measured samples, and its fit report.

Pure numerics (no mlx): ``engine.calibrate`` measures (``analysis.samples``), this module fits. Groups are fitted
apart (decode and prefill terms fitted apart fit best here); the copy terms (join, leave)
are fitted on what is left of their passes once the decode terms are known, the verify terms on
what a verify pass took beyond the plain decode pass of the same rows timed beside it; mixed passes
are never fitted, only predicted. A quarter of each group's points is held out.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any, Callable, Iterable, Sequence

from schedlab.sim.cost import (
    DECODE_SHAPE_TERMS,
    FEATURES,
    PASS_FEATURES,
    PREFILL_SHAPE_TERMS,
    VERIFY_TERMS,
    LinearCostModel,
    fit_linear,
)

from .samples import DECODE_BASE, DECODE_TERMS, JOIN_TERMS, LEAVE_TERMS, PREFILL_BASE, STEP_TERMS, Sample

SHAPE_MIN_GAIN = 0.5  # percentage points of leave-one-out median |error| a shape term must save


def merge_rounds(same: Sequence[Sample]) -> Sample:
    """One sample from the rounds of one grid point: the median over all their runs."""
    runs = [dt for s in same for dt in s.runs]
    med = statistics.median(runs)
    closest = min(same, key=lambda s: abs(s.seconds - med))
    return Sample(closest.group, closest.label, closest.features, med, runs)


def split(samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """A quarter of the samples, drawn with a fixed seed, is held out of the fit.

    (Not every fourth in grid order: with four contexts per batch size that would hold out
    exactly the longest-context column, an extrapolation test rather than a hold-out.)
    """
    idx = list(range(len(samples)))
    random.Random(len(samples)).shuffle(idx)
    held_idx = set(idx[: len(samples) // 4])
    fit = [s for i, s in enumerate(samples) if i not in held_idx]
    held = [s for i, s in enumerate(samples) if i in held_idx]
    return fit, held


def _errors(model: LinearCostModel, samples: Sequence[Sample], predict: Callable[[Sample], float]) -> dict:
    if not samples:
        return {"n": 0}
    errs = [100.0 * (predict(s) - s.seconds) / s.seconds for s in samples if s.seconds > 0]
    abs_e = sorted(abs(e) for e in errs)
    return {
        "n": len(errs),
        "median_abs_pct": statistics.median(abs_e),
        "max_abs_pct": abs_e[-1],
        "mean_pct": statistics.fmean(errs),
    }


def _r2(samples: Sequence[Sample], predict: Callable[[Sample], float]) -> float | None:
    if len(samples) < 2:
        return None
    y = [s.seconds for s in samples]
    mean = statistics.fmean(y)
    ss_tot = sum((v - mean) ** 2 for v in y)
    ss_res = sum((s.seconds - predict(s)) ** 2 for s in samples)
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else None


def _dot(coef: dict[str, float], feats: dict[str, float], names: Iterable[str]) -> float:
    return sum(coef.get(k, 0.0) * feats.get(k, 0.0) for k in names)


def fit_profile(samples: list[Sample]) -> tuple[dict[str, float], dict[str, Any]]:
    """Coefficients for every term, each group fitted apart, plus the fit report."""
    by = {
        g: [s for s in samples if s.group == g]
        for g in ("decode", "join", "leave", "prefill", "padded", "mixed", "step", "verify", "verify_base")
    }
    coef: dict[str, float] = dict.fromkeys(FEATURES, 0.0)
    report: dict[str, Any] = {}

    def fit_group(name, group, terms, base=None, relative=True, shape=()):
        fit, held = split(group)
        if not fit:
            return
        if shape:  # which of the group's shape terms: leave-one-out over all its points (a held-out
            # measure of its own, not the fit's three quarters alone: 13-15 points judge a term poorly)
            terms, report[f"{name}_shape_tries"] = shape_terms(group, terms, shape)
        y = [s.seconds - (base(s) if base else 0.0) for s in fit]
        got = fit_linear(
            [s.features for s in fit],
            y,
            terms,
            relative=relative,
            scale_by=[s.seconds for s in fit] if relative else None,
        )
        coef.update(got)

        def pred(s):
            return _dot(coef, s.features, terms) + (base(s) if base else 0.0)

        report[name] = {
            "terms": list(terms),
            "fit": _errors(None, fit, pred),
            "r2": _r2(fit, pred),
            "held_out": _errors(None, held, pred),
        }

    fit_group("decode", by["decode"], DECODE_BASE, shape=DECODE_SHAPE_TERMS)
    decode_part = lambda s: _dot(coef, s.features, DECODE_TERMS)  # noqa: E731
    fit_group("join", by["join"], JOIN_TERMS, base=decode_part)
    fit_group("leave", by["leave"], LEAVE_TERMS, base=decode_part)
    fit_group("prefill", by["prefill"] + by["padded"], PREFILL_BASE, shape=PREFILL_SHAPE_TERMS)
    fit_group("step", by["step"], STEP_TERMS, relative=False)
    # mixed passes: predicted as decode + prefill parts, never fitted
    model = LinearCostModel(dict(coef))
    passes = lambda s: _dot(coef, s.features, PASS_FEATURES)  # noqa: E731
    report["mixed"] = {"held_out": _errors(model, by["mixed"], passes), "r2": _r2(by["mixed"], passes)}
    # every pass sample, held-out or not, as one number users can quote
    all_pass = [s for g in ("decode", "join", "leave", "prefill", "padded", "mixed") for s in by[g]]
    report["all_passes"] = _errors(model, all_pass, passes)
    held = (
        [s for g in ("decode", "join", "leave") for s in split(by[g])[1]]
        + split(by["prefill"] + by["padded"])[1]
        + by["mixed"]
    )
    report["held_out_passes"] = _errors(model, held, passes)
    verify, verify_report = fit_verify(samples, coef)
    coef.update(verify)
    report.update(verify_report)
    return coef, report


def fit_verify(samples: Sequence[Sample], coef: dict[str, float]) -> tuple[dict[str, float], dict[str, Any]]:
    """The verify terms (speculative decoding's verify passes) from ``samples``' ``verify`` points
    and their ``verify_base`` pairs: fitted to what a verify pass took beyond the plain decode
    pass of the same rows timed beside it, relative to the verify pass's seconds. ``coef``: the
    other terms (fitted already), for the report's ``verify_passes``: the whole verify pass as a
    simulation prices it (decode terms + verify terms) against its measurement. Nothing when
    there are no such points (a model whose caches cannot roll back)."""
    paired = {s.label: s.seconds for s in samples if s.group == "verify_base"}
    verify = [s for s in samples if s.group == "verify" and s.label in paired]
    if not verify:
        return {}, {}
    fit, held = split(verify)
    got = fit_linear(
        [s.features for s in fit],
        [s.seconds - paired[s.label] for s in fit],
        VERIFY_TERMS,
        scale_by=[s.seconds for s in fit],
    )

    def pred(s):
        return _dot(got, s.features, VERIFY_TERMS) + paired[s.label]

    whole = {**coef, **got}
    return got, {
        "verify": {
            "terms": list(VERIFY_TERMS),
            "fit": _errors(None, fit, pred),
            "r2": _r2(fit, pred),
            "held_out": _errors(None, held, pred),
        },
        "verify_passes": _errors(None, verify, lambda s: _dot(whole, s.features, PASS_FEATURES)),
    }


def _loo_median(samples: Sequence[Sample], terms: Sequence[str]) -> float:
    """Median |error| (%) of each sample predicted by a fit of ``terms`` to the others."""
    errs = []
    for i, s in enumerate(samples):
        rest = [x for j, x in enumerate(samples) if j != i]
        got = fit_linear([x.features for x in rest], [x.seconds for x in rest], terms)
        errs.append(abs(100.0 * (_dot(got, s.features, terms) - s.seconds) / s.seconds))
    return statistics.median(errs)


def shape_terms(
    samples: Sequence[Sample], base: Sequence[str], candidates: Sequence[str]
) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """The terms to fit to a group's ``samples``: ``base``, plus each of ``candidates`` (the
    group's shape terms, forward selection) that lowers the leave-one-out median |error| of
    the group's points by ``SHAPE_MIN_GAIN`` points. Whether a batch's second to fourth rows
    cost more than later ones, attention past a few hundred tokens of context more than below,
    or a short chunk's tokens more than a long one's, differs from machine to machine and model
    to model (measured on three machines: both decode terms on one, the first on another,
    neither on a third); where it does not show, a term would only add variance.
    Returns (terms, tries: each tried set's score)."""
    terms = list(base)
    ok = [s for s in samples if s.seconds > 0]
    if len(ok) < len(base) + len(candidates) + 3:  # too few points to judge a term: the base terms
        return tuple(terms), []
    best = _loo_median(ok, terms)
    tries = [{"terms": list(terms), "loo_median_abs_pct": round(best, 2), "kept": True}]
    left = [k for k in candidates if any(s.features.get(k) for s in ok)]
    while left:
        scored = [(_loo_median(ok, terms + [k]), k) for k in left]
        for sc, k in scored:
            tries.append({"terms": terms + [k], "loo_median_abs_pct": round(sc, 2), "kept": False})
        sc, k = min(scored)
        if sc > best - SHAPE_MIN_GAIN:
            break
        terms.append(k)
        left.remove(k)
        best = sc
        next(t for t in tries if t["terms"] == terms)["kept"] = True
    return tuple(terms), tries


def format_report(profile: dict[str, Any]) -> str:
    rep = profile.get("fit_report") or {}
    cal = profile.get("calibration") or {}
    what = f"{cal.get('samples')} grid samples"
    if cal.get("kind") in ("runs", "grid+replay", "grid+runs"):
        what += f" + {cal.get('steps')} real steps of {len(cal.get('runs') or [])} run(s) ({cal['kind']})"
    lines = [
        f"calibrated {profile['model']} ({profile['dtype']}, BLAS {profile['blas'].get('name')} "
        f"x{profile['blas'].get('threads')})"
        + (f" in {cal['wall_s']} s" if cal.get("wall_s") is not None else "")
        + f", {what}"
    ]
    if rep.get("held_out_passes"):
        lines += _grid_lines(rep)
    if profile.get("runs_report"):
        from schedlab.analysis.runfit import format_runs_report

        lines.append(format_runs_report(profile["runs_report"]))
    lines.append("coefficients: " + ", ".join(f"{k}={v:.3g}" for k, v in profile["coefficients"].items() if v))
    return "\n".join(lines)


def _grid_lines(rep: dict[str, Any]) -> list[str]:
    lines = []
    lines.append(f"{'group':<10} {'R^2':>7} {'fit med|%|':>11} {'held-out n':>11} {'med |%|':>8} {'max |%|':>8}")
    for g in ("decode", "join", "leave", "prefill", "step", "mixed", "verify"):
        r = rep.get(g)
        if not r:
            continue
        h = r.get("held_out", {})
        r2 = r.get("r2")
        fit_med = r.get("fit", {}).get("median_abs_pct")
        lines.append(
            f"{g:<10} {_f(r2, 4):>7} {_f(fit_med, 1):>11} {h.get('n', 0):>11} "
            f"{_f(h.get('median_abs_pct'), 1):>8} {_f(h.get('max_abs_pct'), 1):>8}"
        )
    for group, base in (("decode", DECODE_BASE), ("prefill", PREFILL_BASE)):
        tries = rep.get(f"{group}_shape_tries")
        if tries:
            lines.append(
                f"{group} terms (leave-one-out median |%| of the {group} points; a shape term kept when "
                f"it drops by >= {SHAPE_MIN_GAIN}): "
                + ", ".join(
                    f"{'+'.join(t['terms'][len(base) :]) or 'base'} {t['loo_median_abs_pct']:.1f}"
                    + (" kept" if t["kept"] and len(t["terms"]) > len(base) else "")
                    for t in tries
                )
            )
    h = rep["held_out_passes"]
    lines.append(
        f"held-out passes: median |error| {_f(h.get('median_abs_pct'), 1)} %, "
        f"max {_f(h.get('max_abs_pct'), 1)} % over {h.get('n')}"
    )
    return lines


def _grid_name(cal: dict[str, Any]) -> Any:
    g = cal.get("grid")
    return g.get("grid") if isinstance(g, dict) else g


def _f(v, digits):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def report_markdown(profile: dict[str, Any]) -> str:
    b, m = profile.get("blas", {}), profile.get("machine", {})
    cal = profile.get("calibration", {})
    lines = [
        f"# Cost profile: {profile['model']} ({profile['dtype']})",
        "",
        f"Measured by `calibrate` ({_grid_name(cal)} grid, {cal.get('samples')} samples"
        + (f" and {cal.get('steps')} steps of {len(cal.get('runs') or [])} real run(s)" if cal.get("runs") else "")
        + ", "
        f"{cal.get('wall_s')} s) on {profile.get('date')}: mlx {profile.get('mlx')}, mlx-lm "
        f"{profile.get('mlx_lm')}, BLAS {b.get('name')} x{b.get('threads')} threads "
        f"(thread timeout {b.get('thread_timeout')}), {m.get('processor')} with {m.get('cpu_count')} CPUs, "
        f"{m.get('platform')}. Coefficients are never typed in: rerun `calibrate` to refresh them.",
        "",
        "## Fit",
        "",
        "Each group is fitted apart; a quarter of each group's grid points is held out. Errors are",
        "|predicted - measured| / measured per grid point (the median over its runs). Real runs'",
        "steps (where fitted) are held out by whole runs (analysis/runfit.py).",
        "",
        "```",
        format_report(profile),
        "```",
        "",
        "## Coefficients (seconds per unit; see sim/cost.py for the terms)",
        "",
        "| term | value |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v:.4g} |" for k, v in profile["coefficients"].items()]
    return "\n".join(lines) + "\n"
