"""Fitting the efficiency factors of the roofline model to measured or published speeds.

``fit_efficiency(samples)`` fits three numbers to (pass, seconds) samples:

- compute efficiency e_c (on the forwards where compute wins),
- bandwidth efficiency e_b (where memory wins),
- per-layer overhead o (every forward),

minimising the *relative* error of predicted seconds (each sample weighted by 1/seconds).
The model is linear in (1/e_c, 1/e_b, o) once each forward is classified as compute- or
memory-bound, so the fit alternates: classify with the current factors, solve a
non-negative least-squares problem in (1/e_c - 1, 1/e_b - 1, o) (which keeps both
efficiencies <= 1), reclassify, until no forward changes side. A factor the samples cannot
identify (no compute-bound forward, or bandwidth and overhead collinear because every
decode sample reads the same bytes per layer) keeps its prior value and is reported so.

Published figures (``analysis/hardware/benchmarks.json``) map to forwards by protocol:

``mlx_lm.benchmark`` (-p P -g G)
    prompt_tps = P / (one forward over P-1 prompt tokens computing logits for all of them,
    as mlx-lm's prefill does, + the first decode step at context P);
    generation_tps = 1 / (a 1-row decode at the mean context P + G/2).
``llama-bench`` ppN / tgN
    ppN = N / (one forward over N tokens, logits for the last one only);
    tgN = 1 / (a 1-row decode at the mean context N/2).

``python -m schedlab.analysis.analytic refit`` fits every preset listed under ``fits`` in that file, copies
a fitted block to the presets under ``borrow`` (marked as borrowed), writes the blocks into
``hardware.json`` and the report ``EFFICIENCY.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from schedlab.policies.base import PassShape

from .efficiency import Efficiency
from .errors import AnalyticError
from .hardware import (
    BENCHMARKS_FILE,
    HARDWARE_DIR,
    HARDWARE_FILE,
    DEFAULT_EFFICIENCY,
    Hardware,
    hardware_from_preset,
    load_hardware,
    read_hardware_file,
)
from .modelspec import ModelSpec, load_model_config, model_spec
from .roofline import AnalyticCostModel, Forward

if TYPE_CHECKING:
    import numpy as np

PARAMS = ("compute", "bandwidth", "overhead_per_layer_s")
GIB = float(1 << 30)


@dataclass
class FitResult:
    efficiency: Efficiency
    fitted: tuple[str, ...]  # which of PARAMS the data identified
    residuals: list[dict[str, Any]]  # per sample: label, measured_s, predicted_s, rel (pred/meas - 1)
    iterations: int
    notes: list[str] = field(default_factory=list)

    @property
    def max_abs_residual(self) -> float:
        return max((abs(r["rel"]) for r in self.residuals), default=0.0)

    @property
    def rms_residual(self) -> float:
        if not self.residuals:
            return 0.0
        return math.sqrt(sum(r["rel"] ** 2 for r in self.residuals) / len(self.residuals))

    def report(self) -> dict[str, Any]:
        return {
            "points": len(self.residuals),
            "fitted": list(self.fitted),
            "max_abs_residual": round(self.max_abs_residual, 4),
            "rms_residual": round(self.rms_residual, 4),
        }


# ---------------------------------------------------------------------- generic fit


def _as_model(model: Any) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Mapping):
        return model_spec(model, str(model.get("_name_or_path") or model.get("model_type") or "model"))
    if isinstance(model, (str, Path)):
        name, cfg = load_model_config(model)
        return model_spec(cfg, name)
    raise AnalyticError("fit_efficiency needs a model: a ModelSpec, a config dict, a bundled name or a path")


def _sample_forwards(
    sample: Any, default_cm: AnalyticCostModel | None
) -> tuple[AnalyticCostModel, list[Forward], float, str]:
    if isinstance(sample, tuple) and len(sample) == 2:
        sample = {"shape": sample[0], "seconds": sample[1]}
    if not isinstance(sample, Mapping):
        raise AnalyticError("each sample must be (PassShape, seconds) or a dict with 'seconds'")
    seconds = sample.get("seconds")
    if not isinstance(seconds, (int, float)) or not seconds > 0:
        raise AnalyticError(f"sample seconds must be > 0, got {seconds!r}")
    cm = sample.get("cost_model") or default_cm
    if cm is None:
        raise AnalyticError("sample has no cost model: give hardware= and model= to fit_efficiency")
    if "forwards" in sample:
        forwards = list(sample["forwards"])
    elif "shape" in sample:
        if not isinstance(sample["shape"], PassShape):
            raise AnalyticError("sample 'shape' must be a policies.base.PassShape")
        forwards = list(cm.forwards(sample["shape"]))
    else:
        raise AnalyticError("each sample needs a 'shape' or 'forwards'")
    if not forwards:
        raise AnalyticError("a sample's pass runs no forward (empty pass)")
    return cm, forwards, float(seconds), str(sample.get("label", ""))


def _sample_terms(
    sample: Any, default_cm: AnalyticCostModel | None
) -> tuple[list[tuple[float, float, int]], float, str]:
    """(per forward: seconds at peak compute, at peak bandwidth, layers), seconds, label."""
    cm, forwards, seconds, label = _sample_forwards(sample, default_cm)
    return [cm.forward_terms(f) for f in forwards], seconds, label


def _predict(terms, a: float, b: float, o: float) -> float:
    """The plain three-factor roofline over ``_sample_terms`` terms."""
    return sum(o * L + max(a * C, b * M) for C, M, L in terms)


#: every factor fit_efficiency knows, and where an unfitted optional one falls back
ALL_PARAMS = (
    "compute",
    "attention",
    "decode_attention",
    "bandwidth",
    "copy",
    "overhead_per_layer_s",
    "copy_overhead_per_layer_s",
)
OPTIONAL_PARAMS = ("attention", "decode_attention", "copy", "copy_overhead_per_layer_s")
_TIE = {"attention": "compute", "decode_attention": "attention", "copy": "bandwidth"}
_OVERHEADS = ("overhead_per_layer_s", "copy_overhead_per_layer_s")
# forward_parts order: mm, attn, dattn, mem, copy, copy events x layers, layers
_PART_PARAM = (
    "compute",
    "attention",
    "decode_attention",
    "bandwidth",
    "copy",
    "copy_overhead_per_layer_s",
    "overhead_per_layer_s",
)
_COMPUTE_PARTS = (0, 1, 2)


def _predict_parts(parts: Sequence[tuple[float, ...]], col: Sequence[int], v: Sequence[float]) -> float:
    """Seconds of one sample from its forwards' parts; ``col[k]``: the value index of part k."""
    t = 0.0
    for p in parts:
        comp = sum(v[col[k]] * p[k] for k in _COMPUTE_PARTS)
        mem = v[col[3]] * p[3]
        t += max(comp, mem) + v[col[4]] * p[4] + v[col[5]] * p[5] + v[col[6]] * p[6]
    return t


def fit_efficiency(
    samples: Iterable[Any],
    *,
    hardware: Hardware | str | None = None,
    model: Any = None,
    quant: float | None = None,
    style: str = "mlx",
    kv_bits: int = 16,
    fixed: Mapping[str, float] | None = None,
    prior: Efficiency | None = None,
    engine: str = "",
    source: str = "",
    max_iter: int = 50,
    optional: Iterable[str] = (),
    cost_model: AnalyticCostModel | None = None,
    starts: Sequence[Mapping[str, float]] = (),
) -> FitResult:
    """Fit compute/bandwidth efficiency and per-layer overhead to measured samples.

    ``samples``: ``(PassShape, seconds)`` pairs, or dicts with ``seconds`` and ``shape`` (a
    PassShape) or ``forwards`` (a list of :class:`Forward`), optionally their own
    ``cost_model`` (an :class:`AnalyticCostModel`, for samples of several models) and a
    ``label``. ``hardware`` (default ``cpu-local``), ``model`` (ModelSpec, config dict,
    bundled name or path) and ``quant`` build the cost model for samples that bring none
    (or give it whole as ``cost_model``). ``fixed``: factors to hold (e.g.
    ``{"overhead_per_layer_s": 2e-3}``); ``prior``: values for factors the data cannot
    identify (default: the hardware's current efficiency).

    ``starts``: further starting points (factor -> value) for the alternation, which finds
    a local optimum; the one with the least squared relative error wins.

    ``optional``: optional factors to fit as well (``attention``, ``decode_attention``,
    ``copy``, ``copy_overhead_per_layer_s``; see ``efficiency.Efficiency``). One not asked
    for keeps the prior's value, or, where the prior has none, falls back as the model does
    (attention to compute, decode attention to attention, copy to bandwidth, copy overhead 0).
    """
    samples = list(samples)
    if not samples:
        raise AnalyticError("fit_efficiency needs at least one sample")
    optional = tuple(optional)
    for k in optional:
        if k not in OPTIONAL_PARAMS:
            raise AnalyticError(f"unknown optional efficiency factor '{k}' (optional: {', '.join(OPTIONAL_PARAMS)})")
    default_cm = _default_cost_model(samples, cost_model, hardware, model, quant, kv_bits, style)
    rows = []
    for smp in samples:
        cm, forwards, secs, label = _sample_forwards(smp, default_cm)
        rows.append(([cm.forward_parts(f) for f in forwards], secs, label))
    fixed = dict(fixed or {})
    for k in fixed:
        if k not in ALL_PARAMS:
            raise AnalyticError(f"unknown efficiency factor '{k}' (factors: {', '.join(ALL_PARAMS)})")
    if prior is None:
        cm0 = default_cm or next(
            (s.get("cost_model") for s in samples if isinstance(s, Mapping) and s.get("cost_model")), None
        )
        prior = cm0.applied if cm0 is not None else DEFAULT_EFFICIENCY["cpu"]

    factors = _Factors(prior, fixed, optional)
    v, free_names, notes, it = _Alternation(rows, factors, max_iter).best(starts)
    factors.fall_back(v, free_names)
    fitted = tuple(n for n in ALL_PARAMS if n in free_names)
    factors.note_unidentified(fitted, notes)
    eff = factors.efficiency(v, fitted, engine or prior.engine, source or f"fit_efficiency on {len(rows)} samples")
    residuals = []
    for parts, t, label in rows:
        pred = _predict_parts(parts, factors.col, v)
        residuals.append({"label": label, "measured_s": t, "predicted_s": pred, "rel": pred / t - 1.0})
    return FitResult(efficiency=eff, fitted=fitted, residuals=residuals, iterations=it, notes=notes)


def _default_cost_model(
    samples: Sequence[Any],
    cost_model: AnalyticCostModel | None,
    hardware: Hardware | str | None,
    model: Any,
    quant: float | None,
    kv_bits: int,
    style: str,
) -> AnalyticCostModel | None:
    """The cost model of samples that bring none: ``cost_model``, or one built from hardware and model."""
    if cost_model is None and model is not None:
        hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware or "cpu-local")
        return AnalyticCostModel(hw, _as_model(model), quant, kv_bits=kv_bits, style=style)
    if (
        cost_model is None
        and isinstance(hardware, Hardware)
        and any(not (isinstance(s, Mapping) and "cost_model" in s) for s in samples)
    ):
        raise AnalyticError("fit_efficiency needs model= for samples without their own cost model")
    return cost_model


class _Factors:
    """The factors of one fit and how each takes its value.

    Each factor is free, held (fixed, or the prior's value) or tied to another (an optional
    factor neither asked for nor set in the prior). Values: 1/e for efficiencies, seconds for
    overheads. The values solved for are those of the ``roots`` (the factors not tied); ``col``
    maps each forward part to the index of its value.
    """

    def __init__(self, prior: Efficiency, fixed: Mapping[str, float], optional: tuple[str, ...]):
        self.prior = prior
        self.fixed = fixed
        self.optional = optional
        self.status: dict[str, str] = {}
        self.value: dict[str, float] = {}
        for name in ALL_PARAMS:
            self._classify(name)
        self.roots = [n for n in ALL_PARAMS if self.status[n] != "tied"]
        self.index = {n: i for i, n in enumerate(self.roots)}
        self.col = [self.index[self.root(n)] for n in _PART_PARAM]  # value index of each forward part

    def _classify(self, name: str) -> None:
        if name in self.fixed:
            self.status[name] = "fixed"
            self.value[name] = self.to_value(name, self.fixed[name])
        elif name in PARAMS or name in self.optional:
            self.status[name] = "free"
            pv = self.prior_value(name)
            if pv is None:  # start where the fallback stands
                pv = 0.0 if name in _OVERHEADS else self.value[self.root(_TIE[name])]
            self.value[name] = pv
        else:
            pv = self.prior_value(name)
            if pv is not None:
                self.status[name], self.value[name] = "held", pv
            elif name in _TIE:
                self.status[name] = "tied"
            else:  # copy overhead: 0
                self.status[name], self.value[name] = "held", 0.0

    @staticmethod
    def to_value(name: str, x: float) -> float:
        """A factor as solved for: seconds for an overhead, 1/e for an efficiency."""
        return float(x) if name in _OVERHEADS else 1.0 / float(x)

    def prior_value(self, name: str) -> float | None:
        v = getattr(self.prior, name)
        if name in _OVERHEADS:
            return float(v) if (v or name == "overhead_per_layer_s") else None
        return None if v is None else 1.0 / float(v)

    def root(self, name: str) -> str:
        """The factor whose value ``name`` takes: itself, or the one it is tied to."""
        while self.status.get(name) == "tied":
            name = _TIE[name]
        return name

    def is_free(self, name: str) -> bool:
        return self.status[name] == "free"

    def start(self, at: Any = None) -> np.ndarray:
        """The starting values, with the free factors named in ``at`` (factor -> value) moved there."""
        import numpy as np

        v = np.array([self.value[n] for n in self.roots], dtype=float)
        for n, x in at.items() if isinstance(at, Mapping) else ():
            if n in self.index and self.is_free(n):
                v[self.index[n]] = self.to_value(n, x)
        return v

    def _unidentified_fallback(self, name: str, free_names: Sequence[str]) -> str:
        """Where an unidentified optional factor falls back: the first fitted or held one."""
        name = _TIE[name]
        while name in _TIE and (self.status[name] == "tied" or (self.is_free(name) and name not in free_names)):
            name = _TIE[name]
        return name

    def fall_back(self, v: np.ndarray, free_names: Sequence[str]) -> None:
        """An optional factor asked for but not identified falls back as the model does."""
        for n in self.roots:
            if n in OPTIONAL_PARAMS and self.is_free(n) and n not in free_names and self.prior_value(n) is None:
                if n in _TIE:
                    v[self.index[n]] = v[self.index[self._unidentified_fallback(n, free_names)]]
                else:
                    v[self.index[n]] = 0.0

    def note_unidentified(self, fitted: tuple[str, ...], notes: list[str]) -> None:
        for name in ALL_PARAMS:
            if (name in PARAMS or name in self.optional) and name not in fitted and name not in self.fixed:
                pv = getattr(self.prior, name)
                msg = f"{name} not identified by these samples: prior {pv if pv is not None else 'unset'} kept"
                if not any(n.startswith(name + " ") for n in notes):
                    notes.append(msg)

    def efficiency(self, v: np.ndarray, fitted: tuple[str, ...], engine: str, source: str) -> Efficiency:
        def final(name: str) -> float | None:
            if self.status[name] == "tied" or (
                name in OPTIONAL_PARAMS
                and name not in fitted
                and name not in self.fixed
                and self.prior_value(name) is None
            ):
                return None
            x = float(v[self.index[name]])
            return x if name in _OVERHEADS else 1.0 / x

        copy_ovh = final("copy_overhead_per_layer_s")
        return Efficiency(
            compute=final("compute"),
            bandwidth=final("bandwidth"),
            overhead_per_layer_s=final("overhead_per_layer_s"),
            step_overhead_s=self.prior.step_overhead_s,
            basis="fitted",
            engine=engine,
            source=source,
            attention=final("attention"),
            decode_attention=final("decode_attention"),
            copy=final("copy"),
            copy_overhead_per_layer_s=copy_ovh or 0.0,
        )


_Row = tuple[list[tuple[float, ...]], float, str]  # a sample: its forwards' parts, seconds, label


class _Alternation:
    """Classify each forward with the current values, solve, repeat until no forward moves."""

    def __init__(self, rows: Sequence[_Row], factors: _Factors, max_iter: int):
        import numpy as np

        self.rows = rows
        self.factors = factors
        self.max_iter = max_iter
        self.is_eff = np.array([n not in _OVERHEADS for n in factors.roots])
        self.y = np.array([t for _, t, _ in rows])
        self.w = 1.0 / self.y

    def best(self, starts: Sequence[Mapping[str, float]]) -> tuple[np.ndarray, list[str], list[str], int]:
        """The alternation from the factors' own values and from each of ``starts`` (it finds a
        local optimum): the one of least squared relative error."""
        best = self.run(self.factors.start())
        for st in starts:
            cand = self.run(self.factors.start(st))
            if self.sse(cand[0]) < self.sse(best[0]) - 1e-12:
                best = cand
        return best

    def sse(self, v: np.ndarray) -> float:
        col = self.factors.col
        return float(sum(((_predict_parts(parts, col, v) - t) / t) ** 2 for parts, t, _ in self.rows))

    def run(self, v: np.ndarray) -> tuple[np.ndarray, list[str], list[str], int]:
        """(values, the factors fitted, notes, iterations) from the start ``v`` (changed in place)."""
        notes: list[str] = []
        free_names: list[str] = []
        prev = None
        it = 0
        for it in range(1, self.max_iter + 1):
            side = self._sides(v)
            key = tuple(tuple(s) for s in side)
            if key == prev:
                break
            prev = key
            X = self._design(side)
            free = self._identified(X, v, notes)
            self._solve(X, free, v)
            free_names = [self.factors.roots[j] for j in free]
        return v, free_names, notes, it

    def _sides(self, v: np.ndarray) -> list[list[bool]]:
        """Per sample, per forward: whether compute wins at the values ``v``."""
        col = self.factors.col
        return [
            [sum(v[col[k]] * p[k] for k in _COMPUTE_PARTS) >= v[col[3]] * p[3] for p in parts]
            for parts, _, _ in self.rows
        ]

    def _design(self, side: list[list[bool]]) -> np.ndarray:
        """The linear system's matrix: per sample, per value, the seconds it multiplies."""
        import numpy as np

        col = self.factors.col
        X = np.zeros((len(self.rows), len(self.factors.roots)))
        for i, (parts, _, _) in enumerate(self.rows):
            for p, comp in zip(parts, side[i]):
                for k in _COMPUTE_PARTS if comp else (3,):
                    X[i, col[k]] += p[k]
                for k in (4, 5, 6):
                    X[i, col[k]] += p[k]
        return X

    def _singular_values(self, X: np.ndarray, cols: list[int]) -> np.ndarray:
        import numpy as np

        sub = X[:, cols] * self.w[:, None]
        return np.linalg.svd(sub / np.maximum(np.abs(sub).max(axis=0), 1e-300), compute_uv=False)

    def _identified(self, X: np.ndarray, v: np.ndarray, notes: list[str]) -> list[int]:
        """The value indices to solve for: the free factors the samples identify."""
        roots, index = self.factors.roots, self.factors.index
        free = [j for j, n in enumerate(roots) if self.factors.is_free(n) and X[:, j].any()]
        # collinear bandwidth/overhead (one bytes-per-layer ratio in every memory-bound row)
        jb, jo = index["bandwidth"], index["overhead_per_layer_s"]
        if jb in free and jo in free:
            sv = self._singular_values(X, [jb, jo])
            if sv[-1] < 1e-3 * sv[0]:
                free.remove(jo)
                v[jo] = self.factors.prior.overhead_per_layer_s
                msg = "overhead_per_layer_s not identified (collinear with bandwidth): prior kept"
                if msg not in notes:
                    notes.append(msg)
        # any other degeneracy: drop optional factors, last first, until the rest is identified
        while len(free) > 1:
            sv = self._singular_values(X, free)
            if sv[-1] >= 1e-6 * sv[0]:
                break
            drop = next((j for j in reversed(free) if roots[j] in OPTIONAL_PARAMS), None)
            if drop is None:
                break
            free.remove(drop)
            msg = f"{roots[drop]} not identified (collinear with other factors): prior kept"
            if msg not in notes:
                notes.append(msg)
        return free

    def _solve(self, X: np.ndarray, free: list[int], v: np.ndarray) -> None:
        """Non-negative least squares for the ``free`` values, the others held, into ``v``."""
        from schedlab.sim.cost import nnls

        is_eff, w = self.is_eff, self.w
        # efficiencies enter as 1 + u (u >= 0 keeps them <= 1): move the 1s and held values right
        rhs = self.y - X[:, is_eff].sum(axis=1)
        for j in range(len(self.factors.roots)):
            if j not in free:
                rhs = rhs - X[:, j] * (v[j] - 1.0 if is_eff[j] else v[j])
        if free:
            sol = nnls(X[:, free] * w[:, None], rhs * w)
            for j, u in zip(free, sol):
                v[j] = (1.0 + float(u)) if is_eff[j] else float(u)


# ---------------------------------------------------------------------- published benchmarks


def load_benchmarks(path: Path | None = None) -> dict[str, Any]:
    p = path or BENCHMARKS_FILE
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AnalyticError(f"cannot read benchmarks file {p}: {exc}") from None
    return data


def point_forwards(point: Mapping[str, Any]) -> tuple[list[Forward], float]:
    """Forwards one published figure stands for, and how many tokens it counts per time."""
    proto = point.get("protocol")
    if proto == "mlx_lm.benchmark":
        p, g = int(point["prompt"]), int(point["generation"])
        if point["metric"] == "prompt_tps":
            n = p - 1
            return [Forward(n, n, n * (n + 1) / 2.0, 0, n), Forward(1, 1, p, p - 1, 1)], float(p)
        if point["metric"] == "generation_tps":
            c = p + g / 2.0
            return [Forward(1, 1, c, c - 1, 1)], 1.0
    elif proto == "llama-bench":
        test = str(point["test"])
        n = int(test[2:])
        if test.startswith("pp"):
            return [Forward(n, 1, n * (n + 1) / 2.0, 0, n)], float(n)
        if test.startswith("tg"):
            c = n / 2.0
            return [Forward(1, 1, c, max(c - 1, 0), 1)], 1.0
    raise AnalyticError(f"unknown benchmark protocol {proto!r} / {point.get('metric') or point.get('test')!r}")


def point_model(point: Mapping[str, Any]) -> ModelSpec:
    if isinstance(point.get("model_config"), Mapping):
        return model_spec(point["model_config"], point["model"])
    name, cfg = load_model_config(point["model"])
    return model_spec(cfg, name)


def point_cost_model(point: Mapping[str, Any], hw: Hardware) -> AnalyticCostModel:
    m = point_model(point)
    bpw = None
    if "weight_gib" in point:  # a GGUF file: its size over the parameters
        bpw = point["weight_gib"] * GIB * 8.0 / m.total_params
    bits = point.get("bits")
    return AnalyticCostModel(
        hw,
        m,
        None if bpw is not None else bits,
        bpw=bpw,
        group_size=int(point.get("group_size", 64)),
        peak_scale=float(point.get("peak_scale", 1.0)),
    )


def point_label(p: Mapping[str, Any]) -> str:
    what = p.get("metric") or p.get("test")
    return " ".join(str(x) for x in (p["hardware"], p["model"], p.get("precision", ""), what) if x)


def predict_point(point: Mapping[str, Any], hw: Hardware, eff: Efficiency | None = None) -> float:
    """Predicted tok/s for a published figure with ``eff`` (default: the preset's)."""
    cm = point_cost_model(point, hw)
    if eff is not None:
        cm = cm.with_efficiency(eff)
    forwards, count = point_forwards(point)
    return count / sum(cm.forward_seconds(f) for f in forwards)


@dataclass
class PresetFit:
    """A preset's fit: dense factors, MoE factors, and the check points."""

    preset: str
    efficiency: Efficiency  # dense factors, with the ``moe`` block
    dense: FitResult | None
    moe: FitResult | None
    moe_basis: str
    fit_points: list[dict[str, Any]]  # the points of dense then moe, in residual order
    checks: list[dict[str, Any]]  # label, published, predicted, rel (time), reason
    notes: list[str] = field(default_factory=list)

    @property
    def residuals(self) -> list[dict[str, Any]]:
        return (self.dense.residuals if self.dense else []) + (self.moe.residuals if self.moe else [])

    @property
    def max_abs_residual(self) -> float:
        return max((abs(r["rel"]) for r in self.residuals), default=0.0)

    @property
    def rms_residual(self) -> float:
        r = self.residuals
        return math.sqrt(sum(x["rel"] ** 2 for x in r) / len(r)) if r else 0.0

    def report(self) -> dict[str, Any]:
        out = {
            "points": len(self.residuals),
            "max_abs_residual": round(self.max_abs_residual, 4),
            "rms_residual": round(self.rms_residual, 4),
        }
        if self.dense:
            out["dense"] = self.dense.report()
        if self.moe:
            out["moe"] = self.moe.report()
        held = [abs(c["rel"]) for c in self.checks if c["reason"].startswith("held out")]
        if held:
            out["held_out_checks"] = len(held)
            out["held_out_max_abs_residual"] = round(max(held), 4)
        if self.notes:
            out["notes"] = self.notes
        return out


def _samples(points: Sequence[Mapping[str, Any]], hw: Hardware) -> list[dict[str, Any]]:
    out = []
    for p in points:
        forwards, count = point_forwards(p)
        out.append(
            {
                "forwards": forwards,
                "seconds": count / float(p["tok_s"]),
                "cost_model": point_cost_model(p, hw),
                "label": point_label(p),
            }
        )
    return out


def _bare_hardware(name: str) -> Hardware:
    data = read_hardware_file()
    if name not in data["presets"]:
        raise AnalyticError(f"benchmarks name an unknown preset '{name}'")
    return hardware_from_preset(
        name, {k: v for k, v in data["presets"][name].items() if k not in ("efficiency", "engines", "default_engine")}
    )


def fit_preset(name: str, bench: Mapping[str, Any], done: Mapping[str, PresetFit] | None = None) -> PresetFit:
    """Fit one preset from its benchmark points (as ``refit`` does)."""
    done = dict(done or {})
    spec = next((f for f in bench.get("fits", []) if f["preset"] == name), {"preset": name})
    hw = _bare_hardware(name)
    mine = [p for p in bench["points"] if p["hardware"] == name]
    fit_pts = [p for p in mine if p.get("role", "fit") == "fit"]
    if not fit_pts:
        raise AnalyticError(f"no benchmark points to fit for preset '{name}'")
    dense_pts = [p for p in fit_pts if not point_model(p).is_moe]
    moe_pts = [p for p in fit_pts if point_model(p).is_moe]
    engine = spec.get("engine") or fit_pts[0].get("engine", "")
    sources = sorted({p["source"] for p in fit_pts})
    source = "fitted to " + ", ".join(sources) + " (analysis/hardware/benchmarks.json)"
    notes: list[str] = []
    fixed = {}
    for factor, src in (spec.get("fix") or {}).items():
        if src not in done:
            done[src] = fit_preset(src, bench, done)
        fixed[factor] = getattr(done[src].efficiency, factor)
        notes.append(f"{factor} held at {src}'s fitted value ({fixed[factor]:.4g}): {spec.get('why', '')}".rstrip(": "))
    dense = (
        fit_efficiency(_samples(dense_pts, hw), fixed=fixed, prior=hw.efficiency, engine=engine, source=source)
        if dense_pts
        else None
    )
    if dense is None:
        raise AnalyticError(f"preset '{name}' has MoE points only; fit needs dense points")
    notes += dense.notes
    eff = dense.efficiency
    moe = None
    if moe_pts:
        moe = fit_efficiency(_samples(moe_pts, hw), prior=eff, engine=engine, source=source)
        notes += [f"moe: {n}" for n in moe.notes]
        me = moe.efficiency
        moe_block = {
            "compute": me.compute,
            "bandwidth": me.bandwidth,
            "overhead_per_layer_s": me.overhead_per_layer_s,
            "basis": "fitted",
            "source": source + ", MoE points",
        }
        moe_basis = "fitted"
    else:
        ref = bench.get("moe_reference")
        if ref and ref != name:
            if ref not in done:
                done[ref] = fit_preset(ref, bench, done)
            r = done[ref].efficiency
            rm = r.moe or {}
            if rm:
                moe_block = {
                    "compute": min(1.0, eff.compute * rm["compute"] / r.compute),
                    "bandwidth": min(1.0, eff.bandwidth * rm["bandwidth"] / r.bandwidth),
                    "overhead_per_layer_s": eff.overhead_per_layer_s
                    * (rm["overhead_per_layer_s"] / r.overhead_per_layer_s if r.overhead_per_layer_s else 1.0),
                    "basis": "scaled",
                    "source": f"no MoE figures for this chip: its dense factors times {ref}'s MoE/dense ratios",
                }
                moe_basis = f"scaled from {ref}"
            else:
                moe_block, moe_basis = None, "none"
        else:
            moe_block, moe_basis = None, "none"
    if moe_block:
        eff = Efficiency(
            eff.compute,
            eff.bandwidth,
            eff.overhead_per_layer_s,
            eff.step_overhead_s,
            "fitted",
            eff.engine,
            eff.source,
            moe=moe_block,
        )
    checks = []
    for p in mine:
        if p.get("role", "fit") == "fit":
            continue
        pred = predict_point(p, hw, eff)
        pub = float(p["tok_s"])
        checks.append(
            {
                "label": point_label(p),
                "published": pub,
                "predicted": pred,
                "rel": pub / pred - 1.0,
                "reason": p.get("reason", ""),
            }
        )
    return PresetFit(
        preset=name,
        efficiency=eff,
        dense=dense,
        moe=moe,
        moe_basis=moe_basis,
        fit_points=dense_pts + moe_pts,
        checks=checks,
        notes=notes,
    )


def _rounded_block(eff: Efficiency) -> dict[str, Any]:
    def r(v: float, key: str) -> float:
        return float(f"{v:.4g}") if key == "overhead_per_layer_s" else round(v, 4)

    block = eff.to_dict()
    for k in ("compute", "bandwidth", "overhead_per_layer_s"):
        block[k] = r(block[k], k)
    if block.get("moe"):
        block["moe"] = {
            k: (r(v, k) if k in ("compute", "bandwidth", "overhead_per_layer_s") else v)
            for k, v in block["moe"].items()
        }
    return block


def refit(write: bool = True, bench_path: Path | None = None) -> dict[str, PresetFit]:
    """Fit every preset under ``fits``, borrow for the rest, and (``write``) update
    hardware.json's efficiency blocks and EFFICIENCY.md."""
    bench = load_benchmarks(bench_path)
    results: dict[str, PresetFit] = {}
    for spec in bench.get("fits", []):
        results[spec["preset"]] = fit_preset(spec["preset"], bench, results)
    if write:
        data = read_hardware_file()
        for name, res in results.items():
            block = _rounded_block(res.efficiency)
            block["fit"] = res.report()
            data["presets"][name]["efficiency"] = block
        for name, src in bench.get("borrow", {}).items():
            if src not in results:
                raise AnalyticError(f"preset {name} borrows from {src}, which is not fitted")
            block = dict(data["presets"][src]["efficiency"])
            block.pop("fit", None)
            block["basis"] = "borrowed"
            block["from"] = src
            if block.get("moe"):
                block["moe"] = dict(block["moe"], basis="borrowed")
            block["source"] = (
                f"no published single-request figures found for this chip; borrowed from {src} "
                f"(same family), whose factors were {block['source']}"
            )
            data["presets"][name]["efficiency"] = block
        HARDWARE_FILE.write_text(json.dumps(data, indent=2) + "\n")
        (HARDWARE_DIR / "EFFICIENCY.md").write_text(efficiency_report(results, bench))
        (HARDWARE_DIR / "PRESETS.md").write_text(presets_report(data))
    return results


def presets_report(data: Mapping[str, Any]) -> str:
    """A compact table of the presets with every figure's sources (written by ``refit``)."""
    L = [
        "# Hardware presets",
        "",
        "Generated by `python -m schedlab.analysis.analytic refit` from `hardware.json`; do not edit by hand. Peak TFLOP/s",
        "are dense (no 2:4 sparsity); the compute column is the dtype the roofline uses (fp16 tensor rate on",
        "NVIDIA; on Apple GPUs fp16 runs at the fp32 rate). Figures marked * are derived or uncertain: see",
        "the note beside them in `hardware.json`. `cpu-local` is measured on first use and cached.",
        "",
        "Efficiencies belong to an engine: *default engine* is the one `--hardware` uses (`vllm`: a GPU serving",
        "engine, factors fitted to serving kernels, `SERVING.md`); *published fit* is the `mlx-lm` / `llama.cpp`",
        'fit to single-request figures (`EFFICIENCY.md`), available as `engine="llama.cpp"` / `"mlx-lm"`.',
        "One GPU per replica: tensor parallelism is not modelled. *$/h* is one provider's on-demand price of",
        "one GPU (`capacity`'s requests per dollar; give your own with `--price-per-hour`), where one is sourced.",
        "",
        "| preset | name | memory GB | bandwidth GB/s | peak TFLOP/s (compute dtype) | $/h | default engine | published fit (engine, basis) |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    presets = data["presets"]
    for name in sorted(presets):
        p = presets[name]
        if name == "cpu-local":
            L.append(
                f"| {name} | {p['name']} | measured | measured | measured (fp32) | - | mlx (CPU) | prior: fit yours |"
            )
            continue
        dt = p["default_compute"]
        peak = p["peak_tflops"][dt]

        def mark(fig: Mapping[str, Any]) -> str:
            note = str(fig.get("note", "")).lower()
            return "*" if any(w in note for w in ("derived", "uncertain")) else ""

        eff = p.get("efficiency", {})
        basis = eff.get("basis", "default") + (f" from {eff['from']}" if eff.get("from") else "")
        pub = str(eff.get("engine", "")).split(" ")[0] or "-"
        default = p.get("default_engine")
        if default and default in (p.get("engines") or {}):
            blk = p["engines"][default]
            default = f"{default} ({blk.get('basis', '')}{' from ' + blk['from'] if blk.get('from') else ''})"
        else:
            default = f"{pub} (published fit)"
        price = p.get("price_usd_per_hour")
        L.append(
            f"| {name} | {p['name']} | {p['memory_gb']['value']:g}{mark(p['memory_gb'])} | "
            f"{p['bandwidth_gbs']['value']:g}{mark(p['bandwidth_gbs'])} | {peak['value']:g}{mark(peak)} ({dt}) | "
            f"{format(price['value'], 'g') if price else '-'} | {default} | {pub}, {basis} |"
        )
    L += ["", "## Sources of each figure", ""]
    for name in sorted(presets):
        p = presets[name]
        if name == "cpu-local":
            continue
        parts = [
            f"memory {', '.join(p['memory_gb']['sources'])}",
            f"bandwidth {', '.join(p['bandwidth_gbs']['sources'])}",
        ]
        for dt, fig in p["peak_tflops"].items():
            parts.append(f"{dt} {', '.join(fig['sources'])}")
        if p.get("price_usd_per_hour"):
            parts.append(f"price {', '.join(p['price_usd_per_hour']['sources'])}")
        L.append(f"- **{name}**: " + "; ".join(parts))
    L += ["", "## Sources", ""]
    for sid, s in data["sources"].items():
        L.append(f"- `{sid}`: {s['title']}. {s['url']}" + (f" ({s['note']})" if s.get("note") else ""))
    L.append("")
    return "\n".join(L)


def efficiency_report(results: Mapping[str, PresetFit], bench: Mapping[str, Any]) -> str:
    """The markdown written next to the data: fits, points, residuals, checks."""
    L = [
        "# Efficiency fits",
        "",
        "Generated by `python -m schedlab.analysis.analytic refit` from `benchmarks.json`; do not edit by hand.",
        "",
        "Each preset's roofline (`analysis/analytic/roofline.py`) needs three numbers: the fraction of peak FLOP/s",
        "reached on compute-bound forwards (**compute**), the fraction of peak bandwidth reached on memory-bound",
        "forwards (**bandwidth**), and a per-layer, per-forward floor (**overhead**). They are fitted by",
        "`analysis.analytic.fit_efficiency` to published single-request (batch 1) figures, minimising relative error.",
        "MoE models get their own three numbers (gathered expert matmuls run slower than dense ones): fitted",
        f"where MoE figures exist ({bench.get('moe_reference', '-')}), elsewhere the chip's dense factors times the",
        "reference chip's MoE/dense ratios.",
        "",
        "**Residual** = predicted seconds / published seconds - 1 (positive: the model is slower than the figure).",
        "**Checks** are published figures not used in the fit (held-out model sizes, or figures the roofline is",
        "known not to describe); their residual is published tok/s / predicted tok/s - 1, the same sign convention.",
        "",
        "The factors belong to the engine that produced the figures: MLX for the M4 family, llama.cpp (May 2024",
        "builds) for the other chips. On H100/A100/L40S llama.cpp reaches only ~20-30% of peak FLOP/s in a",
        "512-token prefill, far from vLLM / TensorRT-LLM: the NVIDIA presets therefore default to the `vllm`",
        'engine, fitted to serving kernels (`SERVING.md`); these factors stay available as `engine="llama.cpp"`.',
        "Refit with your own measurements (`fit_efficiency`) when you can.",
        "",
        "| preset | engine | compute | bandwidth | overhead/layer | MoE compute / bw / overhead | fit points | max abs residual | rms | held-out (70B) max abs |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        e = r.efficiency
        m = e.moe
        moe = (
            f"{m['compute']:.3f} / {m['bandwidth']:.3f} / {m['overhead_per_layer_s'] * 1e6:.0f} us ({r.moe_basis})"
            if m
            else "-"
        )
        held = [abs(c["rel"]) for c in r.checks if c["reason"].startswith("held out")]
        chk = f"{max(held):.1%}" if held else "-"
        L.append(
            f"| {name} | {e.engine} | {e.compute:.3f} | {e.bandwidth:.3f} | {e.overhead_per_layer_s * 1e6:.0f} us"
            f" | {moe} | {len(r.residuals)} | {r.max_abs_residual:.1%} | {r.rms_residual:.1%} | {chk} |"
        )
    L += ["", "Borrowed (no published figures found for the chip; factors copied from a chip of the same family):", ""]
    for name, src in bench.get("borrow", {}).items():
        L.append(f"- {name} <- {src}")
    L += [
        "",
        "Where a fit has as many points as free factors (a100-80gb-sxm, l40s, m1) it is exact: a zero",
        "residual there says nothing about accuracy; the checks do.",
        "",
        "## Points, residuals and checks",
        "",
    ]
    for name, r in results.items():
        L += [f"### {name}", ""]
        for n in r.notes:
            L.append(f"- {n}")
        if r.notes:
            L.append("")
        L += ["| fitted point | published tok/s | predicted tok/s | residual |", "|---|---:|---:|---:|"]
        for res, p in zip(r.residuals, r.fit_points):
            pub = float(p["tok_s"])
            L.append(f"| {res['label']} | {pub:g} | {pub / (1 + res['rel']):.1f} | {res['rel']:+.1%} |")
        if r.checks:
            L += [
                "",
                "| check (not fitted) | published tok/s | predicted tok/s | residual | why not fitted |",
                "|---|---:|---:|---:|---|",
            ]
            for c in r.checks:
                L.append(
                    f"| {c['label']} | {c['published']:g} | {c['predicted']:.1f} | {c['rel']:+.1%} | {c['reason']} |"
                )
        L.append("")
    L += ["## Sources", ""]
    for sid, s in bench.get("sources", {}).items():
        L.append(f"- `{sid}`: {s['title']}. {s['url']}" + (f" ({s['note']})" if s.get("note") else ""))
    L.append("")
    return "\n".join(L)
