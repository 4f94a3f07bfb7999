"""Cost models: a measured profile (``Profile``, ``load_profile``), the model ``simulate`` would
use with its KV capacity (``ReplicaCostModel``, ``cost_model``), and whether a profile was measured on
a given model and machine (``profile_mismatch``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Union

from ..errors import SchedlabError, opt
from ._base import as_path, check_kv_tokens, check_model, check_model_seed, fail, public

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


class Profile:
    """A cost-model profile (what ``calibrate`` writes): coefficients of the linear cost model,
    the fit report, the samples it was fitted to, and where it was measured.

    ``path`` is the file it was read from or written to (None for one kept in memory: ``save``
    it, or pass it as it is to ``simulate``/``run_real``/``validate``)."""

    def __init__(self, data: Mapping[str, Any], path: str | Path | None = None):
        self._data = dict(data)
        self.path = Path(path) if path is not None else None
        self._tmp: Path | None = None

    @property
    def data(self) -> dict[str, Any]:
        """The profile JSON (a copy)."""
        return copy.deepcopy(self._data)

    @property
    def model(self) -> str | None:
        return self._data.get("model")

    @property
    def kv_tokens(self) -> int:
        from schedlab.sim.cost import DEFAULT_KV_TOKENS

        return int(self._data.get("kv_tokens", DEFAULT_KV_TOKENS))

    @property
    def coefficients(self) -> dict[str, float]:
        """The cost model's coefficients: seconds per unit of each term (see sim/cost.py)."""
        return dict(self._data.get("coefficients") or {})

    @property
    def fit_report(self) -> dict[str, Any]:
        """The fit report: per group R^2 on the fitted points, errors on held-out points."""
        return copy.deepcopy(self._data.get("fit_report") or {})

    @property
    def fit(self) -> "pd.DataFrame":
        """The fit report as a table: one row per group (decode, join, leave, prefill, step,
        mixed, all passes, held-out passes), with R^2 and |error| % on fitted and held-out points."""
        import pandas as pd

        rows = []
        rep = self._data.get("fit_report") or {}
        for group, r in rep.items():
            if not isinstance(r, dict):
                continue
            fit = r.get("fit", {}) if "fit" in r else {}
            held = r.get("held_out", r if "median_abs_pct" in r else {})
            rows.append(
                {
                    "group": group,
                    "r2": r.get("r2"),
                    "fit_median_abs_pct": fit.get("median_abs_pct"),
                    "held_out_n": held.get("n"),
                    "held_out_median_abs_pct": held.get("median_abs_pct"),
                    "held_out_max_abs_pct": held.get("max_abs_pct"),
                }
            )
        return pd.DataFrame(rows).set_index("group") if rows else pd.DataFrame()

    @property
    def samples(self) -> "pd.DataFrame":
        """The timed passes the fit used: group, label, seconds, and one column per feature."""
        import pandas as pd

        rows = [
            {"group": s.get("group"), "label": s.get("label"), "seconds": s.get("seconds"), **(s.get("features") or {})}
            for s in self._data.get("samples") or []
        ]
        return pd.DataFrame(rows)

    @property
    def analytic(self) -> dict[str, Any] | None:
        """``calibrate --analytic``'s fitted cpu-local roofline factors, when the profile has them."""
        block = self._data.get("analytic_cpu_local")
        return copy.deepcopy(block) if block is not None else None

    @property
    def meta(self) -> dict[str, Any]:
        """Where and how it was measured: everything but the coefficients and the samples."""
        return {k: copy.deepcopy(v) for k, v in self._data.items() if k not in ("coefficients", "samples")}

    @property
    def acceptance(self) -> dict[str, Any] | None:
        """``calibrate --speculative``'s measured acceptance of speculative drafts (``accept``: per
        position; the counters, method, k, model and trace it was measured on), when it has one."""
        block = self._data.get("acceptance")
        return copy.deepcopy(block) if block is not None else None

    def report(self) -> str:
        """The fit report as ``calibrate`` prints it (and the acceptance it measured)."""
        from schedlab.analysis.fit import format_report

        from schedlab.analysis.speculation import acceptance_line

        extra = "\n" + acceptance_line(self._data["acceptance"]) if self.acceptance is not None else ""
        if not {"fit_report", "calibration"} <= set(self._data):
            if self.acceptance is not None and not self.coefficients:  # (calibrate --acceptance-only)
                return extra.strip()
            return f"profile {self.path or ''}: {len(self.coefficients)} coefficients (no fit report)".strip() + extra
        text = format_report(self._data)
        if self.analytic is not None:
            text += "\n" + format_analytic(self._data["analytic_cpu_local"])
        return text + extra

    def mismatch(self, model: str = "tiny", dtype: str = "float32", model_seed: int = 0) -> str | None:
        """Why this profile was not measured on ``model`` on this machine (the model, dtype,
        BLAS, CPU it names differ from here), or None when it was: ``run_real`` and
        ``validate`` use a profile that matches, and warn about one that does not."""
        return profile_mismatch(self, model=model, dtype=dtype, model_seed=model_seed)

    def cost_model(self, kv_tokens: int | None = None) -> "ReplicaCostModel":
        """The linear cost model of this profile and its KV capacity (``kv_tokens``: another)."""
        return cost_model(profile=self, kv_tokens=kv_tokens)

    def save(self, path: str | Path) -> Path:
        """Write the profile JSON and its markdown fit report beside it (``.md``)."""
        from schedlab.analysis.speculation import ACCEPTANCE_SCHEMA, acceptance_line
        from schedlab.engine.calibrate import write_profile

        path = as_path(path, "path")
        if path.is_dir():
            raise SchedlabError(f"{path} is a directory; give a file name")
        try:
            if self._data.get("schema") == ACCEPTANCE_SCHEMA:  # (calibrate --acceptance-only: no fit to report)
                path.write_text(json.dumps(self._data, indent=1) + "\n")
                return self._saved(path)
            write_profile(self._data, path)
            if self.analytic is not None:
                with path.with_suffix(".md").open("a") as fh:
                    fh.write("\n" + analytic_markdown(self._data["analytic_cpu_local"]))
            if self.acceptance is not None:
                with path.with_suffix(".md").open("a") as fh:
                    fh.write("\n## Speculative acceptance\n\n" + acceptance_line(self._data["acceptance"]) + "\n")
        except OSError as exc:
            raise SchedlabError(f"cannot write {path}: {exc.strerror or exc}") from None
        return self._saved(path)

    def _saved(self, path: Path) -> Path:
        if self.path is None:
            self.path = path
        return path

    def _file(self) -> Path:
        """A file holding this profile (a temporary one for a profile kept in memory)."""
        if self.path is not None:
            return self.path
        if self._tmp is None:
            import tempfile

            self._tmp = Path(tempfile.mkdtemp(prefix="schedlab-profile-")) / "profile.json"
            self._tmp.write_text(json.dumps(self._data, indent=1) + "\n")
        return self._tmp

    def __repr__(self) -> str:
        cal = self._data.get("calibration") or {}
        return (
            f"Profile(model={self.model!r}, dtype={self._data.get('dtype')!r}, "
            f"grid={cal.get('grid')!r}, samples={cal.get('samples')}, path={str(self.path) if self.path else None!r})"
        )


class ReplicaCostModel:
    """What ``cost_model`` resolves for a replica: a cost model (seconds of a pass and of a step's
    own work: a measured profile's linear model, or the analytic roofline of a machine) with the
    KV capacity it comes with and where it came from. It is not ``policies.base.CostModel``, the
    protocol the loop charges and a policy reads (this wraps one: ``model``). Everything
    else the underlying model offers (e.g. the analytic model's ``forwards``, ``flops``,
    ``bytes``, ``bound``, ``hardware``, ``applied``) is reachable on this object too.

    ``source`` is what meta.json records for it: ``{"profile": path}`` or ``{"analytic": meta}``;
    ``meta`` is the profile's metadata, or the analytic model's (weights, KV bytes per token,
    ...)."""

    def __init__(self, model: Any, kv_tokens: int, source: Mapping[str, Any]):
        self.model = model
        self.kv_tokens = int(kv_tokens)
        self.source = dict(source)

    def pass_seconds(self, shape: Any) -> float:
        """Seconds of one pass of ``shape`` (a ``policies.base.PassShape``)."""
        return self.model.pass_seconds(shape)

    def step_overhead_seconds(self, n_passes: int, n_rows: int) -> float:
        """Seconds of a step's own work (planning, bookkeeping) for its passes and rows."""
        return self.model.step_overhead_seconds(n_passes, n_rows)

    @property
    def meta(self) -> dict[str, Any]:
        if "analytic" in self.source:
            return copy.deepcopy(self.source["analytic"])
        m = getattr(self.model, "meta", None)
        m = m() if callable(m) else m
        return copy.deepcopy(dict(m or {}))

    def __getattr__(self, name: str) -> Any:
        if name in ("model", "kv_tokens", "source") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.model, name)

    def __repr__(self) -> str:
        what = (
            self.source.get("profile")
            or (self.source.get("analytic") or {}).get("hardware")
            or type(self.model).__name__
        )
        return f"ReplicaCostModel({type(self.model).__name__}, {what}, kv_tokens={self.kv_tokens})"


ProfileLike = Union[str, Path, Profile, None]


def profile_path(profile: ProfileLike) -> Path:
    """A profile file: ``profile`` (a path, a bundled name, a ``Profile``), else the default."""
    from schedlab.sim.profiles import resolve_profile

    if isinstance(profile, Profile):
        return profile._file()
    return resolve_profile(None if profile is None else str(profile))


def linear_model(profile: ProfileLike, kv_tokens: int | None):
    """(linear cost model, KV capacity, profile path)."""
    from schedlab.sim.cost import DEFAULT_KV_TOKENS, LinearCostModel

    check_kv_tokens(kv_tokens)
    path = profile_path(profile)
    cost = LinearCostModel.from_profile(path)
    capacity = kv_tokens if kv_tokens is not None else int(cost.meta.get("kv_tokens", DEFAULT_KV_TOKENS))
    return cost, capacity, path


def pick_cost(profile: ProfileLike, kv_tokens, hardware, model_config, quant, cost=None):
    """(cost model, KV capacity, what meta.json records): ``cost`` (a model object) as it is, a
    measured profile (the default), or the analytic model of ``hardware`` + ``model_config``."""
    if cost is not None:
        if any(x is not None for x in (profile, hardware, model_config, quant)):
            fail(f"give either cost or {opt('profile')} / {opt('hardware')}, not both", 2)
        check_kv_tokens(kv_tokens)
        if isinstance(cost, Profile):
            return pick_cost(cost, kv_tokens, None, None, None)
        if isinstance(cost, ReplicaCostModel):
            return cost.model, (kv_tokens if kv_tokens is not None else cost.kv_tokens), dict(cost.source)
        if not (
            callable(getattr(cost, "pass_seconds", None)) and callable(getattr(cost, "step_overhead_seconds", None))
        ):
            fail(
                f"a cost model has pass_seconds(shape) and step_overhead_seconds(passes, rows); "
                f"got {type(cost).__name__}",
                2,
            )
        from schedlab.sim.cost import DEFAULT_KV_TOKENS

        meta = getattr(cost, "meta", None)
        meta = meta if isinstance(meta, Mapping) else {}
        capacity = kv_tokens if kv_tokens is not None else int(meta.get("kv_tokens", DEFAULT_KV_TOKENS))
        return cost, capacity, {"cost_model": type(cost).__name__}
    if hardware is None and model_config is None:
        if quant is not None:
            fail(f"{opt('quant')} goes with {opt('hardware')} and {opt('model_config')}", 2)
        model, capacity, path = linear_model(profile, kv_tokens)
        return model, capacity, {"profile": str(path)}
    if not (hardware and model_config):
        fail(f"{opt('hardware')} and {opt('model_config')} go together", 2)
    if profile is not None:
        fail(f"give either {opt('profile')} or {opt('hardware')}/{opt('model_config')}, not both", 2)
    check_kv_tokens(kv_tokens)
    from schedlab.analysis.analytic import make_analytic_cost_model
    from schedlab.analysis.analytic.modelspec import check_quant

    try:
        check_quant(quant, opt("quant"))  # (first, named as the caller names it)
    except ValueError as exc:
        fail(str(exc), 2)
    model, capacity, meta = make_analytic_cost_model(hardware, model_config, quant)
    return model, (kv_tokens if kv_tokens is not None else capacity), {"analytic": meta}


@public
def cost_model(
    profile: ProfileLike = None,
    *,
    kv_tokens: int | None = None,
    hardware: str | None = None,
    model_config: str | Path | None = None,
    quant: int | None = None,
) -> ReplicaCostModel:
    """The cost model ``simulate`` would use, with its KV capacity: a measured profile's
    linear model (``profile``: a path, a bundled name or a ``Profile``; default: the bundled
    one), or the analytic roofline of ``hardware`` (a preset: ``m4-max``, ``h100-sxm``, ...)
    running ``model_config`` (``qwen3-8b``, a config.json) at ``quant`` bits."""
    model, capacity, meta = pick_cost(profile, kv_tokens, hardware, model_config, quant)
    return ReplicaCostModel(model, capacity, meta)


@public
def load_profile(profile: str | Path | None = None) -> Profile:
    """A cost profile from a file or a bundled name (default: the bundled measured profile)."""
    from schedlab.sim.cost import read_profile

    path = profile_path(profile)
    return Profile(read_profile(path), path)


@public
def profile_mismatch(
    profile: ProfileLike, *, model: str = "tiny", dtype: str = "float32", model_seed: int = 0
) -> str | None:
    """Why ``profile`` was not measured on ``model`` on this machine, or None when it was."""
    from schedlab.engine.calibrate import profile_mismatch as mismatch
    from schedlab.engine.models import load_model
    from schedlab.sim.cost import read_profile

    check_model(model, dtype)
    data = profile._data if isinstance(profile, Profile) else read_profile(profile_path(profile))
    return mismatch(data, load_model(str(model), dtype=dtype, seed=check_model_seed(model_seed)))


# ---------------------------------------------------------------- calibrate --analytic's text

_FACTORS = (
    ("compute", "compute", 1.0, "{:.3f}"),
    ("attention", "attention", 1.0, "{:.4f}"),
    ("decode attention", "decode_attention", 1.0, "{:.4f}"),
    ("bandwidth", "bandwidth", 1.0, "{:.3f}"),
    ("copy", "copy", 1.0, "{:.3f}"),
    ("overhead/layer (ms)", "overhead_per_layer_s", 1e3, "{:.3f}"),
    ("copy overhead/layer (ms)", "copy_overhead_per_layer_s", 1e3, "{:.3f}"),
    ("step overhead (ms)", "step_overhead_s", 1e3, "{:.3f}"),
)


def _fmt(eff: dict, key: str, scale: float, fmt: str) -> str:
    v = eff.get(key)
    return "-" if v is None else fmt.format(v * scale)


def format_analytic(block: dict) -> str:
    """The analytic fit as printed by calibrate --analytic."""
    lines = [
        f"analytic roofline on cpu-local ({block['peak_gflops']:.0f} GFLOP/s fp32, {block['bandwidth_gbs']:.1f} GB/s "
        f"measured), {block['samples']['fitted']} passes fitted, {block['samples']['held_out']} held out:"
    ]
    for kind, label in (("plain", "plain roofline (3 factors)"), ("full", "with attention and copy factors")):
        m = block["models"][kind]
        e = m["efficiency"]
        facts = ", ".join(f"{name} {_fmt(e, key, sc, f)}" for name, key, sc, f in _FACTORS if e.get(key) is not None)
        lines.append(f"  {label}: {facts}")
        for what in ("all_passes", "held_out_passes"):
            r = m[what]
            if r.get("n"):
                lines.append(
                    f"    {what.replace('_', ' ')}: median |error| {r['median_abs_pct']:.1f} %, "
                    f"max {r['max_abs_pct']:.1f} % over {r['n']}"
                )
    return "\n".join(lines)


def analytic_markdown(block: dict) -> str:
    """The analytic fit's section of the profile's markdown report."""
    L = [
        "## Analytic roofline on cpu-local",
        "",
        f"Factors of `analysis/analytic`'s roofline fitted to this profile's samples (`calibrate --analytic`): peak "
        f"{block['peak_gflops']:.0f} GFLOP/s fp32 and {block['bandwidth_gbs']:.1f} GB/s as measured on "
        f"`{block['machine']}`; {block['samples']['fitted']} passes fitted, {block['samples']['held_out']} held out "
        f"(mixed passes only predicted), {block['samples']['skipped']} skipped.",
        "",
        "| factor | plain | full |",
        "|---|---:|---:|",
    ]
    for name, key, sc, f in _FACTORS:
        L.append(
            f"| {name} | "
            + " | ".join(_fmt(block["models"][k]["efficiency"], key, sc, f) for k in ("plain", "full"))
            + " |"
        )
    L += ["", "| pass error (median / max abs %) | plain | full |", "|---|---:|---:|"]

    def cell(r: dict) -> str:
        return f"{r['median_abs_pct']:.1f} / {r['max_abs_pct']:.1f}" if r.get("n") else "-"

    for label, key in (("all passes", "all_passes"), ("held-out passes", "held_out_passes")):
        L.append(f"| {label} | " + " | ".join(cell(block["models"][k][key]) for k in ("plain", "full")) + " |")
    for g in block["models"]["full"]["groups"]:
        L.append(f"| {g} | " + " | ".join(cell(block["models"][k]["groups"][g]) for k in ("plain", "full")) + " |")
    L.append("")
    return "\n".join(L)
