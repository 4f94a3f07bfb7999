"""What the benchmarks share: where results go, the machine and revision they ran on, writing
a results file (with its provenance: commit, dirty tree, time, machine), and the grid's own
coefficients of a calibrated profile, and a ``capacity`` table's rows by configuration.

The benches run with the project's environment active, against the installed ``schedlab``
(``python bench/NAME.py``); each imports this module as ``common`` (Python puts the script's
folder first on its path).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def result_path(bench: str) -> Path:
    """The one results file of a bench: ``bench/results/<bench>.json``."""
    return RESULTS / f"{bench}.json"


def _git(tree: Path, *args: str) -> str | None:
    """``git -C tree ARGS``'s output, or None where it fails (no git, not a checkout)."""
    try:
        p = subprocess.run(["git", "-C", str(tree), *args], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def git_rev(tree: Path = ROOT, short: bool = True) -> str | None:
    """The commit of a checkout (short, or the full hash), or None outside git (an installed copy,
    a tarball)."""
    return (_git(tree, "rev-parse", *(["--short"] if short else []), "HEAD") or "").strip() or None


def script_code(tree: Path, script: str) -> str:
    """Python (for ``python -c``) that runs checkout ``tree``'s console script ``script`` as the
    installed one does: the entry point its pyproject.toml names (they moved between versions).
    Run it with ``PYTHONPATH=tree`` and ``tree`` as the working directory, so that the tree's own
    package is imported."""
    import tomllib

    module, func = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"][script].split(":")
    return f"import sys; from {module} import {func} as f; sys.argv[0] = {script!r}; sys.exit(f())"


def git_dirty(tree: Path = ROOT) -> bool | None:
    """Whether a checkout's tracked files differ from its commit (staged or not), the results in
    ``bench/results/`` aside (what benches write, not what ran); None outside git."""
    out = _git(tree, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return None if out is None else bool(out.strip())


def cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict:
    """The machine a recording ran on, as every results file records it."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu": cpu_name(),
    }


def provenance(tree: Path = ROOT) -> dict:
    """How a results file was made, as ``write_json`` records it in every one: the commit (the full
    hash; None outside git), whether the tree was dirty (``git_dirty``), when the file was written
    (UTC, ISO 8601, to the second) and the machine."""
    commit = git_rev(tree, short=False)
    return {
        "commit": commit,
        "dirty": git_dirty(tree) if commit else None,
        "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
    }


def write_json(data: dict, path: str | Path, indent: int = 2, default=None) -> Path:
    """Write a results file: ``data`` after its ``provenance`` block (a ``provenance`` in ``data``
    is replaced; the caller's dict is left as it was), whole or not at all (a bench stopped while
    writing leaves the old file). ``default``: ``json.dumps``'s, for values JSON has no type for."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"provenance": provenance(), **{k: v for k, v in data.items() if k != "provenance"}}
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(body, indent=indent, default=default) + "\n")
    part.replace(path)
    return path


def grid_coefficients(prof: dict) -> dict:
    """The grid's own fit of a calibrated profile (what ``calibrate_default`` drew its replay's
    trace from, and the base a fit from runs starts from)."""
    from schedlab.engine.calibrate import grid_coefficients as from_samples

    coef = from_samples(prof)
    if coef is None:
        raise SystemExit("the profile keeps no grid samples: cannot fit its grid again")
    return coef


def value(summary: dict, path) -> float | None:
    """The number at ``path`` (a sequence of keys) in a summary, or None where it is missing or
    not a number (a metric with no samples)."""
    v = summary
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def capacity_rows(table, fields: Sequence[str | tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """A ``schedlab.capacity`` table (a DataFrame, a row per configuration) as
    ``{configuration: {key: value}}``: ``fields`` in order, each a column kept under its name or a
    ``(key, column)`` pair (``("per_gpu_rps", "capacity_per_gpu_rps")``)."""
    pairs = [(f, f) if isinstance(f, str) else f for f in fields]
    return {r["configuration"]: {key: r[col] for key, col in pairs} for r in table.to_dict("records")}
