"""``validate``: a policy for real and in simulation on the same trace and cost model, compared
(a ``Validation``); ``compare``: the same comparison of runs made separately."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..errors import SchedlabError, opt
from ._base import (
    Log,
    PolicyLike,
    TraceLike,
    as_path,
    check_bool,
    check_callable,
    check_kv_tokens,
    check_model,
    check_seed,
    fail,
    logger,
    out_dir,
    public,
)
from ._validation import validate_many, validation_cost
from .figures import Figures
from .inputs import policy_list
from .profiles import ProfileLike
from .real import _model_trace, noise_env
from .runs import Run, real_dir_name

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


class Validation:
    """Simulation against real runs of the same policies, trace and cost model.

    - ``table``: per policy and metric, simulated vs measured (the median of the real runs)
      and the error %, with the real runs' spread when there are several;
    - ``errors``: per policy, the median and worst |error| % over the metrics, the cost
      model's per-step error, the machine's speed around the real runs and the drift-adjusted
      errors;
    - ``sim[policy]``: the simulated ``Run``; ``real[policy]``: the real ``Run``s;
    - ``results[policy]``: what validation.json holds; ``report()``: the printed tables;
    - ``save(dir)``: the directory ``validate --out`` writes; ``plot()``: its figures.
    """

    def __init__(
        self,
        results: Mapping[str, Mapping[str, Any]],
        sim: Mapping[str, Run],
        real: Mapping[str, Sequence[Run]],
        *,
        trace: str,
        model: str | None = None,
        cost_model: Mapping[str, Any] | None = None,
        path: Path | None = None,
    ):
        self.results = {k: dict(v) for k, v in results.items()}
        self.sim = dict(sim)
        self.real = {k: list(v) for k, v in real.items()}
        self.trace = trace
        self.model = model
        self.cost_model = dict(cost_model or {})
        self.path = path

    @property
    def policies(self) -> list[str]:
        return list(self.results)

    def __getitem__(self, policy: str) -> dict[str, Any]:
        return self.results[policy]

    @property
    def table(self) -> "pd.DataFrame":
        """Index (policy, metric); columns label, sim, real, error_pct (and, with several real
        runs, spread_pct and within_spread)."""
        import pandas as pd

        rows = []
        for pol, v in self.results.items():
            for key, m in v["metrics"].items():
                row = {
                    "policy": pol,
                    "metric": key,
                    "label": m["label"],
                    "sim": m["sim"],
                    "real": m["real"],
                    "error_pct": m["error_pct"],
                }
                if "spread_pct" in m:
                    row["spread_pct"] = m["spread_pct"]
                    row["within_spread"] = m["within_spread"]
                rows.append(row)
        return pd.DataFrame(rows).set_index(["policy", "metric"])

    @property
    def errors(self) -> "pd.DataFrame":
        """One row per policy: median/max |error| % over the metrics, the per-step cost-model
        error (p50/p90 |%|, mean signed %, total predicted vs measured %, steps), the machine's
        speed before/after the real runs (ratio to the calibration), the drift-adjusted and the
        speed-matched (the simulation made again at each real run's own speed) median/max |error| %,
        and with several real runs each held out against the others' median: the simulation's
        median |error| % there and a real run's own (the machine's repeat error)."""
        import pandas as pd

        rows = []
        for pol, v in self.results.items():
            se = v.get("step_error_pct") or {}
            speed = v.get("machine_speed") or {}
            adj = v.get("drift_adjusted") or {}
            matched = v.get("speed_matched") or {}
            held = v.get("hold_one_out") or {}
            rows.append(
                {
                    "policy": pol,
                    "median_abs_error_pct": v.get("median_abs_error_pct"),
                    "max_abs_error_pct": v.get("max_abs_error_pct"),
                    "step_p50_abs_pct": se.get("p50"),
                    "step_p90_abs_pct": se.get("p90"),
                    "step_mean_signed_pct": se.get("mean_signed"),
                    "step_total_pct": se.get("total_pct"),
                    "steps": se.get("n"),
                    "speed_before": (speed.get("before") or {}).get("ratio"),
                    "speed_after": (speed.get("after") or {}).get("ratio"),
                    "drift_adjusted_median_abs_error_pct": adj.get("median_abs_error_pct"),
                    "drift_adjusted_max_abs_error_pct": adj.get("max_abs_error_pct"),
                    "speed_matched_median_abs_error_pct": matched.get("median_abs_error_pct"),
                    "speed_matched_max_abs_error_pct": matched.get("max_abs_error_pct"),
                    "held_out_sim_median_abs_pct": held.get("sim_median_pct"),
                    "held_out_real_median_abs_pct": held.get("real_median_pct"),
                }
            )
        return pd.DataFrame(rows).set_index("policy")

    def report(self) -> str:
        """The tables ``validate`` prints (and the overview, for several policies)."""
        from schedlab.analysis.validation import format_table

        parts = [format_table(v) + "\n" for v in self.results.values()]
        if len(self.results) > 1:
            parts.append(format_overview(self.results))
        return "\n".join(parts)

    def save(self, out: str | Path) -> Path:
        """Write what ``validate --out`` writes: validation.json, sim/, real/ [real-2/ ...]
        (one policy), or validation.json and one such directory per policy."""
        out = out_dir(as_path(out))  # (a path is required here: None is not one)
        try:
            out.mkdir(parents=True, exist_ok=True)
            for pol, v in self.results.items():
                pdir = out if len(self.results) == 1 else out / pol
                self.sim[pol].save(pdir / "sim")
                for k, r in enumerate(self.real[pol]):
                    r.save(pdir / real_dir_name(k))
                (pdir / "validation.json").write_text(json.dumps(v, indent=2) + "\n")
            if len(self.results) > 1:
                (out / "validation.json").write_text(json.dumps(self.overview(), indent=2) + "\n")
        except OSError as exc:
            raise SchedlabError(f"cannot write {out}: {exc.strerror or exc}") from None
        return out

    def overview(self) -> dict[str, Any]:
        """validation.json of several policies: their errors side by side."""
        return {
            "trace": self.trace,
            "model": self.model,
            "cost_model": self.cost_model,
            "policies": {
                n: {
                    k: v[k]
                    for k in ("median_abs_error_pct", "max_abs_error_pct", "step_error_pct", "machine_speed")
                    if k in v
                }
                for n, v in self.results.items()
            },
        }

    def _validation_data(self) -> list:
        from schedlab.analysis.plots import ValidationData

        out = []
        for pol, v in self.results.items():
            base = (self.path if len(self.results) == 1 else self.path / pol) if self.path else Path(pol)
            sim = self.sim[pol]._run_data(path=base / "sim")
            real = self.real[pol][0]._run_data(path=base / "real")
            out.append(ValidationData(path=base, info=v, sim=sim, real=real))
        return out

    def plot(
        self,
        out: str | Path | None = None,
        formats: Sequence[str] = ("png", "svg"),
        lanes: int = 60,
        window: tuple[float, float] | str | None = None,
        kinds: str | Sequence[str] | None = None,
    ) -> Figures:
        """The ``plot`` command's figures of a validation directory: per policy, simulated vs
        measured TTFT/ITL CDFs and predicted vs measured step times (``validate_<policy>_cdfs``,
        ``validate_<policy>_step_time``), plus the runs' CDFs, decode rates and timelines
        (``kinds``: only some of ``ttft``, ``itl``, ``decode_rate``, ``timeline``,
        ``validation``)."""
        from .figures import plot

        return plot(self, out=out, formats=formats, lanes=lanes, window=window, kinds=kinds)

    def __repr__(self) -> str:
        errs = ", ".join(
            f"{p}: median |error| {v.get('median_abs_error_pct'):.1f} %"
            if v.get("median_abs_error_pct") is not None
            else f"{p}: -"
            for p, v in self.results.items()
        )
        return f"Validation(trace={self.trace!r}, model={self.model!r}, {errs})"


# ---------------------------------------------------------------- calibrate --analytic


def format_overview(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One line per policy; with several real runs also each run held out against the others'
    median (``analysis.validation.hold_one_out``): the simulation's median error there beside a
    real run's own, the machine's repeat error."""
    held = any(v.get("hold_one_out") for v in results.values())
    lines = [
        f"{'policy':<18}{'median |err| %':>16}{'max |err| %':>13}{'step p50 %':>12}{'step p90 %':>12}"
        + (f"{'held out: sim / a real run %':>31}" if held else "")
    ]

    def f(x):
        return "-" if x is None else f"{x:.1f}"

    for n, v in results.items():
        se = v["step_error_pct"]
        h = v.get("hold_one_out")
        lines.append(
            f"{n:<18}{f(v['median_abs_error_pct']):>16}{f(v['max_abs_error_pct']):>13}"
            f"{f(se.get('p50')):>12}{f(se.get('p90')):>12}"
            + (f"{(f(h['sim_median_pct']) + ' / ' + f(h['real_median_pct'])) if h else '-':>31}" if held else "")
        )
    return "\n".join(lines)


@public
def validate(
    policy: PolicyLike | Sequence[PolicyLike],
    trace: TraceLike,
    *,
    model: str = "tiny",
    dtype: str = "float32",
    options: Mapping[str, Any] | None = None,
    profile: ProfileLike = None,
    hardware: str | None = None,
    kv_tokens: int | None = None,
    seed: int = 0,
    repeat: int = 1,
    out: str | Path | None = None,
    noise: str | None = None,
    log: Log | None = None,
    on_result: Callable[[str, dict], None] | None = None,
    speed_probe: str = "passes",
    probe_every_run: bool = False,
    speculative: str | Mapping[str, Any] | None = None,
) -> Validation:
    """Run ``policy`` for real (MLX) and in simulation on the same trace and cost model, and
    compare (the ``validate`` command).

    ``policy``: one policy, several (a list, or ``"a,b"``), or ``"all"`` (every bundled one);
    ``options``: applied to every policy given by name; ``profile``: the cost profile (default:
    one measured on this model and machine, else a quick calibration first); ``hardware``: the
    analytic roofline of a preset instead (``cpu-local``: this machine); ``repeat``: real runs
    per policy (the measured value is their median); ``out``: write validation.json and the
    runs' directories there as they come; ``noise``: the real runs' noise settings (see
    ``run_real``). ``log`` hears progress and notes; ``on_result(policy, result)`` is called as
    each policy's comparison is done (``result``: what its validation.json holds).
    ``speed_probe``: how the machine's speed is timed around the real runs, for the
    drift-adjusted comparison: ``"passes"`` (the profile's reference passes, isolated: seconds)
    or ``"replay"`` (a default calibration's own replay run again in the real loop: its steps'
    regime, ~10 s at the default length); ``probe_every_run``: timed after every real run too,
    so that each run is simulated at its own speed (the machine's speed moves within minutes).

    ``speculative`` (``"ngram:k=4"``, as ``simulate`` and ``run_real`` take it): every policy's
    decode rows verify drafts, on the real engine and in the simulation; the simulation draws the
    accepted drafts from ``accept`` when given (numbers or a file, as ``simulate`` reads it), else
    from what the real runs measured (their spec-decode counters, added up; the simulations are
    then made after the real runs). validation.json gains ``speculative``: the acceptance rate,
    mean acceptance length, verify rows and per-position acceptance, simulated vs measured
    (``analysis.speculation``)."""
    from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)

    from .deployments import _speculation, parse_speculative

    check_callable(log, "log")
    check_callable(on_result, "on_result")
    check_bool(probe_every_run, "probe_every_run")
    log = logger(log)
    seed = check_seed(seed)
    pols = policy_list(policy, options)  # bad names and options fail here, before any run
    spec = parse_speculative(speculative)
    acceptance, wrap = _speculation(spec)
    if wrap is not None:
        pols = {name: wrap(pol) for name, pol in pols.items()}
    check_model(model, dtype)
    if isinstance(repeat, bool) or not isinstance(repeat, int):
        fail(f"{opt('repeat')} must be an integer, got {repeat!r}", 2)
    if repeat < 1:
        fail(f"{opt('repeat')} must be >= 1, got {repeat}", 2)
    if hardware and profile:
        fail(f"give either {opt('profile')} or {opt('hardware')}, not both", 2)
    if hardware:
        from schedlab.analysis.analytic import list_hardware

        if hardware.strip().lower() not in list_hardware():
            fail(f"unknown hardware '{hardware}' (presets: {', '.join(list_hardware())}; cpu-local is this machine)", 2)
    check_kv_tokens(kv_tokens)
    if speed_probe not in ("passes", "replay"):
        fail(f"{opt('speed_probe')} must be 'passes' or 'replay', not {speed_probe!r}", 2)
    probe = {"speed_probe": speed_probe, "speed_every_run": bool(probe_every_run)}
    if spec is not None:
        probe.update(speculative=spec, acceptance=acceptance)
    with noise_env(noise):
        return _validate(
            pols, trace, model, dtype, profile, hardware, kv_tokens, seed, repeat, out, log, on_result, probe
        )


def _validate(pols, trace, model, dtype, profile, hardware, kv_tokens, seed, repeat, out, log, on_result, probe):
    from schedlab.engine import blas
    from schedlab.engine.models import load_model

    out = out_dir(out)

    info = load_model(str(model), dtype=dtype)
    tr = _model_trace(info, trace, seed)  # (text prompts counted with the model's tokenizer, as run-real's)
    blas.notify_if_missing()

    def say(msg: str) -> None:
        log("progress", msg)

    def make_out() -> None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fail(f"cannot write {out}: {exc.strerror or exc}")

    # OUT is made once the cost model is read (a bad profile leaves no empty OUT behind), but
    # before a calibration that may come first (minutes: an OUT it cannot make fails before)
    may_calibrate = profile is None and not hardware
    if out is not None and may_calibrate:
        make_out()
    cost, capacity, cost_meta = validation_cost(profile, hardware, kv_tokens, info, out, log)
    if out is not None and not may_calibrate:
        make_out()

    results, sims, reals = {}, {}, {}
    dirs = {name: None if out is None else (out if len(pols) == 1 else out / name) for name in pols}
    got = validate_many(pols, tr, info, cost, capacity, dirs, repeat, seed, cost_meta, say, **probe)
    for name, (v, sim_run, real_runs) in got.items():
        results[name], sims[name], reals[name] = v, sim_run, real_runs
        if on_result is not None:
            on_result(name, v)
    val = Validation(results, sims, reals, trace=tr.name, model=str(info.name), cost_model=cost_meta, path=out)
    if out is not None and len(results) > 1:
        try:
            (out / "validation.json").write_text(json.dumps(val.overview(), indent=2) + "\n")
        except OSError as exc:
            fail(f"cannot write {out}: {exc.strerror or exc}")
    return val


@public
def compare(sim: Run, real: Run | Sequence[Run]) -> Validation:
    """Compare a simulated run with one or more real runs of the same policy and trace, as
    ``validate`` does (the measured value is the real runs' median; the per-step error is over
    the real runs' steps)."""
    from schedlab.analysis.validation import compare as compare_runs

    reals = [real] if isinstance(real, Run) else list(real)
    if not isinstance(sim, Run) or not reals or not all(isinstance(r, Run) for r in reals):
        fail("compare takes a Run (the simulation) and a Run or a list of Runs (the real runs)", 2)
    if any(r.mode != "real" for r in reals):
        fail("compare: the runs to compare with must be real runs (run_real)", 2)
    for k, r in enumerate(reals, 1):  # (the same policy on the same requests, or the errors mean nothing)
        if (r.policy, r.trace) != (sim.policy, sim.trace):
            fail(
                f"compare: the simulation is {sim.policy} on {sim.trace}, real run {k} is {r.policy} on {r.trace}: "
                "compare runs of the same policy and trace",
                2,
            )
        ids, theirs = set(sim.requests["id"]), set(r.requests["id"])
        if ids != theirs:
            odd = sorted(ids ^ theirs)[0]
            fail(
                f"compare: the simulation has {len(ids)} requests, real run {k} {len(theirs)}, not the same "
                f"(request {odd} is in one only)",
                2,
            )
    steps: list = []
    for r in reals:
        steps.extend(r._result.steps if r._result is not None else r.steps.itertuples(index=False))
    v = compare_runs(sim._summary, [r._summary for r in reals], policy=sim.policy, trace=sim.trace, real_steps=steps)
    return Validation(
        {sim.policy: v},
        {sim.policy: sim},
        {sim.policy: reals},
        trace=sim.trace,
        model=(reals[0].meta.get("model")),
        cost_model=sim.meta,
    )
