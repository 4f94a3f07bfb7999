"""What the benchmarks share: where results go, the machine and revision they ran on, writing
a results file, and the grid's own coefficients of a calibrated profile.

The benches run with the project's environment active, against the installed ``schedlab``
(``python bench/NAME.py``); each imports this module as ``common`` (Python puts the script's
folder first on its path).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def result_path(bench: str) -> Path:
    """The one results file of a bench: ``bench/results/<bench>.json``."""
    return RESULTS / f"{bench}.json"


def git_rev(tree: Path = ROOT) -> str | None:
    """The short commit of a checkout, or None outside git (an installed copy, a tarball)."""
    try:
        p = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() or None


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


def write_json(data: dict, path: str | Path, indent: int = 2) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
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
