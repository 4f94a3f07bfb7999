"""``plot``: the ``plot`` command's figures for runs, validations and their directories."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..errors import opt
from ._base import fail, out_dir, parse_formats, public

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure


class Figures(dict):
    """Figures by name (the file stem the ``plot`` command writes, e.g. ``ttft_cdf``), plus
    ``files``: the files written (empty unless ``out`` was given) and ``warnings``: files
    that disagree with their summary."""

    def __init__(self, figures: Mapping[str, "Figure"] = (), files: Sequence[Path] = (), warnings: Sequence[str] = ()):
        super().__init__(figures)
        self.files = list(files)
        self.warnings = list(warnings)


def _plot_inputs(items: Sequence[Any]):
    from schedlab.analysis.plots import _unique_labels, load_run as read_dir, load_validation, validation_dirs

    runs, vals = [], []
    for it in items:
        if hasattr(it, "_validation_data"):  # a Validation
            for v in it._validation_data():
                vals.append(v)
                runs.extend((v.sim, v.real))
        elif hasattr(it, "_run_data"):  # a Run
            runs.append(it._run_data())
        elif isinstance(it, (str, Path)):
            dirs = validation_dirs(it)  # (a validation of several policies: each policy's)
            for d in dirs:
                v = load_validation(d)
                vals.append(v)
                runs.extend((v.sim, v.real))
            if not dirs:
                runs.append(read_dir(it))
        else:
            fail(f"plot takes runs, validations and run directories, got {type(it).__name__}", 2)
    _unique_labels(runs)
    return runs, vals


@public
def plot(
    *items: Any,
    out: str | Path | None = None,
    formats: str | Sequence[str] = ("png", "svg"),
    lanes: int = 60,
    window: tuple[float, float] | str | None = None,
    kinds: str | Sequence[str] | None = None,
) -> Figures:
    """The ``plot`` command's figures for runs, validations and run/validation directories:
    TTFT and ITL CDFs (one curve per run), per-request decode rates, a step timeline per run,
    and simulated-vs-measured overlays for validations. Returns the matplotlib figures by name
    (the file stems the command writes); ``out``: also write them there in ``formats``.
    ``lanes``: the most requests a timeline draws; ``window``: its time span ``(start, end)``
    in seconds (or ``"START:END"``); ``kinds``: only these figures, of ``ttft``, ``itl``,
    ``decode_rate``, ``timeline``, ``replica_load`` (a cluster's runs: each replica's unfinished
    requests over time), ``validation`` (default: all)."""
    from schedlab.analysis.plots import KINDS, parse_window, plot_runs

    if not items:
        fail("plot needs at least one run, validation or run directory", 2)
    if kinds is None:
        kinds = KINDS
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        fail(f"kinds are {', '.join(KINDS)}; got {', '.join(map(repr, bad)) or 'none'}", 2)
    fmts = parse_formats(formats)
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        fail(f"{opt('lanes')} must be >= 1, got {lanes}", 2)
    if isinstance(window, str) or window is None:
        try:
            win = parse_window(window, opt("window"))
        except ValueError as exc:
            fail(str(exc), 2)
    else:
        try:
            start, end = (float(x) for x in window)
        except (TypeError, ValueError):
            fail(f"window is (start, end) in seconds, got {window!r}", 2)
        if not end > start:
            fail(f"window end must be after its start, got {window!r}", 2)
        win = (start, end)
    out = out_dir(out)
    runs, vals = _plot_inputs(items)
    try:
        rep = plot_runs(runs, vals, out, formats=fmts, lanes=lanes, window=win, kinds=kinds)
    except OSError as exc:
        fail(f"cannot write figures to {out}: {exc.strerror or exc}")
    return Figures(rep.figures, rep.files, rep.warnings)
