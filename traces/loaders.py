"""Trace loaders: schedlab JSON, Azure LLM inference 2023 CSV, Mooncake FAST'25 JSONL.

Every loader returns a :class:`~traces.schema.Trace` whose requests are sorted by arrival,
with ``arrival_s`` relative to the first request (which arrives at 0.0) and string ids.
Every problem with the input is a one-line :class:`~traces.schema.TraceError` that names the
file and the line (CSV, JSONL) or request (JSON); a loader never lets another exception out.

Formats
-------
``.json``
    schedlab's own form (see :mod:`traces.schema`). Arrival times are kept as written.
``.csv``
    Azure LLM inference trace 2023: header ``TIMESTAMP,ContextTokens,GeneratedTokens``,
    timestamps like ``2023-11-16 18:15:46.6805900`` (parsed exactly, to the nanosecond, in
    integer arithmetic). ContextTokens -> prompt_tokens, GeneratedTokens -> output_tokens,
    id = the data row's index (0 = first row after the header).
``.jsonl``
    Mooncake FAST'25: one object per line with ``timestamp`` (ms), ``input_length``,
    ``output_length`` and optional ``hash_ids`` (512-token prefix blocks) -> ``prefix_ids``;
    id = the data line's index. The real Mooncake traces quantise timestamps to 3 s ticks
    (measured: the distinct timestamps of the conversation trace are 2997-3003 ms apart);
    such arrivals are jittered uniformly within their tick with a seeded RNG (see
    :func:`jitter_ticks`).
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import random
import re
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Sequence

from . import datasets
from .schema import Request, Trace, TraceError, acceptance_from_json, request_from_json, validate_requests
from .text import require_counts, tokenize

DATA_DIR = Path(__file__).resolve().parent / "data"
EXTENSIONS = (".json", ".csv", ".jsonl")

#: Mooncake's timestamp tick, measured on the FAST'25 conversation trace: its 1,180 distinct
#: timestamps are 2997-3003 ms apart (every one of them a multiple of 3000 ms give or take 3 ms).
MOONCAKE_TICK_S = 3.0

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


# ---------------------------------------------------------------------------------------
# reading text


def _read_text(path: Path) -> str:
    """The file's text; a directory, unreadable, binary, non-UTF-8 or empty file is an error."""
    if path.is_dir():
        raise TraceError(f"{path}: is a directory, not a trace file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if b"\x00" in raw:
        raise TraceError(f"{path}: binary file, not a text trace")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not a UTF-8 text file (bad byte at offset {exc.start})") from None
    if not text.strip():
        raise TraceError(f"{path}: empty file")
    return text


def _trace(name: str, description: str, reqs: list[Request], where: str) -> Trace:
    """A Trace, validated with the file's name in the messages."""
    if not reqs:
        raise TraceError(f"{where}: the trace has no requests")
    validate_requests(reqs, where=where)
    return Trace(name=name, description=description, requests=reqs)


def _rebase(reqs: list[Request]) -> list[Request]:
    t0 = min(r.arrival_s for r in reqs)
    if t0 == 0.0:
        return reqs
    return [replace(r, arrival_s=r.arrival_s - t0) for r in reqs]


# ---------------------------------------------------------------------------------------
# JSON


def load_json(path: str | Path) -> Trace:
    """A schedlab JSON trace (``{"name", "description", "requests": [...]}``).

    Requests given as text without ``prompt_tokens`` are kept uncounted here (see
    :func:`traces.text.tokenize`); :func:`load` counts them or refuses them."""
    p = Path(path)
    text = _read_text(p)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{p}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise TraceError(f"{p}: invalid JSON: nested too deeply") from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise TraceError(f"{p}: expected an object with a 'requests' list")
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            raise TraceError(f"{p}: '{key}' must be a string, got {type(data[key]).__name__}")
    reqs = [request_from_json(row, i, p.name) for i, row in enumerate(data["requests"])]
    tr = _trace(data.get("name") or p.stem, data.get("description", ""), reqs, p.name)
    if data.get("speculative_acceptance") is not None:
        tr.speculative_acceptance = acceptance_from_json(data["speculative_acceptance"], p.name)
    return tr


def dumps_json(trace: Trace) -> str:
    """The JSON text of a trace: one request per line, stable across runs (for bundled files)."""
    head = {"name": trace.name, "description": trace.description}
    if trace.speculative_acceptance is not None:
        head["speculative_acceptance"] = trace.speculative_acceptance
    head = json.dumps(head)
    rows = ",\n".join("  " + json.dumps(r.to_json()) for r in trace.requests)
    return f'{head[:-1]},\n "requests": [\n{rows}\n]}}\n'


def save_json(trace: Trace, path: str | Path) -> Path:
    p = Path(path)
    p.write_text(dumps_json(trace), encoding="utf-8")
    return p


# ---------------------------------------------------------------------------------------
# Azure 2023 CSV

_TS = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")
_EPOCH = _dt.datetime(1970, 1, 1)


def parse_azure_timestamp(text: str) -> int:
    """``2023-11-16 18:15:46.6805900`` -> integer nanoseconds since 1970 (no rounding).

    Raises ValueError for anything else.
    """
    m = _TS.fullmatch(text.strip())
    if not m:
        raise ValueError(f"timestamp {text!r} is not YYYY-MM-DD HH:MM:SS[.fraction]")
    y, mo, d, h, mi, s, frac = m.groups()
    if s > "59":
        raise ValueError(f"timestamp {text!r}: second must be in 0..59")
    ns = int(frac.ljust(9, "0")) if frac else 0
    return (_minute_s(y, mo, d, h, mi) + int(s)) * 1_000_000_000 + ns


@lru_cache(maxsize=4096)
def _minute_s(y: str, mo: str, d: str, h: str, mi: str) -> int:
    """Seconds since 1970 at the start of a minute (a trace has a few rows a second: cached)."""
    whole = _dt.datetime(int(y), int(mo), int(d), int(h), int(mi))  # ValueError for e.g. month 13
    return (whole - _EPOCH) // _dt.timedelta(seconds=1)


def _count(cell: str, column: str, p: Path, lineno: int) -> int:
    c = cell.strip()
    if not c.isdigit() or not c.isascii():
        raise TraceError(f"{p}: line {lineno}: {column} must be a non-negative integer, got {cell!r}")
    return int(c)


def load_azure_csv(path: str | Path, drop_invalid: bool = False) -> Trace:
    """An Azure LLM inference 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    A row that can never be served (ContextTokens 0: empty prompt, or GeneratedTokens 0) is
    an error naming its line; with ``drop_invalid=True`` such rows are dropped instead and
    the count is reported in the trace's description. (The two bundled hours have no such
    row: all 19,366 conversation and 8,819 code rows are servable, so they load strictly.)
    Malformed rows (bad timestamp, non-numeric cell, wrong cell count) are always errors.
    """
    p = Path(path)
    text = _read_text(p)
    lines = text.splitlines()
    try:
        header = next(csv.reader([lines[0]]))
    except csv.Error as exc:
        raise TraceError(f"{p}: line 1: bad CSV header: {exc}") from None
    header = [h.strip() for h in header]
    missing = [c for c in AZURE_COLUMNS if c not in header]
    if missing:
        shown = ",".join(header)[:80]
        raise TraceError(
            f"{p}: line 1: bad CSV header {shown!r}: expected columns "
            f"{','.join(AZURE_COLUMNS)} (missing {', '.join(missing)})"
        )
    i_ts, i_ctx, i_gen = (header.index(c) for c in AZURE_COLUMNS)
    stamps: list[int] = []
    rows: list[tuple[str, int, int, int]] = []  # (id, line, ctx, gen)
    dropped = 0
    index = 0
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        if '"' in line:  # (a line without quotes is its cells joined by commas)
            try:
                cells = next(csv.reader([line]))
            except csv.Error as exc:
                raise TraceError(f"{p}: line {lineno}: bad CSV: {exc}") from None
        else:
            cells = line.split(",")
        if len(cells) != len(header):
            raise TraceError(f"{p}: line {lineno}: expected {len(header)} cells, got {len(cells)}")
        try:
            ts = parse_azure_timestamp(cells[i_ts])
        except ValueError as exc:
            raise TraceError(f"{p}: line {lineno}: {exc}") from None
        ctx = _count(cells[i_ctx], "ContextTokens", p, lineno)
        gen = _count(cells[i_gen], "GeneratedTokens", p, lineno)
        rid = str(index)
        index += 1
        if ctx < 1 or gen < 1:
            if drop_invalid:
                dropped += 1
                continue
            what = "empty prompt (ContextTokens 0)" if ctx < 1 else "GeneratedTokens 0 (no output)"
            raise TraceError(f"{p}: line {lineno}: {what}: the request can never be served")
        stamps.append(ts)
        rows.append((rid, lineno, ctx, gen))
    if not rows:
        raise TraceError(f"{p}: no requests" + (f" ({dropped} unservable rows dropped)" if dropped else ""))
    t0 = min(stamps)
    reqs = [Request(rid, (ts - t0) / 1e9, ctx, gen) for (rid, _, ctx, gen), ts in zip(rows, stamps)]
    first = _dt.datetime.fromtimestamp(t0 // 1_000_000_000, tz=_dt.timezone.utc).replace(tzinfo=None)
    desc = (
        f"Azure LLM inference trace 2023 ({p.stem}): {len(reqs)} requests from "
        f"{first.isoformat(sep=' ')}.{t0 % 1_000_000_000:09d} (CC-BY-4.0; Patel et al., "
        f"Splitwise, ISCA 2024)"
    )
    if drop_invalid:
        desc += f"; {dropped} unservable row(s) dropped"
    return _trace(p.stem, desc, reqs, p.name)


# ---------------------------------------------------------------------------------------
# Mooncake JSONL


def is_quantised(stamps_ms: Sequence[float], tick_s: float = MOONCAKE_TICK_S) -> bool:
    """True when distinct timestamps are never closer than 0.9 tick (Mooncake's real traces);
    False for e.g. the synthetic trace's Poisson arrivals (distinct stamps 1 ms apart)."""
    distinct = sorted(set(stamps_ms))
    gap = 0.9 * tick_s * 1000.0
    return all(b - a >= gap for a, b in zip(distinct, distinct[1:]))


def jitter_ticks(stamps_ms: Sequence[float], tick_s: float = MOONCAKE_TICK_S, seed: int = 0) -> list[float]:
    """Spread tick-quantised timestamps (ms) uniformly over their ticks; returns seconds.

    A request stamped T belongs to the tick [T, T + tick): the time it was quantised down
    from. When the next distinct stamp is closer than a tick (real ticks drift by a few ms)
    the tick ends there, so requests never cross into the next tick and ticks keep their
    order. Within a tick the drawn offsets are sorted and handed out in input order, so
    requests sharing a stamp keep their file order (Mooncake keeps multi-turn order that
    way). Same seed, same result; the result is not re-based.
    """
    if not (isinstance(tick_s, (int, float)) and math.isfinite(tick_s) and tick_s > 0):
        raise TraceError(f"tick must be a positive number of seconds, got {tick_s!r}")
    rng = random.Random(seed)
    groups: dict[float, list[int]] = {}
    for i, t in enumerate(stamps_ms):
        groups.setdefault(t, []).append(i)
    distinct = sorted(groups)
    out = [0.0] * len(stamps_ms)
    tick_ms = tick_s * 1000.0
    for k, t in enumerate(distinct):
        width = tick_ms if k + 1 == len(distinct) else min(tick_ms, distinct[k + 1] - t)
        members = groups[t]
        offsets = sorted(rng.random() * width for _ in members)
        for i, off in zip(members, offsets):
            out[i] = (t + off) / 1000.0
    return out


def _mooncake_rows(p: Path, text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{p}: line {lineno}: invalid JSON at column {exc.colno}: {exc.msg}") from None
        except RecursionError:
            raise TraceError(f"{p}: line {lineno}: invalid JSON: nested too deeply") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{p}: line {lineno}: expected an object, got {type(obj).__name__}")
        yield lineno, obj


def _mc_int(obj: dict, key: str, at: str, minimum: int) -> int:
    v = obj[key]
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (isinstance(v, float) and not (math.isfinite(v) and v.is_integer()))
    ):
        raise TraceError(f"{at}: '{key}' must be an integer, got {v!r}")
    if v < minimum:
        what = {"input_length": "empty prompt", "output_length": "no output"}.get(key, "too small")
        raise TraceError(f"{at}: {what}: '{key}' must be >= {minimum}, got {int(v)}")
    return int(v)


def load_mooncake_jsonl(
    path: str | Path, seed: int = 0, tick_s: float = MOONCAKE_TICK_S, jitter: bool | str = "auto"
) -> Trace:
    """A Mooncake FAST'25 JSONL trace.

    ``jitter``: True spreads each request over its tick (:func:`jitter_ticks`, seeded by
    ``seed``); False keeps the stamps; "auto" (default) jitters when the stamps are
    quantised to ``tick_s`` (:func:`is_quantised`: true of the real conversation trace,
    false of the synthetic one, whose Poisson stamps are kept).
    """
    p = Path(path)
    text = _read_text(p)
    stamps: list[float] = []
    fields: list[tuple[str, int, int, tuple[int, ...] | None]] = []
    for index, (lineno, obj) in enumerate(_mooncake_rows(p, text)):
        at = f"{p}: line {lineno}"
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
        if missing:
            raise TraceError(f"{at}: missing field(s) {', '.join(missing)}")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise TraceError(f"{at}: 'timestamp' must be a number of milliseconds, got {ts!r}")
        if ts < 0:
            raise TraceError(f"{at}: 'timestamp' must be >= 0, got {ts!r}")
        prompt = _mc_int(obj, "input_length", at, 1)
        output = _mc_int(obj, "output_length", at, 1)
        hashes = obj.get("hash_ids")
        if hashes is not None:
            if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
                raise TraceError(f"{at}: 'hash_ids' must be a list of integers")
            hashes = tuple(hashes)
        stamps.append(float(ts))
        fields.append((str(index), prompt, output, hashes))
    if not fields:
        raise TraceError(f"{p}: no requests")
    if jitter not in (True, False, "auto"):
        raise TraceError(f"jitter must be True, False or 'auto', got {jitter!r}")
    do_jitter = is_quantised(stamps, tick_s) if jitter == "auto" else bool(jitter)
    times = jitter_ticks(stamps, tick_s, seed) if do_jitter else [t / 1000.0 for t in stamps]
    reqs = _rebase([Request(rid, t, pr, out, h) for (rid, pr, out, h), t in zip(fields, times)])
    how = f"arrivals jittered within {tick_s:g} s ticks (seed {seed})" if do_jitter else "arrivals as stamped"
    desc = (
        f"Mooncake FAST'25 trace ({p.stem}): {len(reqs)} requests, {how} (Apache-2.0; Qin et al., Mooncake, FAST '25)"
    )
    return _trace(p.stem, desc, reqs, p.name)


# ---------------------------------------------------------------------------------------
# dispatch


def bundled_names() -> list[str]:
    """Bare names of the traces shipped in traces/data (without extension)."""
    if not DATA_DIR.is_dir():
        return []
    return sorted(p.stem for p in DATA_DIR.iterdir() if p.suffix in EXTENSIONS and p.is_file())


def resolve(spec: str | Path) -> Path:
    """A path as given, else a bundled trace by bare name, with or without extension."""
    spec = str(spec)
    if not spec.strip():
        raise TraceError("trace name is empty")
    p = Path(spec)
    if p.is_file():
        return p
    if "/" not in spec and "\\" not in spec and not p.exists():
        for cand in (DATA_DIR / spec, *(DATA_DIR / f"{spec}{ext}" for ext in EXTENSIONS)):
            if cand.suffix in EXTENSIONS and cand.is_file():
                return cand
    if p.is_dir():
        raise TraceError(f"{spec}: is a directory, not a trace file")
    if p.exists():
        raise TraceError(f"{spec}: not a regular file")
    names = ", ".join(bundled_names()) or "none"
    raise TraceError(
        f"trace not found: {spec} (not a file, nor a bundled trace: {names}; "
        f"nor a dataset: {', '.join(n + ':key=value,...' for n in datasets.NAMES)})"
    )


def _is_dataset(spec: str | Path) -> bool:
    """A dataset spec that no file claims: ``random``, ``random:...``, ``sonnet:...``
    (a bare ``sonnet`` is the bundled sonnet.json; a local file of the spec's name wins)."""
    text = str(spec).strip()
    if datasets.dataset_name(text) is None or Path(text).exists():
        return False
    return ":" in text or not any((DATA_DIR / f"{text}{ext}").is_file() for ext in EXTENSIONS)


def load(spec: str | Path, seed: int = 0, tokenizer: Any = None, recount: bool = False, **options: Any) -> Trace:
    """Load a trace file, a bundled trace by bare name (dispatching on the extension), or
    build a dataset (``random:...``, ``sonnet:...``; see :mod:`traces.datasets`).

    ``seed`` drives any randomness of the loader (Mooncake tick jitter, datasets);
    ``options`` go to the format's loader (``drop_invalid`` for CSV; ``tick_s``, ``jitter``
    for JSONL). ``tokenizer`` (see :class:`traces.text.Tokenizer`) counts the prompt tokens
    of requests given as text without a count (with ``recount``, of every request with
    text) and builds sonnet prompts. The trace returned has every ``prompt_tokens``: a
    request with text and no count, and no tokenizer, is a TraceError saying how to count.
    Every problem is a one-line TraceError.
    """
    try:
        if _is_dataset(spec):
            if options:
                raise TraceError(f"{spec}: option(s) {', '.join(sorted(options))} do not apply to datasets")
            return require_counts(datasets.from_spec(str(spec), seed=seed, tokenizer=tokenizer))
        trace = _load_file(spec, seed, options)
        if tokenizer is not None:
            trace = tokenize(trace, tokenizer, recount=recount)
        return require_counts(trace)
    except TraceError as exc:
        raise TraceError(_one_line(str(exc))) from None
    except (OSError, RecursionError, MemoryError) as exc:  # e.g. a file that vanished mid-read
        raise TraceError(_one_line(f"cannot read trace {spec}: {exc}")) from None


def _load_file(spec: str | Path, seed: int, options: dict[str, Any]) -> Trace:
    path = resolve(spec)
    ext = path.suffix.lower()
    if ext == ".json":
        loader, allowed = (lambda: load_json(path)), set()
    elif ext == ".csv":
        loader, allowed = (lambda: load_azure_csv(path, **options)), {"drop_invalid"}
    elif ext == ".jsonl":
        loader, allowed = (lambda: load_mooncake_jsonl(path, seed=seed, **options)), {"tick_s", "jitter"}
    else:
        raise TraceError(
            f"{path}: unknown trace format {ext or '(no extension)'!r}: "
            f"expected .json, .csv (Azure 2023) or .jsonl (Mooncake)"
        )
    bad = sorted(set(options) - allowed)
    if bad:
        raise TraceError(f"{path}: option(s) {', '.join(bad)} do not apply to {ext} traces")
    return loader()


def _one_line(msg: str) -> str:
    return " ".join(msg.split())
