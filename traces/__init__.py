"""Traces: the schema, loaders (JSON, Azure 2023 CSV, Mooncake JSONL), transforms, bundled files."""

from __future__ import annotations

import json
from pathlib import Path

from .schema import Request, Trace, TraceError, request_from_json, validate_requests

DATA_DIR = Path(__file__).resolve().parent / "data"


def load_json(path: str | Path) -> Trace:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except UnicodeDecodeError:
        raise TraceError(f"{p}: not a UTF-8 text file") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{p}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise TraceError(f"{p}: expected an object with a 'requests' list")
    reqs = [request_from_json(row, i, str(p.name)) for i, row in enumerate(data["requests"])]
    if not reqs:
        raise TraceError(f"{p}: the trace has no requests")
    return Trace(name=str(data.get("name") or p.stem), description=str(data.get("description", "")), requests=reqs)


def resolve(spec: str) -> Path:
    """A path as given, else a bundled trace by bare name, with or without extension."""
    p = Path(spec)
    if p.is_file():
        return p
    if "/" not in spec:
        for cand in (DATA_DIR / spec, *(DATA_DIR / f"{spec}{ext}" for ext in (".json", ".csv", ".jsonl"))):
            if cand.is_file():
                return cand
    if p.exists():
        raise TraceError(f"trace {spec} is not a file")
    raise TraceError(f"trace not found: {spec} (not a file, nor a bundled trace: {', '.join(bundled_names())})")


def bundled_names() -> list[str]:
    if not DATA_DIR.is_dir():
        return []
    return sorted(p.stem for p in DATA_DIR.iterdir() if p.suffix in (".json", ".csv", ".jsonl"))


def load(spec: str, seed: int = 0) -> Trace:
    """Load a trace file or bundled trace by name. Every problem is a one-line TraceError."""
    path = resolve(spec)
    try:
        return load_json(path)
    except OSError as exc:
        raise TraceError(f"cannot read trace {spec}: {exc.strerror}") from None


__all__ = ["Request", "Trace", "TraceError", "load", "load_json", "resolve", "bundled_names",
           "request_from_json", "validate_requests", "DATA_DIR"]
