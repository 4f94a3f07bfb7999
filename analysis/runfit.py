"""Fitting the cost model to real runs' steps (``calibrate --from-runs``), held out by whole runs.

The grid (``engine.calibrate``) times passes in isolation; a real run interleaves steps,
sampling, state updates, batch-cache joins and leaves, SimPy's real-time hops and idle gaps.
Every real run writes ``features.parquet`` (``sim.features``): per measured step, its
seconds and every cost term's feature summed over its passes. The step's seconds are linear
in the coefficients (``sum coef[k] * feature[k]``, the loop's own prediction), so a fit is
non-negative least squares over steps, relative error weighted — relative to the prediction,
not to the measurement (``fit_config``): a step's measured seconds on a shared machine are skewed
to the slow side, and weighting by them lets a slow step count less than a fast one of the
same shape, so the fit lands below the mean time the latencies add up.

Two ways to fit, scored on whole held-out runs (leave one run out; with a single run, its
first and second half):

- ``joint`` (the default): every term fitted at once to the runs' steps (and the grid's
  passes, when given, as further rows).
- ``scaled`` (with grid samples, on request: ``fit_runs(modes=...)``): the grid's fit gives
  each pass's shape dependence; the runs fit one factor per group of terms (decode,
  batch-cache copies, prefill), i.e. how much slower the same passes run inside the real loop,
  plus the additive terms below. Not tried by default: the held-out runs here are all of the
  calibration's one trace, and a mode that scores better on them need not on other traces
  (the comparison on real runs of other traces: docs/benchmarks.md, *Investigations*).

Terms the grid cannot see are candidates, each kept only when it lowers the held-out score
(forward selection; the table of every try is in the report):

- ``s_step`` (always: the loop's own time per step, measured in the real loop), ``s_pass``,
  ``s_row``: the loop's overhead per step, per pass, per row;
- ``i_step``, ``i_gap``: a step right after the replica sat idle waiting for an arrival
  (fixed, and growing with the idle time up to ``IDLE_CAP_S``); ``i_after``: the few steps after
  that one (halving from the first: ``sim.cost.AFTER_WAKE_STEPS``);
- ``c_join_row``, ``c_leave_row``: per row joining or leaving the batch cache.

The after-idle candidates are tried only when the runs hold ``MIN_WAKES`` wakes or more (the
default calibration's replay ends with ``engine.calibrate.WAKE_TAIL`` lone requests after known
idle gaps for them).

``i_wake`` (from an arrival to the step it wakes the replica for) is measured directly on
every wake: its median, kept when it predicts held-out wakes better than 0.

The score is the mean over step groups (decode, prefill, mixed, join/leave, after idle) of
the held-out median |error| (%), plus the |error| of the total step time (%): every kind of
step counts, not only the many small decode steps, and so does the total.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from schedlab.sim.cost import (
    DEFAULT_KV_TOKENS,
    FEATURES,
    PASS_FEATURES,
    PROFILE_SCHEMA,
    SHAPE_TERMS,
    STEP_FEATURES,
    nnls,
)
from schedlab.analysis.samples import DECODE_TERMS, PREFILL_TERMS, Sample
from schedlab.sim.features import STEP_TERMS, read_features

DECODE, PREFILL = DECODE_TERMS, PREFILL_TERMS  # the grid fit's groups
COPY = ("c_join0", "c_join", "c_join_ctx", "c_extend", "c_leave0", "c_leave")
SCALES = {"a_decode": DECODE, "a_copy": COPY, "a_prefill": PREFILL}
BASE_ADDITIVE = ("s_step",)
CANDIDATES = ("s_pass", "s_row", "i_step", "i_gap", "i_after", "c_join_row", "c_leave_row")
GRID_TERMS = DECODE + COPY + PREFILL  # what a grid fit determines
GROUPS = ("decode", "prefill", "mixed", "join/leave", "after idle")
BLAS_KEYS = ("name", "threads", "thread_timeout", "path", "config", "active")  # as calibrate stores them
WEIGHTINGS = ("prediction", "measured")  # Config.weigh_by
_WEIGHT_WORDS = {"prediction": "predicted", "measured": "measured"}
MIN_GAIN = 0.2  # a candidate must lower the score by this many percentage points
IDLE_TERMS = ("i_step", "i_gap", "i_after")
# the after-idle candidates are tried only on runs holding this many wakes: a slow model's short
# replay used to hold one a run (its first step), and three such steps were enough for the
# held-out score to keep an i_step that every later wake paid (SmolLM2: 81 ms)
MIN_WAKES = 8


class RunsError(ValueError):
    """Run directories that cannot be fitted; one line for the user."""


@dataclass
class RunSteps:
    name: str
    path: Path
    meta: dict[str, Any]
    cols: dict[str, np.ndarray]

    @property
    def n(self) -> int:
        return len(self.cols["measured_s"])


def load_runs(dirs: Iterable[str | Path]) -> list[RunSteps]:
    """Every run directory's features.parquet and meta.json (a validate directory's real
    runs are found inside it)."""
    out: list[RunSteps] = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise RunsError(f"{d} is a file, not a run directory" if d.exists() else f"{d}: no such run directory")
        found = [d] if (d / "features.parquet").is_file() else sorted(p.parent for p in d.rglob("features.parquet"))
        if not found:
            raise RunsError(f"{d}: no features.parquet (a real run of this version of run-real or validate writes one)")
        for p in found:
            try:
                meta = json.loads((p / "meta.json").read_text())
            except (OSError, ValueError):
                meta = {}
            cols = read_features(p)
            keep = cols["measured_s"] > 0
            cols = {k: v[keep] for k, v in cols.items()}
            if len(cols["measured_s"]):
                out.append(RunSteps(str(p), p, meta, cols))
    if not out:
        raise RunsError("no measured steps in the given runs")
    return out


def step_groups(cols: dict[str, np.ndarray]) -> np.ndarray:
    """Each step's group: after idle, join/leave, mixed, prefill, decode (first that applies)."""
    g = np.full(len(cols["measured_s"]), "decode", dtype=object)
    g[cols["prefill_tokens"] > 0] = "prefill"
    g[(cols["prefill_tokens"] > 0) & (cols["decode_rows"] > 0)] = "mixed"
    g[cols["batch_changed"] > 0] = "join/leave"
    g[cols["after_idle"] > 0] = "after idle"
    return g


def predict(coef: dict[str, float], cols: dict[str, np.ndarray]) -> np.ndarray:
    """Each step's seconds under ``coef``: what the loop predicts for it (pass terms summed
    over its passes, step overhead, the after-idle extra)."""
    out = np.zeros(len(cols["measured_s"]))
    for k in STEP_TERMS:
        c = coef.get(k, 0.0)
        if c:
            out += c * cols[k]
    return out


def step_predictions(cols: dict[str, np.ndarray], coef: dict[str, float] | None = None) -> np.ndarray:
    """Each step's predicted seconds: as its run predicted them (``predicted_s``), or under
    ``coef`` (a profile fitted again)."""
    if coef is None:
        return np.asarray(cols["predicted_s"], dtype=float)
    return predict(dict(coef), cols)


def errors(pred: np.ndarray, meas: np.ndarray) -> dict[str, Any]:
    """Median / p90 |error| %, median measured/predicted, total predicted vs measured %."""
    if len(meas) == 0:
        return {"n": 0}
    e = 100.0 * (pred - meas) / meas
    a = np.abs(e)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(pred > 0, meas / np.where(pred > 0, pred, 1.0), np.nan)
    return {
        "n": int(len(meas)),
        "median_abs_pct": float(np.median(a)),
        "p90_abs_pct": float(np.percentile(a, 90)),
        "bias": float(np.nanmedian(ratio)) if np.isfinite(ratio).any() else None,
        "total_pct": float(100.0 * (pred.sum() - meas.sum()) / meas.sum()),
    }


def by_group(pred: np.ndarray, meas: np.ndarray, groups: np.ndarray) -> dict[str, Any]:
    out = {"all": errors(pred, meas)}
    for g in GROUPS:
        m = groups == g
        if m.any():
            out[g] = errors(pred[m], meas[m])
    return out


def score(rep: dict[str, Any]) -> float:
    """Mean over the groups present of the median |error|, plus |total error| (both %)."""
    meds = [rep[g]["median_abs_pct"] for g in GROUPS if g in rep and rep[g].get("n")]
    return float(np.mean(meds)) + abs(rep["all"]["total_pct"])


# ---------------------------------------------------------------------- one fit


@dataclass
class Config:
    mode: str  # "scaled" or "joint"
    terms: tuple[str, ...]  # additive terms fitted to the runs (besides the scales / grid terms)
    balance: float = 1.0  # 0: every step weighs the same (relative); 1: every group the same in total
    weigh_by: str = "prediction"  # a step's error relative to: its prediction, or its measured seconds

    def __post_init__(self) -> None:
        if self.weigh_by not in WEIGHTINGS:
            raise ValueError(f"weigh_by: one of {', '.join(WEIGHTINGS)}, not {self.weigh_by!r}")


def _design(
    cfg: Config, base: dict[str, float] | None, cols: dict[str, np.ndarray], overhead: bool = False
) -> tuple[list[str], np.ndarray]:
    """The columns of one of the two fits: the passes' time (``overhead`` False: pass and idle
    terms) or the rest of the step (the loop's s_ terms)."""
    names: list[str] = []
    parts: list[np.ndarray] = []
    if overhead:
        for k in cfg.terms:
            if k in STEP_FEATURES and np.any(cols[k]):
                names.append(k)
                parts.append(cols[k])
        return names, (np.column_stack(parts) if parts else np.zeros((len(cols["measured_s"]), 0)))
    if cfg.mode == "scaled":
        for a, keys in SCALES.items():
            x = sum(base.get(k, 0.0) * cols[k] for k in keys)
            if np.any(x):
                names.append(a)
                parts.append(np.asarray(x, dtype=float))
    else:
        for k in GRID_TERMS:
            if k in SHAPE_TERMS and base is not None and not base.get(k):
                continue  # the grid's fit left it out (analysis.fit.shape_terms)
            if np.any(cols[k]):
                names.append(k)
                parts.append(cols[k])
    for k in cfg.terms:
        if k not in names and k not in STEP_FEATURES and np.any(cols[k]):
            names.append(k)
            parts.append(cols[k])
    return names, (np.column_stack(parts) if parts else np.zeros((len(cols["measured_s"]), 0)))


def _weights(cols: dict[str, np.ndarray], balance: float, denom: np.ndarray | None = None) -> np.ndarray:
    """Each step's weight: 1 / ``denom`` (default: its measured seconds), times the group
    balance."""
    w = 1.0 / (cols["measured_s"] if denom is None else denom)
    if balance:
        g = step_groups(cols)
        counts = {k: int((g == k).sum()) for k in set(g)}
        n, ng = len(g), len(counts)
        w = w * np.array([(n / (ng * counts[k])) ** balance for k in g]) ** 0.5
    return w


def fit_config(
    cfg: Config,
    cols: dict[str, np.ndarray],
    base: dict[str, float] | None,
    grid: tuple[np.ndarray, np.ndarray, list[str]] | None = None,
    grid_weight: float = 1.0,
) -> dict[str, float]:
    """Coefficients (every FEATURES key) of one configuration fitted to ``cols`` (concatenated
    runs); ``grid``: (features matrix over GRID_TERMS + s_step, seconds, names) joined as rows
    in the joint mode.

    ``cfg.weigh_by="prediction"`` (the default) fits twice: first weighing each step's error
    relative to its measured seconds, then (returned) relative to that first fit's prediction
    for it. Step times on a shared machine are skewed to the slow side (a real run's p99 step
    is well above its median), and with 1/measured weights a slow step counts less than a fast
    one of the same shape: the fit predicts less than their mean, and the total step time falls
    short. Weighted by the prediction, the steps of one shape count alike and the fit targets
    their mean. ``"measured"``: the first fit only."""
    first = _fit_once(cfg, cols, base, grid, grid_weight, None)
    if cfg.weigh_by == "measured":
        return first
    pred = predict(first, cols)
    if not np.all(np.isfinite(pred)) or not np.any(pred > 0):
        return first
    floor = max(float(np.median(cols["measured_s"])) * 1e-3, 1e-9)  # a step predicted ~0 must not dominate
    return _fit_once(cfg, cols, base, grid, grid_weight, np.maximum(pred, floor))


def _fit_once(
    cfg: Config,
    cols: dict[str, np.ndarray],
    base: dict[str, float] | None,
    grid: tuple[np.ndarray, np.ndarray, list[str]] | None,
    grid_weight: float,
    denom: np.ndarray | None,
) -> dict[str, float]:
    """One fit of ``fit_config``: each step's error relative to ``denom`` (None: its measured
    seconds). The grid's rows (joint mode) stay relative to their own seconds: each is already
    the median of repeated timings of one pass, not a single draw of a skewed time."""
    w = _weights(cols, cfg.balance, denom)  # relative to the whole step's seconds
    got: dict[str, float] = {}
    # the loop's own time (measured apart: the step minus its passes) ...
    names, a = _design(cfg, base, cols, overhead=True)
    if a.shape[1]:
        got.update(_nnls(names, a * w[:, None], cols["overhead_s"] * w))
    # ... and the passes' time
    names, a = _design(cfg, base, cols)
    y = cols["passes_s"]
    rows_a, rows_y = [a * w[:, None]], [y * w]
    if cfg.mode == "joint" and grid is not None and len(grid[1]):
        ga, gy, gnames = grid
        idx = {k: i for i, k in enumerate(gnames)}
        g = np.zeros((len(gy), len(names)))
        for j, k in enumerate(names):
            if k in idx:
                g[:, j] = ga[:, idx[k]]
        gw = grid_weight * (len(y) / len(gy)) ** 0.5 / gy  # the grid as a whole weighs like the runs
        rows_a.append(g * gw[:, None])
        rows_y.append(gy * gw)
    A = np.vstack(rows_a)
    Y = np.concatenate(rows_y)
    coef = dict.fromkeys(FEATURES, 0.0)
    if A.shape[1]:
        got.update(_nnls(names, A, Y))
    if cfg.mode == "scaled":
        for a_name, keys in SCALES.items():
            f = got.get(a_name, 1.0 if a_name not in names else 0.0)
            for k in keys:
                coef[k] = f * base.get(k, 0.0)
        for k in PASS_FEATURES:  # grid-only terms outside the scaled groups keep their value
            if k not in DECODE + COPY + PREFILL:
                coef[k] = base.get(k, 0.0)
    for k, v in got.items():
        if k in coef:
            coef[k] = v
    if cfg.mode == "scaled":
        coef["_scales"] = {a: got.get(a) for a in SCALES}  # reported, removed before writing
    return coef


def _nnls(names: list[str], a: np.ndarray, y: np.ndarray) -> dict[str, float]:
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    x = nnls(a / scale, y) / scale
    return dict(zip(names, (float(v) for v in x)))


def _concat(runs: Sequence[RunSteps]) -> dict[str, np.ndarray]:
    keys = runs[0].cols.keys()
    return {k: np.concatenate([r.cols[k] for r in runs]) for k in keys}


def folds(runs: Sequence[RunSteps]) -> tuple[str, list[tuple[list[RunSteps], list[RunSteps]]]]:
    """(how, [(fit runs, held-out runs)]): leave one run out; one run: its two halves."""
    if len(runs) >= 2:
        return "leave one run out", [([r for r in runs if r is not h], [h]) for h in runs]
    r = runs[0]
    half = r.n // 2
    a = RunSteps(r.name + " (first half)", r.path, r.meta, {k: v[:half] for k, v in r.cols.items()})
    b = RunSteps(r.name + " (second half)", r.path, r.meta, {k: v[half:] for k, v in r.cols.items()})
    return "one run: first half / second half", [([a], [b]), ([b], [a])]


def cross_validate(cfg: Config, runs: Sequence[RunSteps], base, grid=None) -> dict[str, Any]:
    """Held-out errors of ``cfg``: every held-out run predicted by a fit to the others."""
    how, fs = folds(runs)
    preds, meas, groups, per_run = [], [], [], {}
    for fit_runs, held in fs:
        coef = fit_config(cfg, _concat(fit_runs), base, grid)
        for h in held:
            p = predict(coef, h.cols)
            preds.append(p)
            meas.append(h.cols["measured_s"])
            groups.append(step_groups(h.cols))
            per_run[h.name] = errors(p, h.cols["measured_s"])
    rep = by_group(np.concatenate(preds), np.concatenate(meas), np.concatenate(groups))
    return {"folds": how, "held_out": rep, "per_run": per_run, "score": score(rep)}


# ---------------------------------------------------------------------- the whole fit


@dataclass
class RunFit:
    coefficients: dict[str, float]
    report: dict[str, Any] = field(default_factory=dict)


def fit_runs(
    runs: Sequence[RunSteps],
    base: dict[str, float] | None = None,
    grid: tuple[np.ndarray, np.ndarray, list[str]] | None = None,
    candidates: Sequence[str] = CANDIDATES,
    modes: Sequence[str] | None = None,
    balances: Sequence[float] = (0.0, 1.0),
    weigh_by: str = "prediction",
    force: Sequence[str] = (),
) -> RunFit:
    """Fit the cost model to ``runs`` (and ``base``: a grid fit's coefficients; ``grid``: its
    samples as rows), choosing the mode, the weighting and the candidate terms by the score
    on whole held-out runs. The final coefficients are fitted to every run. ``force``:
    candidate terms fitted whatever the score says (an ablation's other side)."""
    if not runs:
        raise RunsError("no runs to fit")
    if modes is None:
        modes = ("joint",)  # module docstring: scaled only on request
    if "scaled" in modes and not base:
        raise RunsError("the scaled fit needs a grid fit's coefficients")
    tries: list[dict[str, Any]] = []
    best: tuple[float, Config, dict] | None = None
    # i_wake: the median wake-up latency, kept when it predicts held-out wakes better than 0
    wake = _wake(runs)
    wakes = wake["n"]  # the runs' after-idle steps
    if wakes < MIN_WAKES:
        candidates = [c for c in candidates if c not in IDLE_TERMS or c in force]
    for mode in modes:
        for bal in balances:
            terms = list(BASE_ADDITIVE) + [t for t in force if t not in BASE_ADDITIVE]
            cfg = Config(mode, tuple(terms), bal, weigh_by)
            cv = cross_validate(cfg, runs, base, grid)
            tries.append(_row(cfg, cv, "base"))
            left = [c for c in candidates if c not in terms]
            while left:
                trial = []
                for c in left:
                    c_cfg = Config(mode, tuple(terms + [c]), bal, weigh_by)
                    cv_c = cross_validate(c_cfg, runs, base, grid)
                    tries.append(_row(c_cfg, cv_c, f"+{c}"))
                    trial.append((cv_c["score"], c, cv_c))
                s, c, cv_c = min(trial, key=lambda t: t[0])
                if s > cv["score"] - MIN_GAIN:
                    break
                terms.append(c)
                left.remove(c)
                cv = cv_c
                tries[-len(trial) + [t[1] for t in trial].index(c)]["kept"] = True
            cfg = Config(mode, tuple(terms), bal, weigh_by)
            if best is None or cv["score"] < best[0]:
                best = (cv["score"], cfg, cv)
    score_, cfg, cv = best
    all_cols = _concat(runs)
    coef = fit_config(cfg, all_cols, base, grid)
    scales = coef.pop("_scales", None)
    if wake["keep"]:
        coef["i_wake"] = wake["i_wake"]
    fit_pred = predict(coef, all_cols)
    report = {
        "runs": [r.name for r in runs],
        "steps": int(len(all_cols["measured_s"])),
        "chosen": {
            "mode": cfg.mode,
            "balance": cfg.balance,
            "terms": list(cfg.terms),
            "scales": scales,
            "weigh_by": cfg.weigh_by,
        },
        "score": score_,
        "folds": cv["folds"],
        "held_out": cv["held_out"],
        "held_out_per_run": cv["per_run"],
        "fit": by_group(fit_pred, all_cols["measured_s"], step_groups(all_cols)),
        "wake": wake,
        "wakes": wakes,
        "idle_terms_tried": wakes >= MIN_WAKES,
        "tries": tries,
        "min_gain_pct": MIN_GAIN,
    }
    return RunFit(coef, report)


def _row(cfg: Config, cv: dict, what: str) -> dict[str, Any]:
    h = cv["held_out"]
    return {
        "mode": cfg.mode,
        "balance": cfg.balance,
        "what": what,
        "terms": list(cfg.terms),
        "score": round(cv["score"], 3),
        "median_abs_pct": round(h["all"]["median_abs_pct"], 2),
        "total_pct": round(h["all"]["total_pct"], 2),
        "groups": {g: round(h[g]["median_abs_pct"], 2) for g in GROUPS if g in h},
        "kept": False,
    }


def _wake(runs: Sequence[RunSteps]) -> dict[str, Any]:
    how, fs = folds(runs)
    errs_with, errs_without = [], []
    for fit_runs, held in fs:
        w = np.concatenate([r.cols["wake_s"][r.cols["after_idle"] > 0] for r in fit_runs])
        guess = float(np.median(w)) if len(w) else 0.0
        for h in held:
            hw = h.cols["wake_s"][h.cols["after_idle"] > 0]
            errs_with += list(np.abs(hw - guess))
            errs_without += list(np.abs(hw))
    allw = np.concatenate([r.cols["wake_s"][r.cols["after_idle"] > 0] for r in runs])
    med = float(np.median(allw)) if len(allw) else 0.0
    keep = bool(errs_with) and float(np.median(errs_with)) < float(np.median(errs_without))
    return {
        "n": int(len(allw)),
        "i_wake": med,
        "keep": keep,
        "held_out_median_abs_ms": float(np.median(errs_with)) * 1e3 if errs_with else None,
        "held_out_median_abs_ms_without": float(np.median(errs_without)) * 1e3 if errs_without else None,
    }


def grid_rows(samples: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """A grid's pass samples (Sample objects or profile JSON dicts; not the step or mixed
    groups) as rows for the joint fit."""
    names = list(GRID_TERMS)
    rows, secs = [], []
    for s in samples:
        if isinstance(s, dict):
            s = Sample.from_json(s)
        if s.group in ("step", "mixed"):
            continue
        f, sec = s.features, s.seconds
        if sec and sec > 0:
            rows.append([float(f.get(k, 0.0)) for k in names])
            secs.append(float(sec))
    return np.array(rows).reshape(len(rows), len(names)), np.array(secs), names


def _run_key(meta: dict[str, Any]) -> tuple:
    b, m = meta.get("blas") or {}, meta.get("machine") or {}
    return (
        meta.get("model"),
        meta.get("dtype"),
        meta.get("parameters"),
        b.get("name"),
        b.get("threads"),
        b.get("config"),
        m.get("cpu_model"),
        m.get("cpu_count"),
    )


def profile_from_runs(
    runs: Sequence[Any],
    grid_profile: dict[str, Any] | None = None,
    *,
    kind: str = "runs",
    wall_s: float | None = None,
    weigh_by: str = "prediction",
    modes: Sequence[str] | None = None,
    force: Sequence[str] = (),
) -> dict[str, Any]:
    """A profile fitted to real runs (``analysis.runfit``), on top of a grid profile's fit when
    one is given (its samples are kept: ``speed_check`` times them again). Every run, and the
    grid, must come from one model and machine. ``weigh_by``: ``Config.weigh_by``; ``modes``:
    ``fit_runs``'s (default: joint)."""
    keys = {_run_key(r.meta) for r in runs}
    if len(keys) > 1 or None in next(iter(keys))[:3]:
        raise RunsError(
            "the runs are not all of one model and machine (or lack meta.json): "
            + "; ".join(sorted({str(k[:2]) for k in keys}))
        )
    meta = runs[0].meta
    if grid_profile is not None:
        gk = _run_key(grid_profile)
        if gk != next(iter(keys)):
            raise RunsError(
                f"the grid profile was measured on {gk[:3]} {gk[6:]}, the runs on "
                f"{next(iter(keys))[:3]} {next(iter(keys))[6:]}"
            )
    base = dict(grid_profile["coefficients"]) if grid_profile else None
    samples = (grid_profile or {}).get("samples") or []
    grid = grid_rows(samples) if samples else None
    fit = fit_runs(runs, base=base, grid=grid, weigh_by=weigh_by, modes=modes, force=force)
    src = grid_profile or meta
    # a model with sliding-window or recurrent layers: what one request's cache holds, as the grid
    # profile (or the runs' engine) says it; the simulator's memory accounting reads it
    layout = (grid_profile or {}).get("cache_layout") or meta.get("cache_layout")
    layered = isinstance(layout, dict) and bool(layout.get("sliding") or layout.get("state_bytes"))
    return {
        "schema": PROFILE_SCHEMA,
        "model": meta["model"],
        "dtype": meta["dtype"],
        "parameters": meta["parameters"],
        "kv_tokens": (grid_profile or {}).get("kv_tokens", DEFAULT_KV_TOKENS),
        **({"cache_layout": layout} if layered else {}),
        "blas": {k: v for k, v in (src.get("blas") or {}).items() if k in BLAS_KEYS},
        "mlx": meta.get("mlx"),
        "mlx_lm": meta.get("mlx_lm"),
        "device": meta.get("device"),
        "machine": src.get("machine"),
        # the grid's allocator settings, or the runs' (meta.json's noise): engine.noise.allocator_settings
        "allocator": (grid_profile or {}).get("allocator")
        or {
            "malloc_keep": bool((meta.get("noise") or {}).get("malloc_keep", False)),
            "mlx_cache": (meta.get("noise") or {}).get("mlx_cache"),
        },
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "calibration": {
            "kind": kind,
            "runs": [str(r.name) for r in runs],
            "steps": fit.report["steps"],
            "grid": (grid_profile or {}).get("calibration"),
            "samples": len(samples),
            "wall_s": None if wall_s is None else round(wall_s, 1),
        },
        "coefficients": {k: fit.coefficients.get(k, 0.0) for k in FEATURES},
        "fit_report": (grid_profile or {}).get("fit_report") or {},
        "runs_report": fit.report,
        "samples": samples,
    }


# ---------------------------------------------------------------------- printing


def format_runs_report(rep: dict[str, Any]) -> str:
    ch = rep["chosen"]
    lines = [
        f"fitted to {rep['steps']} real steps of {len(rep['runs'])} run(s); held out: {rep['folds']}",
        f"chosen: {ch['mode']} fit, group balance {ch['balance']:g}, terms {', '.join(ch['terms'])}"
        + f", each step's error relative to its {_WEIGHT_WORDS[ch.get('weigh_by', 'measured')]} seconds"
        + (
            ", scales " + ", ".join(f"{k[2:]} x{v:.3f}" for k, v in ch["scales"].items() if v is not None)
            if ch.get("scales")
            else ""
        ),
    ]
    lines.append(f"{'held-out steps':<16}{'n':>7}{'med |%|':>9}{'p90 |%|':>9}{'meas/pred':>10}{'total %':>9}")
    for g in ("all",) + GROUPS:
        r = rep["held_out"].get(g)
        if r and r.get("n"):
            lines.append(
                f"{g:<16}{r['n']:>7}{r['median_abs_pct']:>9.1f}{r['p90_abs_pct']:>9.1f}"
                f"{_f(r.get('bias'), 3):>10}{r['total_pct']:>+9.1f}"
            )
    lines.append(
        "candidate terms (held-out score = mean of the groups' median |%| + |total %|; "
        f"kept when it drops by >= {rep['min_gain_pct']}):"
    )
    for t in rep["tries"]:
        if t["mode"] == ch["mode"] and t["balance"] == ch["balance"]:
            lines.append(
                f"  {t['what']:<14} score {t['score']:7.2f}  median {t['median_abs_pct']:6.2f} %  total "
                f"{t['total_pct']:+6.2f} %" + ("  kept" if t["kept"] else "")
            )
    others = {}
    for t in rep["tries"]:
        key = (t["mode"], t["balance"])
        if key != (ch["mode"], ch["balance"]):
            others[key] = min(others.get(key, math.inf), t["score"])
    for (m, b), s in sorted(others.items()):
        lines.append(f"  (not chosen: {m} fit, balance {b:g}: best score {s:.2f})")
    w = rep["wake"]
    if w["n"]:
        lines.append(
            f"wake-up after idle: median {w['i_wake'] * 1e3:.2f} ms over {w['n']} wakes"
            + (" (kept: i_wake)" if w["keep"] else " (not kept)")
        )
    return "\n".join(lines)


def _f(v, digits):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"
