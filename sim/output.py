"""Run directories: summary.json, requests.csv, steps.parquet, tokens.parquet, passes.parquet, [features.parquet,] meta.json.

- requests.csv: one row per request (times, TTFT/TPOT/E2E, status; then preemptions, KV tokens
  recomputed after them, prompt tokens found in the prefix cache at first admission, and when
  its client issued it: ``scheduled_s``, which is ``arrival_s`` unless closed-loop clients
  held it back);
- steps.parquet: one row per scheduler step (start, end, predicted and measured seconds, rows);
- tokens.parquet: one row per output token (``request_id, token_index, time_s``);
- passes.parquet: one row per request per pass (``step, pass, request_id, kind, tokens,
  start_s, end_s``; kind ``decode`` or ``prefill``): what every forward held, for timelines;
- features.parquet (real runs only): one row per measured step with its pass shapes' cost
  features, idle gap and batch changes (``sim.features``): what ``calibrate --from-runs`` fits.

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

from .features import step_table, write_features
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

    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(REQUEST_COLUMNS)
        for row in request_table(result):
            w.writerow([_cell(v) for v in row])

    write_steps(out / "steps.parquet", result.steps.columns)
    write_tokens(out / "tokens.parquet", result.requests)
    write_passes(out / "passes.parquet", result.requests, result.passes)
    feats = step_table(result)  # real runs only: what a fit of the cost model needs
    if feats is not None:
        write_features(out / "features.parquet", feats)

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


def request_table(result) -> list[tuple]:
    """requests.csv's rows (``REQUEST_COLUMNS``), in the run's request order; None where the
    file has an empty cell (an unfinished or rejected request, a one-token output's TPOT)."""
    scheduled = getattr(result, "scheduled_s", None) or {}
    rows = {row["id"]: row for row in request_rows(result.requests, scheduled)}
    rejected = {r.id for r, _ in result.rejected}
    out = []
    for r in result.requests:
        row = rows.get(r.id)
        if row is not None:
            out.append(tuple(row[c] for c in _TIMES) + ("finished",) + tuple(row[c] for c in _KV))
        else:
            status = "rejected" if r.id in rejected else "unfinished"
            out.append((r.id, r.arrival_s, r.prompt_tokens, r.output_tokens) + (None,) * 6
                       + (status, r.preemptions, r.recomputed_tokens, r.cached_tokens,
                          scheduled.get(r.id, r.arrival_s)))
    return out


def requests_frame(result):
    """requests.csv as a pandas DataFrame, typed as ``read_requests_csv`` reads the file back."""
    import pandas as pd

    df = pd.DataFrame(request_table(result), columns=list(REQUEST_COLUMNS))
    df["id"] = df["id"].astype(str)
    ints = ("prompt_tokens", "output_tokens", "preemptions", "recomputed_tokens", "cached_tokens")
    for c in ints:
        df[c] = df[c].astype(np.int64)
    for c in REQUEST_COLUMNS[1:]:
        if c not in ints and c != "status":
            df[c] = pd.to_numeric(df[c], errors="raise").astype(np.float64)
    df["status"] = df["status"].astype(str)
    return df


def read_requests_csv(path):
    """requests.csv read back: ids and status as strings, empty cells as NaN."""
    import pandas as pd

    return pd.read_csv(path, dtype={"id": str, "status": str}, keep_default_na=False, na_values=[""])


def steps_table(cols):
    """steps.parquet's table (pyarrow) from the step log's columns; measured_s is null in a
    simulation."""
    import pyarrow as pa

    n = len(cols[0])
    types = (np.int64, np.float64, np.float64, np.float64, None, np.int32, np.int64, np.int16, np.int64)
    data = {}
    for name, col, dt in zip(STEP_COLUMNS, cols, types):
        if dt is None:  # measured_s: None in a simulation
            data[name] = (pa.array(col, type=pa.float64()) if any(v is not None for v in col)
                          else pa.nulls(n, pa.float64()))
        else:
            data[name] = np.fromiter(col, dtype=dt, count=n)
    return pa.table(data)


def write_steps(path: Path, cols) -> None:
    """steps.parquet from the step log's columns."""
    import pyarrow.parquet as pq

    pq.write_table(steps_table(cols), path, compression="zstd")


def _ids(requests):
    import pyarrow as pa

    return pa.array([r.id for r in requests], type=pa.string())


def write_tokens(path: Path, requests) -> None:
    """tokens.parquet from every request's token times."""
    import pyarrow.parquet as pq

    pq.write_table(tokens_table(requests), path, compression="zstd")


def tokens_table(requests):
    """tokens.parquet's table from every request's token times, built as columns (no per-row
    Python)."""
    import pyarrow as pa

    counts = np.fromiter(map(len, map(_TOKEN_TIMES, requests)), dtype=np.int64, count=len(requests))
    total = int(counts.sum())
    times = np.fromiter(chain.from_iterable(map(_TOKEN_TIMES, requests)), dtype=np.float64, count=total)
    owner = np.repeat(np.arange(len(requests), dtype=np.int32), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    index = (np.arange(total, dtype=np.int64) - starts).astype(np.int32)
    return pa.table({
        "request_id": pa.DictionaryArray.from_arrays(pa.array(owner), _ids(requests)),
        "token_index": index,
        "time_s": times,
    })


def write_passes(path: Path, requests, passes) -> None:
    """passes.parquet: per pass, its decode rows then its prefill chunks."""
    import pyarrow.parquet as pq

    pq.write_table(passes_table(requests, passes), path, compression="zstd")


def passes_table(requests, passes):
    """passes.parquet's table: per pass, its decode rows then its prefill chunks, as columns.

    A ``Plan.repeat`` run logs the same Pass object many times in a row: its rows are looked
    up once per run of identical passes and repeated."""
    import pyarrow as pa

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
    owners: list[int] = []
    kinds: list[int] = []
    tokens: list[int] = []
    widths: list[int] = []
    for p, count in runs:  # list repetition is C speed, whatever the run length
        nd = len(p.decode)
        owners += (list(map(pos.__getitem__, p.decode)) + [pos[rid] for rid, _ in p.prefill]) * count
        kinds += ([0] * nd + [1] * len(p.prefill)) * count
        tokens += ([1] * nd + [t for _, t in p.prefill]) * count
        widths += [nd + len(p.prefill)] * count
    which = np.repeat(np.arange(n), np.array(widths, dtype=np.int64))
    cols = [np.fromiter(c, dtype=dt, count=n)[which]
            for c, dt in ((step_col, np.int64), (k_col, np.int32), (start_col, np.float64), (end_col, np.float64))]
    return pa.table({
        "step": cols[0],
        "pass": cols[1],
        "request_id": pa.DictionaryArray.from_arrays(pa.array(np.array(owners, dtype=np.int32)), _ids(requests)),
        "kind": pa.DictionaryArray.from_arrays(pa.array(np.array(kinds, dtype=np.int8)), pa.array(["decode", "prefill"])),
        "tokens": np.array(tokens, dtype=np.int32),
        "start_s": cols[2],
        "end_s": cols[3],
    })


_TOKEN_TIMES = attrgetter("token_times")
