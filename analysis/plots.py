"""Figures from run directories: latency CDFs, decode rates, step timelines, each replica's
load over time (a cluster's runs), validation.

A run directory is what ``simulate --out DIR`` writes (sim/output.py): summary.json,
requests.csv, tokens.parquet, steps.parquet and passes.parquet (meta.json is not needed here;
a directory without passes.parquet still plots, see below). A validation directory holds
validation.json plus ``sim/`` and ``real/`` run directories.

Every ``plot_*`` function draws one figure, saves it in each requested format and returns
the numbers it drew (CDF arrays, the p50/p99 it marked, bar heights, timeline segments),
so tests compare numbers with the run's metrics instead of pixels.

Matplotlib is used through its object API on the Agg canvas (no pyplot, no global backend
switch), so importing this module inside a notebook does not change how the notebook
draws. Nothing here imports mlx.

What the step timeline can and cannot show
------------------------------------------
With passes.parquet (one row per request per pass: ``step,pass,request_id,kind,tokens,
start_s,end_s``, kind ``decode`` or ``prefill``) the timeline is exact: every prefill chunk
and decode row is drawn over its pass, and pass boundaries show as thin gaps.

Without it the timeline falls back to steps.parquet and tokens.parquet. The steps table has, per step, its start and end and how many decode
rows and prefill tokens it ran, but not which requests. The tokens table has the time of every
output token, which is the end of the pass that produced it. From those two files (the
"tokens" view):

- exact: in which step each request received each token, and the end time of that pass;
  the steps in which a decoding request got no token (stalls) show as gaps;
- bounded: the pass start. The drawn segment starts at the latest known boundary before
  the token (the previous distinct token time inside the same step, else the step start),
  so it may include an earlier pass of the step that produced no token (e.g. a prefill pass
  that completed no prompt) and, in simulation, the step's planning overhead;
- not recoverable: which steps prefilled which request before its first token (only the
  step total is known), waiting vs. prefilling before the first token, whether the first
  token came from a prefill chunk or a decode hand-off, and preemptions/recomputes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

RUN_FILES = ("summary.json", "requests.csv", "tokens.parquet", "steps.parquet")
REQUEST_COLUMNS = (
    "id",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "first_token_s",
    "finish_s",
    "ttft_ms",
    "decode_rate_tok_s",
    "status",
)
TOKEN_COLUMNS = ("request_id", "token_index", "time_s")
STEP_COLUMNS = ("step", "start_s", "end_s", "predicted_s", "measured_s", "decode_rows", "prefill_tokens", "passes")
PASS_COLUMNS = ("step", "pass", "request_id", "kind", "tokens", "start_s", "end_s")
FORMATS = ("png", "svg")

PREFILL_COLOR = "#e8871e"
DECODE_COLOR = "#2f6fb0"
WAIT_COLOR = "#d9d9d9"
STARVED_COLOR = "#c0392b"
STARVED_FRACTION = 0.5  # a bar below this fraction of the median decode rate is drawn red
MAX_CURVE_POINTS = 4000  # CDF curves with more points are drawn at this many quantiles
DEFAULT_LANES = 60


class RunDirError(ValueError):
    """A path that is not a usable run or validation directory; one line for the user."""


# ------------------------------------------------------------------------ loading


@dataclass
class RunData:
    """One run directory, parsed and checked."""

    path: Path
    summary: dict[str, Any]
    requests: Any  # pandas.DataFrame, id as str
    tokens: Any  # pandas.DataFrame
    steps: Any  # pandas.DataFrame
    passes: Any | None = None  # pandas.DataFrame when passes.parquet exists
    label: str = ""

    @property
    def policy(self) -> str:
        return str(self.summary.get("policy", "?"))

    @property
    def mode(self) -> str:
        return str(self.summary.get("mode", "?"))

    @property
    def finished(self):
        return self.requests[self.requests["status"] == "finished"]

    def ttft_ms(self) -> np.ndarray:
        """TTFT of every finished request, as summarize() takes it (requests.csv)."""
        return self.finished["ttft_ms"].to_numpy(dtype=float)

    def itl_ms(self) -> np.ndarray:
        """Every gap between consecutive tokens of finished requests (as summarize())."""
        fin = set(self.finished["id"])
        tok = self.tokens[self.tokens["request_id"].isin(fin)]
        tok = tok.sort_values(["request_id", "token_index"], kind="stable")
        rid = tok["request_id"].to_numpy()
        t = tok["time_s"].to_numpy(dtype=float)
        if t.size < 2:
            return np.array([])
        same = rid[1:] == rid[:-1]
        return np.diff(t)[same] * 1e3

    def decode_rates(self):
        """(ids, tok/s) of finished requests that have a decode rate (output > 1)."""
        fin = self.finished
        fin = fin[fin["decode_rate_tok_s"].notna()]
        return fin["id"].to_numpy(dtype=object), fin["decode_rate_tok_s"].to_numpy(dtype=float)


@dataclass
class ValidationData:
    path: Path
    info: dict[str, Any]
    sim: RunData
    real: RunData


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise RunDirError(f"{path}: not a UTF-8 text file") from None
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except OSError as exc:
        raise RunDirError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise RunDirError(f"{path}: expected a JSON object")
    return data


def _read_csv(path: Path, columns: Sequence[str], numeric: Sequence[str], *, str_cols=(), required=()):
    """A CSV or Parquet table with the given columns; numeric columns coerced; ``required``
    ones must be complete."""
    import pandas as pd

    try:
        if path.suffix == ".parquet":
            df = pd.read_parquet(path)
            for c in str_cols:
                if c in df.columns:
                    df[c] = df[c].astype(object)
        else:
            df = pd.read_csv(
                path, dtype={c: str for c in str_cols}, keep_default_na=False, na_values=[""], encoding="utf-8"
            )
    except UnicodeDecodeError:
        raise RunDirError(f"{path}: not a UTF-8 text file") from None
    except pd.errors.EmptyDataError:
        raise RunDirError(f"{path}: empty file (expected a header line: {','.join(columns)})") from None
    except (pd.errors.ParserError, ValueError) as exc:
        what = "Parquet" if path.suffix == ".parquet" else "CSV"
        raise RunDirError(f"{path}: cannot parse as {what}: {' '.join(str(exc).split())}") from None
    except OSError as exc:
        raise RunDirError(f"cannot read {path}: {exc.strerror}") from None
    return _checked(df, path, columns, numeric, str_cols=str_cols, required=required)


def _checked(df, path, columns: Sequence[str], numeric: Sequence[str], *, str_cols=(), required=()):
    """A table with the given columns (else RunDirError naming ``path``); numeric columns
    coerced to float, ``required`` ones complete, string columns as str objects."""
    import pandas as pd

    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise RunDirError(f"{path}: missing column(s) {', '.join(missing)}")
    df = df.copy()
    for c in str_cols:
        if c in df.columns and isinstance(df[c].dtype, pd.CategoricalDtype):
            df[c] = df[c].astype(object)
    for c in numeric:
        col = pd.to_numeric(df[c], errors="coerce")
        bad = col.isna() & df[c].notna()
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise RunDirError(f"{path}: column {c} has a non-numeric value {df[c].iloc[row]!r} (data row {row + 1})")
        df[c] = col.astype(float)
    for c in required:
        if df[c].isna().any():
            row = int(np.flatnonzero(df[c].isna().to_numpy())[0])
            raise RunDirError(f"{path}: column {c} is empty in data row {row + 1}")
    for c in str_cols:
        if c in df.columns:
            df[c] = df[c].astype(object).where(df[c].notna(), "")
    return df


def is_validation_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "validation.json").is_file() and (p / "sim").is_dir() and (p / "real").is_dir()


def validation_dirs(path: str | Path) -> list[Path]:
    """The validation directories ``path`` is: itself, or those of each policy where ``validate
    -p A,B --out`` wrote several (one per policy, in its validation.json's order, beside an
    overview); [] when it is neither."""
    p = Path(path)
    if is_validation_dir(p):
        return [p]
    if not (p / "validation.json").is_file():
        return []
    try:
        policies = list(json.loads((p / "validation.json").read_text()).get("policies") or ())
    except (OSError, ValueError, AttributeError):
        return []
    return [p / str(name) for name in policies if is_validation_dir(p / str(name))]


def load_run(path: str | Path) -> RunData:
    """Parse a run directory; any problem is one ``RunDirError`` line."""
    p = Path(path)
    if not p.exists():
        raise RunDirError(f"{p}: no such directory")
    if not p.is_dir():
        raise RunDirError(f"{p} is not a run directory (it is a file; give the directory written by simulate --out)")
    missing = [f for f in RUN_FILES if not (p / f).is_file()]
    if missing and (p / "sim").is_dir() and (p / "real").is_dir():
        raise RunDirError(
            f"{p} has sim/ and real/ but no validation.json (not a validation directory), and is not a run directory"
        )
    if missing:
        raise RunDirError(
            f"{p} is not a run directory: missing {', '.join(missing)} (write one with simulate --out DIR)"
        )
    summary = _read_json(p / "summary.json")
    _check_summary(summary, p)
    requests = _read_csv(p / "requests.csv", REQUEST_COLUMNS, (), str_cols=("id", "status"))
    tokens = _read_csv(p / "tokens.parquet", TOKEN_COLUMNS, (), str_cols=("request_id",))
    steps = _read_csv(p / "steps.parquet", STEP_COLUMNS, ())
    passes = None
    if (p / "passes.parquet").is_file():
        passes = _read_csv(p / "passes.parquet", PASS_COLUMNS, (), str_cols=("request_id", "kind"))
    return run_data(summary, requests, tokens, steps, passes, path=p)


def _check_summary(summary: dict[str, Any], p: Path) -> None:
    for key in ("policy", "mode"):
        if key not in summary:
            raise RunDirError(f"{p / 'summary.json'}: no '{key}' key (not a schedlab summary)")


def run_data(
    summary: dict[str, Any], requests, tokens, steps, passes=None, *, path: str | Path = "run", label: str | None = None
) -> RunData:
    """A run's tables (as a run directory holds them: requests.csv's columns, tokens, steps
    and passes as read from their Parquet files) checked and typed as ``load_run`` reads them;
    any problem is one ``RunDirError`` line naming ``path``."""
    p = Path(path)
    _check_summary(summary, p)
    requests = _checked(
        requests,
        p / "requests.csv",
        REQUEST_COLUMNS,
        ("arrival_s", "prompt_tokens", "output_tokens", "first_token_s", "finish_s", "ttft_ms", "decode_rate_tok_s"),
        str_cols=("id", "status"),
        required=("arrival_s", "output_tokens"),
    )
    fin = requests["status"] == "finished"
    for c in ("first_token_s", "finish_s", "ttft_ms"):
        if requests.loc[fin, c].isna().any():
            raise RunDirError(f"{p / 'requests.csv'}: a finished request has no {c}")
    if requests["id"].duplicated().any():
        dup = requests["id"][requests["id"].duplicated()].iloc[0]
        raise RunDirError(f"{p / 'requests.csv'}: duplicate request id {dup}")
    tokens = _checked(
        tokens,
        p / "tokens.parquet",
        TOKEN_COLUMNS,
        ("token_index", "time_s"),
        str_cols=("request_id",),
        required=("token_index", "time_s"),
    )
    steps = _checked(
        steps,
        p / "steps.parquet",
        STEP_COLUMNS,
        ("step", "start_s", "end_s", "predicted_s", "measured_s", "decode_rows", "prefill_tokens", "passes"),
        required=("start_s", "end_s", "decode_rows", "prefill_tokens", "passes"),
    )
    unknown = set(tokens["request_id"]) - set(requests["id"])
    if unknown:
        raise RunDirError(f"{p / 'tokens.parquet'}: request id {sorted(unknown)[0]} is not in requests.csv")
    if passes is not None:
        passes = _checked(
            passes,
            p / "passes.parquet",
            PASS_COLUMNS,
            ("step", "pass", "tokens", "start_s", "end_s"),
            str_cols=("request_id", "kind"),
            required=("step", "pass", "tokens", "start_s", "end_s"),
        )
        kinds = set(passes["kind"]) - {"decode", "prefill"}
        if kinds:
            raise RunDirError(f"{p / 'passes.parquet'}: kind must be decode or prefill, got {sorted(kinds)[0]!r}")
    return RunData(
        path=p,
        summary=summary,
        requests=requests,
        tokens=tokens,
        steps=steps,
        passes=passes,
        label=label or f"{summary['policy']} ({summary['mode']})",
    )


def load_validation(path: str | Path) -> ValidationData:
    p = Path(path)
    info = _read_json(p / "validation.json")
    return ValidationData(path=p, info=info, sim=load_run(p / "sim"), real=load_run(p / "real"))


def load_inputs(paths: Iterable[str | Path]) -> tuple[list[RunData], list[ValidationData]]:
    """Run and validation directories, in order; run labels made unique."""
    runs: list[RunData] = []
    vals: list[ValidationData] = []
    for path in paths:
        dirs = validation_dirs(path)  # (a validation of several policies: each policy's)
        for d in dirs:
            v = load_validation(d)
            vals.append(v)
            runs.extend((v.sim, v.real))
        if not dirs:
            runs.append(load_run(path))
    _unique_labels(runs)
    return runs, vals


def _unique_labels(runs: list[RunData]) -> None:
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.label] = counts.get(r.label, 0) + 1
    for r in runs:
        if counts[r.label] > 1:
            parent = r.path.resolve()
            name = parent.name if parent.name not in ("sim", "real") else f"{parent.parent.name}/{parent.name}"
            r.label = f"{r.label} [{name}]"
    seen: dict[str, int] = {}
    for r in runs:  # same directory given twice
        n = seen.get(r.label, 0)
        seen[r.label] = n + 1
        if n:
            r.label = f"{r.label} #{n + 1}"


# ------------------------------------------------------------------------ helpers


def cdf(values: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Empirical CDF: sorted values and the fraction of values <= each."""
    x = np.sort(np.asarray(values, dtype=float))
    y = np.arange(1, x.size + 1) / x.size if x.size else np.array([])
    return x, y


def percentile(values: np.ndarray, p: float) -> float | None:
    """numpy's linear interpolation, as summarize() computes percentiles."""
    return float(np.percentile(values, p)) if len(values) else None


def fmt_ms(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "n/a"
    if abs(v) >= 10_000:
        return f"{v / 1e3:.1f} s"
    if abs(v) >= 1000:
        return f"{v / 1e3:.2f} s"
    if abs(v) >= 100:
        return f"{v:.0f} ms"
    if abs(v) >= 10:
        return f"{v:.1f} ms"
    return f"{v:.2f} ms"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "run"


def _thin(x: np.ndarray, y: np.ndarray, n: int = MAX_CURVE_POINTS):
    """At most ~n points of a monotone curve, keeping the ends."""
    if x.size <= n:
        return x, y
    idx = np.unique(np.linspace(0, x.size - 1, n).round().astype(int))
    return x[idx], y[idx]


def _new_figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _style(ax) -> None:
    ax.grid(True, which="major", color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def save(fig, out_dir: str | Path | None, name: str, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Write ``fig`` as OUT_DIR/NAME.<format> for each format (nothing when ``out_dir`` is None)."""
    if out_dir is None:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        path = out / f"{name}.{fmt}"
        meta = {"Date": None} if fmt == "svg" else {}
        import matplotlib

        with matplotlib.rc_context({"svg.hashsalt": "schedlab", "svg.fonttype": "none"}):
            fig.savefig(path, format=fmt, metadata=meta)
        written.append(path)
    return written


def _plain_log_axis(axis) -> None:
    """Log scale with 1-2-5 ticks written as plain numbers (20, 50, 100), not 2x10^1; over more
    than three decades only the powers of ten are written (the 2s and 5s would run together)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def label(v: float, _) -> str:
        lo, hi = sorted(axis.get_view_interval())
        if lo > 0 and hi / lo > 1e3 and abs(math.log10(v) - round(math.log10(v))) > 1e-6:
            return ""
        return f"{v:,.10g}" if v >= 1 else f"{v:.3g}"

    axis.axes.set_xscale("log") if axis is axis.axes.xaxis else axis.axes.set_yscale("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(label))
    axis.set_minor_formatter(NullFormatter())


def _wide(x: np.ndarray, ratio: float = 30.0) -> bool:
    """Log axis when positive values span more than ``ratio``."""
    pos = x[x > 0]
    return pos.size > 0 and pos.size == x.size and pos.max() / pos.min() > ratio


# ------------------------------------------------------------------------ CDFs

METRICS = {
    "ttft": ("ttft_ms", "Time to first token", "TTFT (ms)", "fraction of requests with TTFT ≤ x", "requests"),
    "itl": (
        "itl_ms",
        "Inter-token latency",
        "ITL: gap between consecutive tokens (ms)",
        "fraction of token gaps ≤ x",
        "token gaps",
    ),
}


def metric_values(run: RunData, metric: str) -> np.ndarray:
    return run.ttft_ms() if metric == "ttft" else run.itl_ms()


def _draw_cdf(ax, values: np.ndarray, *, color, linestyle, label_prefix: str) -> dict[str, Any]:
    x, y = cdf(values)
    p50, p99 = percentile(x, 50), percentile(x, 99)
    label = f"{label_prefix}: p50 {fmt_ms(p50)}, p99 {fmt_ms(p99)}"
    if x.size:
        dx, dy = _thin(x, y)
        ax.step(
            np.r_[dx[0], dx], np.r_[0.0, dy], where="post", color=color, linestyle=linestyle, linewidth=1.8, label=label
        )
        ax.plot([p50], [0.5], marker="o", markersize=7, color=color, markeredgecolor="white", zorder=5)
        ax.plot([p99], [0.99], marker="D", markersize=6, color=color, markeredgecolor="white", zorder=5)
    else:
        ax.plot([], [], color=color, linestyle=linestyle, label=f"{label_prefix}: no values")
    return {"x": x, "y": y, "p50": p50, "p99": p99, "n": int(x.size)}


def _finish_cdf_axes(ax, all_x: list[np.ndarray], xlabel: str, ylabel: str) -> bool:
    xs = np.concatenate([a for a in all_x if a.size]) if any(a.size for a in all_x) else np.array([])
    log = _wide(xs)
    if log:
        _plain_log_axis(ax.xaxis)
    ax.set_ylim(0, 1.03)
    ax.axhline(0.5, color="#999999", linewidth=0.7, linestyle=":", zorder=1)
    ax.axhline(0.99, color="#999999", linewidth=0.7, linestyle=":", zorder=1)
    trans = ax.get_yaxis_transform()
    ax.text(1.0, 0.5, " p50 (●)", transform=trans, va="center", ha="left", fontsize=8, color="#555555")
    ax.text(1.0, 0.99, " p99 (◆)", transform=trans, va="center", ha="left", fontsize=8, color="#555555")
    ax.set_xlabel(xlabel + (", log scale" if log else ""))
    ax.set_ylabel(ylabel)
    _style(ax)
    return log


def _run_styles(runs: Sequence[RunData]):
    """Colour per run; sim dashed when real runs are in the same figure."""
    any_real = any(r.mode == "real" for r in runs)
    for i, r in enumerate(runs):
        yield r, f"C{i % 10}", ("--" if any_real and r.mode != "real" else "-")


def plot_cdf(runs: Sequence[RunData], metric: str, out_dir: str | Path, formats=FORMATS) -> dict[str, Any]:
    """TTFT or ITL CDF, one curve per run, p50 and p99 marked. Returns the drawn data."""
    key, title, xlabel, ylabel, unit = METRICS[metric]
    fig = _new_figure(8.5, 5.0)
    ax = fig.add_subplot()
    data: dict[str, Any] = {}
    for r, color, ls in _run_styles(runs):
        data[r.label] = _draw_cdf(ax, metric_values(r, metric), color=color, linestyle=ls, label_prefix=r.label)
    log = _finish_cdf_axes(ax, [d["x"] for d in data.values()], xlabel, ylabel)
    counts = sorted({d["n"] for d in data.values()})
    n_text = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    ax.set_title(f"{title}: CDF over {n_text} {unit}" + (" per run" if len(runs) > 1 else ""))
    ax.legend(loc="lower right", fontsize=8.5, framealpha=0.9)
    files = save(fig, out_dir, f"{metric}_cdf", formats)
    return {"files": files, "figure": fig, "runs": data, "log_x": log}


# ------------------------------------------------------------------------ decode rates


def plot_decode_rates(runs: Sequence[RunData], out_dir: str | Path, formats=FORMATS) -> dict[str, Any]:
    """Per-request decode rate, sorted ascending, one panel per run; median marked."""
    n = len(runs)
    fig = _new_figure(9.5, 2.0 + 2.4 * n)
    axes = fig.subplots(n, 1, squeeze=False, sharey=True)[:, 0]
    data: dict[str, Any] = {}
    for ax, r in zip(axes, runs):
        ids, rates = r.decode_rates()
        order = np.argsort(rates, kind="stable")
        ids, rates = ids[order], rates[order]
        med = percentile(rates, 50)
        starved = rates < STARVED_FRACTION * med if med is not None else np.zeros(0, bool)
        colors = np.where(starved, STARVED_COLOR, DECODE_COLOR)
        x = np.arange(rates.size)
        if rates.size <= 2000:
            ax.bar(x, rates, width=0.85 if rates.size <= 200 else 1.0, color=colors, linewidth=0)
        else:  # too many bars for a clean SVG: the same heights as a filled step
            ax.fill_between(x, rates, step="mid", color=DECODE_COLOR, linewidth=0)
            if starved.any():
                ax.fill_between(x, np.where(starved, rates, 0), step="mid", color=STARVED_COLOR, linewidth=0)
        if med is not None:
            ax.axhline(med, color="black", linestyle="--", linewidth=1.1)
        if 0 < rates.size <= 48:
            ax.set_xticks(x, [str(i) for i in ids], rotation=90, fontsize=7)
            ax.set_xlabel("request id, sorted by decode rate (ascending)")
        else:
            ax.set_xlabel("requests, sorted by decode rate (ascending)")
        if rates.size > 48:  # ids are not on the axis: name the slowest
            slow = ", ".join(f"{i} ({v:.3g})" for i, v in zip(ids[:3], rates[:3]))
            ax.text(
                0.01,
                0.97,
                f"slowest: {slow} tok/s",
                transform=ax.transAxes,
                va="top",
                ha="left",
                fontsize=8.5,
                bbox={"facecolor": "white", "edgecolor": "#bbbbbb", "boxstyle": "round,pad=0.3"},
            )
        ax.set_xlim(-0.7, max(rates.size, 1) - 0.3)
        ax.set_ylabel("decode rate (tok/s)")
        skipped = len(r.finished) - rates.size
        note = f"; {skipped} with one output token have no rate" if skipped else ""
        med_text = f"median {med:.3g} tok/s (dashed)" if med is not None else "no decode rates"
        ax.set_title(
            f"{r.label}: {rates.size} requests, {med_text}, {int(starved.sum())} below "
            f"{STARVED_FRACTION:.0%} of it (red){note}",
            fontsize=10,
        )
        _style(ax)
        ax.grid(False, axis="x")
        data[r.label] = {"ids": list(ids), "heights": rates, "median": med, "starved": list(ids[starved])}
    fig.suptitle("Per-request decode rate = (output tokens − 1) / (last token − first token)", fontsize=11)
    files = save(fig, out_dir, "decode_rate", formats)
    return {"files": files, "figure": fig, "runs": data}


# ------------------------------------------------------------------------ timeline


def parse_window(text: str | None, name: str = "--window") -> tuple[float, float] | None:
    """``START:END`` in seconds (either side may be empty); ``name``: the option, in messages."""
    if text is None or text == "":
        return None
    if ":" not in text:
        raise RunDirError(f"{name} must be START:END in seconds, got {text!r}")
    a, b = text.split(":", 1)
    try:
        start = float(a) if a.strip() else -math.inf
        end = float(b) if b.strip() else math.inf
    except ValueError:
        raise RunDirError(f"{name} must be START:END in seconds, got {text!r}") from None
    if not end > start:
        raise RunDirError(f"{name} end must be after its start, got {text!r}")
    return start, end


def token_segments(run: RunData, ids: Sequence[str]) -> list[tuple[str, str, float, float]]:
    """(request id, kind, start, end) per output token of ``ids``, from the tokens and steps tables.

    kind is ``first`` (the pass that completed the prompt or handed it off) or ``decode``.
    ``end`` is the token's time (exact). ``start`` is the latest known pass boundary before
    it: the previous distinct token time of any request inside the same step, else the
    step's start (so it may include earlier token-less passes of the step).
    """
    steps = run.steps.sort_values("start_s", kind="stable")
    starts = steps["start_s"].to_numpy(float)
    ends = steps["end_s"].to_numpy(float)
    all_t = np.unique(run.tokens["time_s"].to_numpy(float))
    want = set(ids)
    tok = run.tokens[run.tokens["request_id"].isin(want)].sort_values(["request_id", "token_index"], kind="stable")
    segs: list[tuple[str, str, float, float]] = []
    for rid, ti, t in zip(tok["request_id"], tok["token_index"], tok["time_s"].to_numpy(float)):
        k = int(np.searchsorted(ends, t, side="left"))
        if k >= len(ends):
            k = len(ends) - 1
        step_start = starts[k] if k >= 0 and starts[k] <= t else t
        j = int(np.searchsorted(all_t, t, side="left"))
        prev = all_t[j - 1] if j > 0 else -math.inf
        start = prev if prev > step_start else step_start
        segs.append((rid, "first" if ti == 0 else "decode", float(start), float(t)))
    return segs


def pass_segments(run: RunData, ids: Sequence[str]) -> list[tuple[str, str, float, float]]:
    p = run.passes
    rows = p[p["request_id"].isin(set(ids))]
    return [
        (rid, kind, float(s), float(e))
        for rid, kind, s, e in zip(rows["request_id"], rows["kind"], rows["start_s"], rows["end_s"])
    ]


def timeline_lanes(run: RunData, lanes: int = DEFAULT_LANES, window: tuple[float, float] | None = None):
    """Requests to draw, by arrival: the first ``lanes`` of those alive in ``window``."""
    req = run.requests.sort_values("arrival_s", kind="stable")
    if window is not None:
        lo, hi = window
        end = req["finish_s"].fillna(math.inf)
        if run.tokens.size:
            last = run.tokens.groupby("request_id")["time_s"].max()
            end = end.where(req["finish_s"].notna(), req["id"].map(last).fillna(math.inf))
        req = req[(req["arrival_s"] <= hi) & (end >= lo)]
    return req.head(lanes), len(req)


def _rects(ax, x, w, h, color, edge) -> None:
    """Bars from (x, width, height) as one collection (thousands of steps stay fast)."""
    from matplotlib.collections import PolyCollection

    keep = h > 0
    x, w, h = x[keep], w[keep], h[keep]
    verts = np.stack([np.c_[x, np.zeros_like(h)], np.c_[x, h], np.c_[x + w, h], np.c_[x + w, np.zeros_like(h)]], axis=1)
    ax.add_collection(PolyCollection(verts, facecolors=color, edgecolors=edge, linewidths=0.4))
    ax.set_ylim(0, (h.max() if h.size else 1) * 1.1)


def _lane_rects(ax, x, w, lane, half, color, edge, z) -> None:
    from matplotlib.collections import PolyCollection

    lo, hi = lane - half, lane + half
    verts = np.stack([np.c_[x, lo], np.c_[x, hi], np.c_[x + w, hi], np.c_[x + w, lo]], axis=1)
    ax.add_collection(PolyCollection(verts, facecolors=color, edgecolors=edge, linewidths=0.3, zorder=z))


def plot_timeline(
    run: RunData,
    out_dir: str | Path,
    name: str | None = None,
    *,
    lanes: int = DEFAULT_LANES,
    window: tuple[float, float] | None = None,
    formats=FORMATS,
) -> dict[str, Any]:
    """Per-request lanes of prefill and decode work over time, with per-step batch panels."""
    shown, alive = timeline_lanes(run, lanes, window)
    ids = list(shown["id"])
    source = "passes" if run.passes is not None else "tokens"
    segs = pass_segments(run, ids) if source == "passes" else token_segments(run, ids)
    x0, x1 = _timeline_range(shown, segs, window)

    steps = run.steps
    in_range = steps[(steps["end_s"] >= x0) & (steps["start_s"] <= x1)]
    n_lanes = max(len(ids), 1)
    fig = _new_figure(12.0, 3.4 + 0.19 * n_lanes)
    gs = fig.add_gridspec(3, 1, height_ratios=[0.9, 0.9, max(3.0, 0.19 * n_lanes)])
    ax_d = fig.add_subplot(gs[0])
    ax_p = fig.add_subplot(gs[1], sharex=ax_d)
    ax = fig.add_subplot(gs[2], sharex=ax_d)
    _step_panels(ax_d, ax_p, in_range)
    _request_lanes(ax, shown, segs, (x0, x1))
    how = _timeline_legend(fig, source, bool((shown["status"] == "rejected").any()))
    which = (
        f"{len(ids)} of {alive} requests alive in {window[0]:g}–{window[1]:g} s"
        if window
        else f"first {len(ids)} of {len(run.requests)} requests by arrival"
    )
    title = f"{run.label}: step timeline, {which} ({how})"
    if run.summary.get("error"):
        title += f"\nthe run stopped early: {run.summary['error']}"
    ax_d.set_title(title, fontsize=10.5)
    files = save(fig, out_dir, name or f"timeline_{slug(run.label)}", formats)
    return {
        "files": files,
        "figure": fig,
        "lanes": ids,
        "segments": segs,
        "source": source,
        "x_range": (x0, x1),
        "steps_drawn": in_range["step"].to_numpy(),
    }


def _timeline_range(shown, segs, window: tuple[float, float] | None) -> tuple[float, float]:
    """The time range drawn: the window, else the drawn lanes' lifetimes."""
    if window is not None and math.isfinite(window[0]) and math.isfinite(window[1]):
        x0, x1 = window
        return x0, x1
    lo = [float(shown["arrival_s"].min())] if len(shown) else [0.0]
    hi = [e for _, _, _, e in segs] + [float(shown["arrival_s"].max())] + lo
    x0 = window[0] if window is not None and math.isfinite(window[0]) else min(lo)
    x1 = window[1] if window is not None and math.isfinite(window[1]) else max(hi)
    if x1 <= x0:
        x1 = x0 + 1.0
    return x0, x1


def _step_panels(ax_d, ax_p, steps) -> None:
    """Decode rows and prefill tokens per step: rectangles spanning each step (gaps = idle replica)."""
    st = steps["start_s"].to_numpy(float)
    wd = (steps["end_s"] - steps["start_s"]).to_numpy(float)
    edge = "white" if len(steps) <= 400 else "none"
    _rects(ax_d, st, wd, steps["decode_rows"].to_numpy(float), DECODE_COLOR, edge)
    _rects(ax_p, st, wd, steps["prefill_tokens"].to_numpy(float), PREFILL_COLOR, edge)
    ax_d.set_ylabel("decode\nrows", fontsize=9)
    ax_p.set_ylabel("prefill\ntokens", fontsize=9)
    for a in (ax_d, ax_p):
        _style(a)
        a.tick_params(labelbottom=False, labelsize=8)


def _request_lanes(ax, shown, segs, x_range: tuple[float, float]) -> None:
    """One lane per request, earliest arrival on top: its arrival, its time in the system, its wait
    before the first segment drawn, then its prefill and decode segments."""
    ids = list(shown["id"])
    lane_of = {rid: i for i, rid in enumerate(ids)}
    _lifelines(ax, shown, segs)
    first_start: dict[str, float] = {}
    for rid, kind, s, e in segs:
        first_start[rid] = min(first_start.get(rid, math.inf), s)
    # before the first drawn segment: waiting (passes view) or unresolved (tokens view)
    waits = []
    for row in shown.itertuples(index=False):
        fs = first_start.get(row.id)
        if fs is not None and fs > row.arrival_s:
            waits.append((lane_of[row.id], row.arrival_s, fs - row.arrival_s))
    if waits:
        lane, a, w = (np.array(v, dtype=float) for v in zip(*waits))
        _lane_rects(ax, a, w, lane, 0.2, WAIT_COLOR, "none", 2)
    seg_edge = "white" if len(segs) <= 3000 else "none"
    for kinds, color in ((("prefill", "first"), PREFILL_COLOR), (("decode",), DECODE_COLOR)):
        mine = [(lane_of[rid], s, e) for rid, kind, s, e in segs if kind in kinds]
        if mine:
            lane, s, e = (np.array(v, dtype=float) for v in zip(*mine))
            _lane_rects(ax, s, e - s, lane, 0.38, color, seg_edge, 3)

    x0, x1 = x_range
    pad = (x1 - x0) * 0.01
    ax.set_ylim(max(len(ids), 1) - 0.5, -0.5)  # earliest arrival on top
    if len(ids) <= 80:
        ax.set_yticks(range(len(ids)), ids, fontsize=7 if len(ids) > 30 else 8)
    ax.set_ylabel("request (by arrival)")
    ax.set_xlabel("time since trace start (s)")
    ax.set_xlim(x0 - pad, x1 + pad)
    _style(ax)
    ax.grid(False, axis="y")


def _lifelines(ax, shown, segs) -> None:
    """Each request's time in the system (a grey line; a cross for a rejected one) and its arrival."""
    alive_line = []
    for i, row in enumerate(shown.itertuples(index=False)):
        end = row.finish_s if row.status == "finished" else None
        if row.status == "rejected":
            ax.plot([row.arrival_s], [i], marker="x", color=STARVED_COLOR, markersize=6)
            continue
        mine = [s for s in segs if s[0] == row.id]
        last = max((e for _, _, _, e in mine), default=row.arrival_s)
        alive_line.append((row.arrival_s, end if end is not None else last, i))
    if alive_line:
        from matplotlib.collections import LineCollection

        ax.add_collection(
            LineCollection([[(a, i), (b, i)] for a, b, i in alive_line], colors="#b0b0b0", linewidths=0.8, zorder=1)
        )
    ax.plot(
        shown["arrival_s"].to_numpy(float),
        np.arange(len(shown)),
        linestyle="none",
        marker="|",
        color="black",
        markersize=7,
        zorder=4,
    )


def _timeline_legend(fig, source: str, rejected: bool) -> str:
    """The legend, worded for what the source records; returns how the lanes were drawn."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if source == "passes":
        wait_label = "queued: arrived, in no pass yet"
        prefill_label = "prefill chunk (one pass)"
        decode_label = "decode row (one pass)"
        how = "exact, from passes.parquet"
    else:
        wait_label = "waiting or prefilling (not recorded per request)"
        prefill_label = "pass that completed the prompt: first token"
        decode_label = "decode: ends at the token, starts at the last known pass boundary"
        how = "from tokens.parquet: token times exact, prefill chunks not recorded"
    handles = [
        Patch(color=WAIT_COLOR, label=wait_label),
        Patch(color=PREFILL_COLOR, label=prefill_label),
        Patch(color=DECODE_COLOR, label=decode_label),
        Line2D([], [], color="black", marker="|", linestyle="none", markersize=8, label="arrival"),
        Line2D([], [], color="#b0b0b0", label="in system (gaps = stalled)"),
    ]
    if rejected:
        handles.append(
            Line2D(
                [],
                [],
                color=STARVED_COLOR,
                marker="x",
                linestyle="none",
                markersize=7,
                label="rejected: needs more KV than the capacity",
            )
        )
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return how


# ------------------------------------------------------------------------ replica load

MAX_REPLICA_LINES = 8  # more replicas: the min/median/max across them instead of a line each


def is_cluster_run(run: RunData) -> bool:
    """A run of several replicas (requests.csv has ``replica``; summary.json ``replicas``)."""
    return "replica" in run.requests.columns and len(run.summary.get("replicas") or ()) > 1


def replica_load(run: RunData) -> tuple[np.ndarray, np.ndarray]:
    """(times, counts): each replica's unfinished requests (arrived, not finished; rejected
    ones never count) at every time its count may change, from requests.csv. ``counts[j, i]``
    holds from ``times[i]`` until ``times[i + 1]`` (an arrival at t counts at t, a finish at t
    no longer does); ``counts`` has one row per replica, in order."""
    req = run.requests
    req = req[req["status"] != "rejected"]
    n = max(len(run.summary.get("replicas") or ()), int(req["replica"].max()) + 1 if len(req) else 0)
    rep = req["replica"].to_numpy(dtype=np.int64)
    arr = req["arrival_s"].to_numpy(dtype=float)
    fin = req["finish_s"].to_numpy(dtype=float)  # NaN: never finished (a run stopped early)
    times = np.unique(np.concatenate([arr, fin[np.isfinite(fin)]]))
    counts = np.zeros((n, times.size), dtype=np.int64)
    for j in range(n):
        mine = rep == j
        a = np.sort(arr[mine])
        f = np.sort(fin[mine & np.isfinite(fin)])
        counts[j] = np.searchsorted(a, times, "right") - np.searchsorted(f, times, "right")
    return times, counts


def _replica_names(run: RunData) -> list[str]:
    parts = run.summary.get("replicas") or []
    several = len({p.get("group") for p in parts}) > 1  # a heterogeneous cluster: say each one's group
    return [
        f"replica {p.get('replica', i)}" + (f" (group {p['group']}: {p.get('policy')})" if several else "")
        for i, p in enumerate(parts)
    ]


def plot_replica_load(runs: Sequence[RunData], out_dir: str | Path | None, formats=FORMATS) -> dict[str, Any]:
    """Each cluster run's unfinished requests per replica over time, one panel per run: a line
    per replica, or (more than ``MAX_REPLICA_LINES`` replicas) the min-max band and median
    across them. Returns the drawn numbers (``times``, ``counts`` per run)."""
    runs = [r for r in runs if is_cluster_run(r)]
    n = len(runs)
    fig = _new_figure(9.5, 1.6 + 2.8 * n)
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    data: dict[str, Any] = {}
    for ax, r in zip(axes, runs):
        times, counts = replica_load(r)
        band = counts.shape[0] > MAX_REPLICA_LINES
        if band:
            lo, mid, hi = counts.min(axis=0), np.median(counts, axis=0), counts.max(axis=0)
            ax.fill_between(times, lo, hi, step="post", color=DECODE_COLOR, alpha=0.25, linewidth=0, label="min–max")
            ax.step(times, mid, where="post", color=DECODE_COLOR, linewidth=1.2, label="median")
            what = f"min, median and max across {counts.shape[0]} replicas"
        else:
            names = _replica_names(r)
            for j, row in enumerate(counts):
                name = names[j] if j < len(names) else f"replica {j}"
                ax.step(times, row, where="post", color=f"C{j % 10}", linewidth=1.1, label=name)
            what = f"{counts.shape[0]} replicas"
        from matplotlib.ticker import MaxNLocator

        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("time (s)")
        ax.set_ylabel("unfinished requests")
        ax.set_title(f"{r.label}: unfinished requests (arrived, not finished) per replica, {what}", fontsize=10)
        ax.legend(loc="upper right", fontsize=8, framealpha=0.9, ncol=2 if counts.shape[0] > 4 else 1)
        _style(ax)
        data[r.label] = {"times": times, "counts": counts, "band": band}
    files = save(fig, out_dir, "replica_load", formats)
    return {"files": files, "figure": fig, "runs": data}


# ------------------------------------------------------------------------ validation


def step_kinds(steps) -> np.ndarray:
    d = steps["decode_rows"].to_numpy(float) > 0
    p = steps["prefill_tokens"].to_numpy(float) > 0
    return np.where(d & p, "decode + prefill", np.where(p, "prefill only", "decode only"))


def step_time_errors(real: RunData):
    """(predicted_s, measured_s, kinds) of the real run's steps with a measured time."""
    s = real.steps
    ok = s["measured_s"].notna() & (s["measured_s"] > 0) & s["predicted_s"].notna()
    if not ok.any():
        raise RunDirError(f"{real.path / 'steps.parquet'}: no step has measured_s (not a real run)")
    s = s[ok]
    return s["predicted_s"].to_numpy(float), s["measured_s"].to_numpy(float), step_kinds(s)


def plot_validation(v: ValidationData, out_dir: str | Path, name: str | None = None, formats=FORMATS) -> dict[str, Any]:
    """Sim (dashed) vs real (solid) TTFT/ITL CDFs, and predicted vs measured step time."""
    base = name or f"validate_{slug(v.path.resolve().name)}"
    title_run = f"{v.real.policy} on {v.real.summary.get('trace', '?')}"

    fig = _new_figure(13.0, 5.0)
    axes = fig.subplots(1, 2)
    cdfs: dict[str, Any] = {}
    for ax, metric in zip(axes, ("ttft", "itl")):
        key, title, xlabel, ylabel, unit = METRICS[metric]
        d = {}
        d["real"] = _draw_cdf(
            ax, metric_values(v.real, metric), color="black", linestyle="-", label_prefix="measured (real)"
        )
        d["sim"] = _draw_cdf(
            ax, metric_values(v.sim, metric), color="#d1495b", linestyle="--", label_prefix="simulated"
        )
        _finish_cdf_axes(ax, [d["real"]["x"], d["sim"]["x"]], xlabel, ylabel)
        ax.set_title(f"{title} CDF ({d['real']['n']} real / {d['sim']['n']} sim {unit})", fontsize=10.5)
        ax.legend(loc="lower right", fontsize=8.5)
        cdfs[metric] = d
    fig.suptitle(f"Simulated vs measured: {title_run}", fontsize=12)
    files = save(fig, out_dir, f"{base}_cdfs", formats)
    figures = {f"{base}_cdfs": fig}

    pred, meas, kinds = step_time_errors(v.real)
    err = np.abs(pred - meas) / meas
    med = float(np.median(err)) * 100
    fig = _new_figure(7.0, 6.2)
    ax = fig.add_subplot()
    for i, kind in enumerate(("decode only", "prefill only", "decode + prefill")):
        m = kinds == kind
        if m.any():
            ax.scatter(
                pred[m] * 1e3,
                meas[m] * 1e3,
                s=14,
                alpha=0.65,
                color=f"C{i}",
                linewidths=0,
                label=f"{kind} ({int(m.sum())} steps, median |err| {np.median(err[m]) * 100:.1f}%)",
            )
    lo = min(pred.min(), meas.min()) * 1e3 / 1.3
    hi = max(pred.max(), meas.max()) * 1e3 * 1.3
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="y = x (perfect prediction)")
    ax.plot([lo, hi], [lo * 1.2, hi * 1.2], color="#888888", linewidth=0.8, linestyle=":", label="±20%")
    ax.plot([lo, hi], [lo / 1.2, hi / 1.2], color="#888888", linewidth=0.8, linestyle=":")
    _plain_log_axis(ax.xaxis)
    _plain_log_axis(ax.yaxis)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel("predicted step time (ms), cost model")
    ax.set_ylabel("measured step time (ms), MLX")
    ax.set_title(
        f"Step time: predicted vs measured\n{title_run}, {pred.size} steps, median |error| {med:.1f}%", fontsize=10.5
    )
    ax.legend(loc="upper left", fontsize=8)
    _style(ax)
    files += save(fig, out_dir, f"{base}_step_time", formats)
    figures[f"{base}_step_time"] = fig
    return {
        "files": files,
        "figures": figures,
        "cdfs": cdfs,
        "predicted_s": pred,
        "measured_s": meas,
        "median_abs_pct_error": med,
    }


# ------------------------------------------------------------------------ everything


@dataclass
class PlotReport:
    files: list[Path] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)  # name (the file's stem) -> matplotlib Figure


def check_against_summary(run: RunData) -> list[str]:
    """Percentiles recomputed from the CSVs must match summary.json (else the files disagree)."""
    out = []
    for metric in ("ttft", "itl"):
        key = METRICS[metric][0]
        vals = metric_values(run, metric)
        want = run.summary.get(key) or {}
        for p in ("p50", "p99"):
            w = want.get(p)
            got = percentile(vals, float(p[1:]))
            if w is None or got is None:
                continue
            if not math.isclose(w, got, rel_tol=1e-9, abs_tol=1e-9):
                out.append(f"{run.path}: {key} {p} from the CSVs is {got:.6g} but summary.json says {w:.6g}")
    return out


def plot_all(
    paths: Sequence[str | Path],
    out_dir: str | Path | None,
    *,
    formats: Sequence[str] = FORMATS,
    lanes: int = DEFAULT_LANES,
    window: tuple[float, float] | None = None,
) -> PlotReport:
    """Every figure for the given run and validation directories."""
    runs, vals = load_inputs(paths)
    return plot_runs(runs, vals, out_dir, formats=formats, lanes=lanes, window=window)


KINDS = ("ttft", "itl", "decode_rate", "timeline", "replica_load", "validation")


def plot_runs(
    runs: Sequence[RunData],
    vals: Sequence[ValidationData],
    out_dir: str | Path | None,
    *,
    formats: Sequence[str] = FORMATS,
    lanes: int = DEFAULT_LANES,
    window: tuple[float, float] | None = None,
    kinds: Sequence[str] = KINDS,
) -> PlotReport:
    """Every figure (of ``kinds``) for runs (``vals``' sim and real runs among them) and
    validations: written to ``out_dir`` (nothing written when None) and returned as figures."""
    rep = PlotReport()
    for r in runs:
        rep.warnings += check_against_summary(r)

    def keep(name: str, d: dict[str, Any]) -> dict[str, Any]:
        rep.files += d.pop("files")
        fig = d.pop("figure", None)
        if fig is not None:
            rep.figures[name] = fig
        rep.figures.update(d.pop("figures", {}))
        return d

    for metric in ("ttft", "itl"):
        if metric in kinds:
            rep.data[f"{metric}_cdf"] = keep(f"{metric}_cdf", plot_cdf(runs, metric, out_dir, formats))
    if "decode_rate" in kinds:
        rep.data["decode_rate"] = keep("decode_rate", plot_decode_rates(runs, out_dir, formats))
    used: set[str] = set()
    for r in runs if "timeline" in kinds else ():
        name = f"timeline_{slug(r.label)}"
        k = 2
        while name in used:
            name = f"timeline_{slug(r.label)}-{k}"
            k += 1
        used.add(name)
        rep.data[name] = keep(name, plot_timeline(r, out_dir, name, lanes=lanes, window=window, formats=formats))
    if "replica_load" in kinds and any(is_cluster_run(r) for r in runs):  # (runs of several replicas only)
        rep.data["replica_load"] = keep("replica_load", plot_replica_load(runs, out_dir, formats))
    vnames: set[str] = set()
    for v in vals if "validation" in kinds else ():
        name = f"validate_{slug(v.path.resolve().name)}"
        while name in vnames:
            name += "-2"
        vnames.add(name)
        rep.data[name] = keep(name, plot_validation(v, out_dir, name, formats))
    return rep
