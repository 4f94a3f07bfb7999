"""Run directories: summary.json, requests.csv, steps.parquet, tokens.parquet, passes.parquet, meta.json.

- requests.csv: one row per request (times, TTFT/TPOT/E2E, status; then preemptions, KV tokens
  recomputed after them, prompt tokens found in the prefix cache at first admission, and when
  its client issued it: ``scheduled_s``, which is ``arrival_s`` unless closed-loop clients
  held it back);
- steps.parquet: one row per scheduler step (start, end, predicted and measured seconds, rows);
- tokens.parquet: one row per output token (``request_id, token_index, time_s``);
- passes.parquet: one row per request per pass (``step, pass, request_id, kind, tokens,
  start_s, end_s``; kind ``decode`` or ``prefill``): what every forward held, for timelines.

The per-step and per-event tables are Parquet (pyarrow; ``pandas.read_parquet`` reads them): an hour of
Azure traffic is millions of rows, ~350 MB as CSV and minutes to write, ~10x smaller and
written in a fraction of a second as columns. Request ids are dictionary-encoded.

Everything but meta.json (wall time, versions, command) is a pure function of the inputs,
so the same trace, policy, profile and seed give identical files.
"""

from __future__ import annotations

import csv
import json
import platform
import sys
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .metrics import request_rows

REQUEST_COLUMNS = (
    "id", "arrival_s", "prompt_tokens", "output_tokens", "first_token_s", "finish_s",
    "ttft_ms", "tpot_ms", "e2e_ms", "decode_rate_tok_s", "status",
    "preemptions", "recomputed_tokens", "cached_tokens", "scheduled_s",
)
_TIMES = REQUEST_COLUMNS[:REQUEST_COLUMNS.index("status")]
_KV = REQUEST_COLUMNS[REQUEST_COLUMNS.index("status") + 1:]
STEP_COLUMNS = (
    "step", "start_s", "end_s", "predicted_s", "measured_s", "decode_rows", "prefill_tokens",
    "passes", "kv_tokens",
)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return str(v)


def write_run(out: str | Path, result, summary: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stable = {k: v for k, v in summary.items() if k not in ("wall_s", "meta")}
    (out / "summary.json").write_text(json.dumps(stable, indent=2) + "\n")

    scheduled = getattr(result, "scheduled_s", None) or {}
    rows = {row["id"]: row for row in request_rows(result.requests, scheduled)}
    rejected = {r.id for r, _ in result.rejected}
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(REQUEST_COLUMNS)
        for r in result.requests:
            row = rows.get(r.id)
            if row is not None:
                w.writerow([_cell(row[c]) for c in _TIMES] + ["finished"] + [_cell(row[c]) for c in _KV])
            else:
                status = "rejected" if r.id in rejected else "unfinished"
                w.writerow([r.id, _cell(r.arrival_s), r.prompt_tokens, r.output_tokens]
                           + [""] * 6 + [status, r.preemptions, r.recomputed_tokens, r.cached_tokens,
                                         _cell(scheduled.get(r.id, r.arrival_s))])

    write_steps(out / "steps.parquet", result.steps.columns)
    write_tokens(out / "tokens.parquet", result.requests)
    write_passes(out / "passes.parquet", result.requests, result.passes)

    info = {
        "wall_s": result.wall_s,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "argv": sys.argv,
        **(result.meta or {}),
        **(meta or {}),
    }
    (out / "meta.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    return out


def write_steps(path: Path, cols) -> None:
    """steps.parquet from the step log's columns; measured_s is null in a simulation."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(cols[0])
    types = (np.int64, np.float64, np.float64, np.float64, None, np.int32, np.int64, np.int16, np.int64)
    data = {}
    for name, col, dt in zip(STEP_COLUMNS, cols, types):
        if dt is None:  # measured_s: None in a simulation
            data[name] = (pa.array(col, type=pa.float64()) if any(v is not None for v in col)
                          else pa.nulls(n, pa.float64()))
        else:
            data[name] = np.fromiter(col, dtype=dt, count=n)
    pq.write_table(pa.table(data), path, compression="zstd")


def _ids(requests):
    import pyarrow as pa

    return pa.array([r.id for r in requests], type=pa.string())


def write_tokens(path: Path, requests) -> None:
    """tokens.parquet from every request's token times, built as columns (no per-row Python)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    counts = np.fromiter(map(len, map(_TOKEN_TIMES, requests)), dtype=np.int64, count=len(requests))
    total = int(counts.sum())
    times = np.fromiter(chain.from_iterable(map(_TOKEN_TIMES, requests)), dtype=np.float64, count=total)
    owner = np.repeat(np.arange(len(requests), dtype=np.int32), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    index = (np.arange(total, dtype=np.int64) - starts).astype(np.int32)
    table = pa.table({
        "request_id": pa.DictionaryArray.from_arrays(pa.array(owner), _ids(requests)),
        "token_index": index,
        "time_s": times,
    })
    pq.write_table(table, path, compression="zstd")


def write_passes(path: Path, requests, passes) -> None:
    """passes.parquet: per pass, its decode rows then its prefill chunks, as columns.

    A ``Plan.repeat`` run logs the same Pass object many times in a row: its rows are looked
    up once per run of identical passes and repeated with numpy."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pos = {r.id: i for i, r in enumerate(requests)}
    step_col, k_col, start_col, end_col, pass_col = passes.columns
    n = len(pass_col)
    # runs of the same Pass object: (pass, first index, count)
    runs: list[list] = []
    prev = None
    for p in pass_col:
        if p is prev:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
            prev = p
    owner_parts, kind_parts, tokens_parts, which_parts = [], [], [], []
    first = 0
    for p, count in runs:
        ids = [rid for rid in p.decode] + [rid for rid, _ in p.prefill]
        width = len(ids)
        if width:
            owner_parts.append(np.tile(np.fromiter(map(pos.__getitem__, ids), np.int32, width), count))
            kind_parts.append(np.tile(np.repeat(np.array([0, 1], np.int8), (len(p.decode), len(p.prefill))), count))
            tokens_parts.append(np.tile(np.array([1] * len(p.decode) + [t for _, t in p.prefill], np.int32), count))
            which_parts.append(np.repeat(np.arange(first, first + count), width))
        first += count

    def cat(parts, dtype):
        return np.concatenate(parts) if parts else np.empty(0, dtype)

    which = cat(which_parts, np.int64)
    cols = [np.fromiter(c, dtype=dt, count=n)[which]
            for c, dt in ((step_col, np.int64), (k_col, np.int32), (start_col, np.float64), (end_col, np.float64))]
    table = pa.table({
        "step": cols[0],
        "pass": cols[1],
        "request_id": pa.DictionaryArray.from_arrays(pa.array(cat(owner_parts, np.int32)), _ids(requests)),
        "kind": pa.DictionaryArray.from_arrays(pa.array(cat(kind_parts, np.int8)), pa.array(["decode", "prefill"])),
        "tokens": cat(tokens_parts, np.int32),
        "start_s": cols[2],
        "end_s": cols[3],
    })
    pq.write_table(table, path, compression="zstd")


_TOKEN_TIMES = attrgetter("token_times")
