"""What the API returns: a run (``Run``), a cost profile (``Profile``), a validation
(``Validation``), a cost model with its KV capacity (``CostModel``) and figures (``Figures``).

Tables are pandas DataFrames with the columns of the files ``--out`` writes (see
``sim/output.py``); figures are matplotlib Figures drawn by ``analysis/plots.py``, the code the
``plot`` command uses. Nothing here imports mlx.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .errors import SchedlabError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure


def real_dir_name(k: int) -> str:
    """The directory of a validation's ``k``-th real run (from 0): real, real-2, real-3, ..."""
    return "real" if k == 0 else f"real-{k + 1}"


RUN_FILES = ("summary.json", "requests.csv", "tokens.parquet", "steps.parquet", "passes.parquet", "features.parquet",
             "meta.json", "texts.jsonl")


class Figures(dict):
    """Figures by name (the file stem the ``plot`` command writes, e.g. ``ttft_cdf``), plus
    ``files``: the files written (empty unless ``out`` was given) and ``warnings``: files
    that disagree with their summary."""

    def __init__(self, figures: Mapping[str, "Figure"] = (), files: Sequence[Path] = (),
                 warnings: Sequence[str] = ()):
        super().__init__(figures)
        self.files = list(files)
        self.warnings = list(warnings)


class Run:
    """One run of a policy over a trace, simulated (``mode == "sim"``) or on the real engine
    (``"real"``).

    - ``summary``: the numbers of summary.json (``vllm bench serve``'s metrics);
    - ``requests``, ``tokens``, ``steps``, ``passes``: DataFrames with the columns of
      requests.csv, tokens.parquet, steps.parquet and passes.parquet (the tables are shared:
      copy one before changing it);
    - ``save(dir)`` writes the files ``--out`` writes; ``plot()`` draws the ``plot`` command's
      figures; ``report()`` is the printed summary.

    A run that stopped early (a plan the state machine refused, a policy that raised) keeps
    what ran: ``error`` says why; ``rejected`` lists requests larger than the KV capacity.
    """

    def __init__(self, result: Any = None, summary: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
                 meta: Mapping[str, Any] | None = None, *, _dir: Path | None = None, _frames=None,
                 _meta_file: Mapping[str, Any] | None = None, _write_texts=None):
        self._result = result
        self._write_texts = _write_texts  # a real run's texts.jsonl (run-real --out writes it)
        # the summary, or what computes it when first needed: ``save`` starts writing the large
        # tables before it asks, so that both go on at once
        self._summary_of = summary if callable(summary) else None
        self._summary_dict = None if callable(summary) else dict(summary or {})
        self._meta = dict(meta or {})  # what the command adds to meta.json (cost model, seed, ...)
        self._dir = _dir  # a run read back from a directory (load_run)
        self._frames: dict[str, Any] = dict(_frames or {})
        self._meta_file = dict(_meta_file) if _meta_file is not None else None

    # ---------------------------------------------------------------- numbers

    @property
    def _summary(self) -> dict[str, Any]:
        if self._summary_dict is None:
            self._summary_dict = dict(self._summary_of())
            self._summary_of = None
        return self._summary_dict

    @property
    def summary(self) -> dict[str, Any]:
        """summary.json's content (a copy)."""
        return copy.deepcopy({k: v for k, v in self._summary.items() if k not in ("wall_s", "meta")})

    @property
    def policy(self) -> str:
        return str(self._summary.get("policy"))

    @property
    def mode(self) -> str:
        return str(self._summary.get("mode"))

    @property
    def trace(self) -> str:
        return str(self._summary.get("trace"))

    @property
    def error(self) -> str | None:
        """Why the run stopped early, else None."""
        return self._summary.get("error")

    @property
    def rejected(self) -> list[tuple[str, str]]:
        """(request id, why) of every request rejected up front (larger than the KV capacity)."""
        if self._result is not None:
            return [(r.id, why) for r, why in self._result.rejected]
        req = self.requests
        return [(rid, "rejected") for rid in req.loc[req["status"] == "rejected", "id"]]

    @property
    def kv_tokens(self) -> int | None:
        """The KV capacity the run had, in tokens."""
        if self._result is not None:
            return self._result.kv_capacity
        return self.meta.get("kv_tokens")

    @property
    def wall_s(self) -> float | None:
        """Wall-clock seconds the run took (a simulation's, or the real engine's)."""
        if self._result is not None:
            return self._result.wall_s
        return self.meta.get("wall_s")

    @property
    def meta(self) -> dict[str, Any]:
        """What meta.json records about the run: the engine (model, BLAS, ...) for a real run,
        the cost model, KV capacity, seed and the policy's options."""
        if self._meta_file is not None:
            return copy.deepcopy(self._meta_file)
        return copy.deepcopy({**(self._result.meta or {}), **self._meta})

    @property
    def problems(self) -> list[str]:
        """One line per problem of the run (rejected requests, an early stop), as the commands
        print them; empty when every request ran."""
        lines = []
        if self._result is not None and self._result.rejected:
            rej = self._result.rejected
            shown = ", ".join(f"{r.id} ({r.kv_footprint})" for r, _ in rej[:5])
            more = f" and {len(rej) - 5} more" if len(rej) > 5 else ""
            lines.append(f"{len(rej)} request(s) rejected: their prompt + output exceeds "
                         f"the KV capacity of {self._result.kv_capacity} tokens: {shown}{more}; the other requests ran")
        elif self._result is None and self.rejected:
            lines.append(f"{len(self.rejected)} request(s) rejected: their prompt + output exceeds the KV capacity")
        if self.error:
            lines.append(self.error)
        return lines

    def report(self) -> str:
        """The summary as the commands print it (the layout of ``vllm bench serve``)."""
        from schedlab.sim.metrics import format_summary

        return format_summary(self._summary)

    # ---------------------------------------------------------------- tables

    def _frame(self, name: str):
        if name not in self._frames:
            from schedlab.sim import output

            r = self._result
            if r is None:  # read back from a directory that lacks the file
                raise SchedlabError(f"{self._dir} has no {name}.parquet"
                                    + (" (simulate writes it with --passes)" if name == "passes" else ""))
            if name == "passes" and not self._has_passes():
                raise SchedlabError("this run kept no pass log: simulate it with passes=True (the command: --passes)")
            if name == "requests":
                self._frames[name] = output.requests_frame(r)
            elif name == "tokens":
                self._frames[name] = output.tokens_table(r).to_pandas()
            elif name == "steps":
                self._frames[name] = output.steps_table(r.steps).to_pandas()
            else:
                self._frames[name] = output.passes_table(r.requests, r.passes).to_pandas()
        return self._frames[name]

    def _has_passes(self) -> bool:
        if self._result is not None:
            return getattr(self._result, "passes_recorded", True)
        return "passes" in self._frames

    @property
    def requests(self) -> "pd.DataFrame":
        """requests.csv: one row per request (id, arrival_s, prompt_tokens, output_tokens,
        first_token_s, finish_s, ttft_ms, tpot_ms, e2e_ms, decode_rate_tok_s, status)."""
        return self._frame("requests")

    @property
    def tokens(self) -> "pd.DataFrame":
        """tokens.parquet: one row per output token (request_id, token_index, time_s)."""
        return self._frame("tokens")

    @property
    def steps(self) -> "pd.DataFrame":
        """steps.parquet: one row per scheduler step (step, start_s, end_s, predicted_s,
        measured_s, decode_rows, prefill_tokens, passes, kv_tokens); measured_s is null in a
        simulation."""
        return self._frame("steps")

    @property
    def passes(self) -> "pd.DataFrame":
        """passes.parquet: one row per request per pass (step, pass, request_id, kind, tokens,
        start_s, end_s); kind is decode or prefill. (Made from the run when it is in memory; a
        run read back from a directory needs the file: ``simulate --passes``.)"""
        return self._frame("passes")

    @property
    def texts(self) -> "pd.DataFrame | None":
        """A real run's texts.jsonl: per request its generated token ids, their text (with a
        tokenizer) and why it ended (``stop``: EOS, ``length``: max_tokens); None for a
        simulation."""
        if "texts" not in self._frames:
            import pandas as pd

            if self._write_texts is not None:
                import tempfile

                with tempfile.TemporaryDirectory(prefix="schedlab-texts-") as tmp:
                    path = Path(tmp) / "texts.jsonl"
                    self._write_texts(path)
                    self._frames["texts"] = pd.read_json(path, lines=True, dtype={"id": str})
            elif self._dir is not None and (self._dir / "texts.jsonl").is_file():
                self._frames["texts"] = pd.read_json(self._dir / "texts.jsonl", lines=True, dtype={"id": str})
            else:
                self._frames["texts"] = None
        return self._frames["texts"]

    @property
    def features(self) -> "pd.DataFrame | None":
        """A real run's features.parquet: per measured step, its passes' cost features, the
        measured and predicted seconds, the idle gap before it and batch changes (what
        ``calibrate(from_runs=...)`` fits); None for a simulation."""
        if "features" not in self._frames:
            table = None
            if self._result is not None:
                from schedlab.sim.features import features_table, step_table

                cols = step_table(self._result)
                table = features_table(cols).to_pandas() if cols is not None else None
            elif self._dir is not None and (self._dir / "features.parquet").is_file():
                import pandas as pd

                table = pd.read_parquet(self._dir / "features.parquet")
            self._frames["features"] = table
        return self._frames["features"]

    def residuals(self) -> "pd.DataFrame | None":
        """A real run's per-step residuals (measured / predicted) by rows, tokens, context,
        joins/leaves, idle gap and batch change, as ``run-real --residuals`` prints them."""
        feats = self.features
        if feats is None:
            return None
        import pandas as pd
        from schedlab.analysis.residuals import residual_table

        return pd.DataFrame(residual_table({c: feats[c].to_numpy(dtype=float) for c in feats.columns}))

    # ---------------------------------------------------------------- files and figures

    def save(self, out: str | Path, *, passes: bool | None = None) -> Path:
        """Write the run directory ``--out`` writes: summary.json, requests.csv,
        tokens/steps.parquet, passes.parquet (``passes``: None writes it when the run has its
        pass log, which ``simulate(..., passes=False)`` does not keep), meta.json. Returns the
        directory."""
        has = self._has_passes()
        if passes is None:
            passes = has
        elif passes and not has:
            raise SchedlabError("this run has no pass log to write as passes.parquet "
                                "(simulated with passes=False, or read back without the file)")
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise SchedlabError(f"{out} exists and is not a directory")
        try:
            if self._result is not None:
                from schedlab.sim.output import write_run

                write_run(out, self._result, lambda: self._summary, meta=self._meta, passes=passes)
                if self._write_texts is not None:
                    self._write_texts(out / "texts.jsonl")
                return out
            out.mkdir(parents=True, exist_ok=True)
            for name in RUN_FILES:
                if name == "passes.parquet" and not passes:
                    if out.resolve() != self._dir.resolve():  # as write_run: no earlier run's timeline
                        (out / name).unlink(missing_ok=True)
                    continue
                src = self._dir / name
                if src.is_file() and src.resolve() != (out / name).resolve():
                    shutil.copyfile(src, out / name)
            return out
        except OSError as exc:
            raise SchedlabError(f"cannot write {out}: {exc.strerror or exc}") from None

    def _run_data(self, label: str | None = None, path: Path | None = None):
        from schedlab.analysis.plots import run_data, slug

        where = path or self._dir or Path(slug(f"{self.policy}-{self.mode}"))
        return run_data(self._summary, self.requests, self.tokens, self.steps, self.passes, path=where,
                        label=label)

    def plot(self, *others: "Run | Validation | str | Path", out: str | Path | None = None,
             formats: Sequence[str] = ("png", "svg"), lanes: int = 60,
             window: tuple[float, float] | str | None = None, kinds: str | Sequence[str] | None = None) -> Figures:
        """The ``plot`` command's figures for this run (and ``others`` beside it): TTFT and ITL
        CDFs, per-request decode rates, a step timeline per run (``kinds``: only some of
        ``ttft``, ``itl``, ``decode_rate``, ``timeline``). ``out``: also write them there, in
        ``formats``. See :func:`schedlab.plot`."""
        from .api import plot

        return plot(self, *others, out=out, formats=formats, lanes=lanes, window=window, kinds=kinds)

    def __repr__(self) -> str:
        s = self._summary
        mk = s.get("makespan_s")
        mk = f"{mk:.3f}" if isinstance(mk, (int, float)) else mk
        err = f", error={self.error!r}" if self.error else ""
        return (f"Run(policy={self.policy!r}, mode={self.mode!r}, trace={self.trace!r}, "
                f"requests={s.get('requests')}, finished={s.get('finished')}, makespan_s={mk}{err})")


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
            rows.append({"group": group, "r2": r.get("r2"),
                         "fit_median_abs_pct": fit.get("median_abs_pct"),
                         "held_out_n": held.get("n"), "held_out_median_abs_pct": held.get("median_abs_pct"),
                         "held_out_max_abs_pct": held.get("max_abs_pct")})
        return pd.DataFrame(rows).set_index("group") if rows else pd.DataFrame()

    @property
    def samples(self) -> "pd.DataFrame":
        """The timed passes the fit used: group, label, seconds, and one column per feature."""
        import pandas as pd

        rows = [{"group": s.get("group"), "label": s.get("label"), "seconds": s.get("seconds"),
                 **(s.get("features") or {})} for s in self._data.get("samples") or []]
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

    def report(self) -> str:
        """The fit report as ``calibrate`` prints it."""
        from schedlab.analysis.fit import format_report

        if not {"fit_report", "calibration"} <= set(self._data):
            return f"profile {self.path or ''}: {len(self.coefficients)} coefficients (no fit report)".strip()
        text = format_report(self._data)
        if self.analytic is not None:
            text += "\n" + format_analytic(self._data["analytic_cpu_local"])
        return text

    def mismatch(self, model: str = "tiny", dtype: str = "float32", model_seed: int = 0) -> str | None:
        """Why this profile was not measured on ``model`` on this machine (the model, dtype,
        BLAS, CPU it names differ from here), or None when it was: ``run_real`` and
        ``validate`` use a profile that matches, and warn about one that does not."""
        from .api import profile_mismatch

        return profile_mismatch(self, model=model, dtype=dtype, model_seed=model_seed)

    def cost_model(self, kv_tokens: int | None = None) -> "CostModel":
        """The linear cost model of this profile and its KV capacity (``kv_tokens``: another)."""
        from .api import cost_model

        return cost_model(profile=self, kv_tokens=kv_tokens)

    def save(self, path: str | Path) -> Path:
        """Write the profile JSON and its markdown fit report beside it (``.md``)."""
        from schedlab.engine.calibrate import write_profile

        path = Path(path)
        if path.is_dir():
            raise SchedlabError(f"{path} is a directory; give a file name")
        try:
            write_profile(self._data, path)
            if self.analytic is not None:
                with path.with_suffix(".md").open("a") as fh:
                    fh.write("\n" + analytic_markdown(self._data["analytic_cpu_local"]))
        except OSError as exc:
            raise SchedlabError(f"cannot write {path}: {exc.strerror or exc}") from None
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
        return (f"Profile(model={self.model!r}, dtype={self._data.get('dtype')!r}, "
                f"grid={cal.get('grid')!r}, samples={cal.get('samples')}, path={str(self.path) if self.path else None!r})")


class CostModel:
    """A cost model (seconds of a pass and of a step's own work) with the KV capacity it comes
    with: a measured profile's linear model, or the analytic roofline of a machine. Everything
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
        what = self.source.get("profile") or (self.source.get("analytic") or {}).get("hardware") or type(self.model).__name__
        return f"CostModel({type(self.model).__name__}, {what}, kv_tokens={self.kv_tokens})"


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

    def __init__(self, results: Mapping[str, Mapping[str, Any]], sim: Mapping[str, Run],
                 real: Mapping[str, Sequence[Run]], *, trace: str, model: str | None = None,
                 cost_model: Mapping[str, Any] | None = None, path: Path | None = None):
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
                row = {"policy": pol, "metric": key, "label": m["label"], "sim": m["sim"], "real": m["real"],
                       "error_pct": m["error_pct"]}
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
            rows.append({
                "policy": pol, "median_abs_error_pct": v.get("median_abs_error_pct"),
                "max_abs_error_pct": v.get("max_abs_error_pct"),
                "step_p50_abs_pct": se.get("p50"), "step_p90_abs_pct": se.get("p90"),
                "step_mean_signed_pct": se.get("mean_signed"), "step_total_pct": se.get("total_pct"),
                "steps": se.get("n"),
                "speed_before": (speed.get("before") or {}).get("ratio"),
                "speed_after": (speed.get("after") or {}).get("ratio"),
                "drift_adjusted_median_abs_error_pct": adj.get("median_abs_error_pct"),
                "drift_adjusted_max_abs_error_pct": adj.get("max_abs_error_pct"),
                "speed_matched_median_abs_error_pct": matched.get("median_abs_error_pct"),
                "speed_matched_max_abs_error_pct": matched.get("max_abs_error_pct"),
                "held_out_sim_median_abs_pct": held.get("sim_median_pct"),
                "held_out_real_median_abs_pct": held.get("real_median_pct"),
            })
        return pd.DataFrame(rows).set_index("policy")

    def report(self) -> str:
        """The tables ``validate`` prints (and the overview, for several policies)."""
        from schedlab.analysis.validation import format_table

        parts = [format_table(v) + "\n" for v in self.results.values()]
        if len(self.results) > 1:
            from .api import format_overview

            parts.append(format_overview(self.results))
        return "\n".join(parts)

    def save(self, out: str | Path) -> Path:
        """Write what ``validate --out`` writes: validation.json, sim/, real/ [real-2/ ...]
        (one policy), or validation.json and one such directory per policy."""
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise SchedlabError(f"{out} exists and is not a directory")
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
        return {"trace": self.trace, "model": self.model, "cost_model": self.cost_model, "policies": {
            n: {k: v[k] for k in ("median_abs_error_pct", "max_abs_error_pct", "step_error_pct", "machine_speed")
                if k in v}
            for n, v in self.results.items()}}

    def _validation_data(self) -> list:
        from schedlab.analysis.plots import ValidationData

        out = []
        for pol, v in self.results.items():
            base = (self.path if len(self.results) == 1 else self.path / pol) if self.path else Path(pol)
            sim = self.sim[pol]._run_data(path=base / "sim")
            real = self.real[pol][0]._run_data(path=base / "real")
            out.append(ValidationData(path=base, info=v, sim=sim, real=real))
        return out

    def plot(self, out: str | Path | None = None, formats: Sequence[str] = ("png", "svg"), lanes: int = 60,
             window: tuple[float, float] | str | None = None, kinds: str | Sequence[str] | None = None) -> Figures:
        """The ``plot`` command's figures of a validation directory: per policy, simulated vs
        measured TTFT/ITL CDFs and predicted vs measured step times (``validate_<policy>_cdfs``,
        ``validate_<policy>_step_time``), plus the runs' CDFs, decode rates and timelines
        (``kinds``: only some of ``ttft``, ``itl``, ``decode_rate``, ``timeline``,
        ``validation``)."""
        from .api import plot

        return plot(self, out=out, formats=formats, lanes=lanes, window=window, kinds=kinds)

    def __repr__(self) -> str:
        errs = ", ".join(f"{p}: median |error| {v.get('median_abs_error_pct'):.1f} %"
                         if v.get("median_abs_error_pct") is not None else f"{p}: -"
                         for p, v in self.results.items())
        return f"Validation(trace={self.trace!r}, model={self.model!r}, {errs})"


# ---------------------------------------------------------------- calibrate --analytic

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
