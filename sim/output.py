"""Run directories: summary.json, requests.csv, steps.parquet, tokens.parquet, [passes.parquet,] [features.parquet,] meta.json.

- requests.csv: one row per request (times, TTFT/TPOT/E2E, status; then preemptions, KV tokens
  recomputed after them, prompt tokens found in the prefix cache at first admission, and when
  its client issued it: ``scheduled_s``, which is ``arrival_s`` unless closed-loop clients
  held it back);
- steps.parquet: one row per scheduler step (start, end, predicted and measured seconds, rows);
- tokens.parquet: one row per output token (``request_id, token_index, time_s``);
- passes.parquet (``passes=True``; ``simulate --passes``, every real run): one row per request
  per pass (``step, pass, request_id, kind, tokens, start_s, end_s``; kind ``decode`` or
  ``prefill``): what every forward held, for exact timelines. For an hour of traffic it is the
  largest table (~4 M rows) and the slowest to make (about a fifth of a simulate command), and
  nothing but a timeline needs it (``plot`` draws one from tokens.parquet without it), so a
  simulation writes it only when asked;
- features.parquet (real runs only): one row per measured step with its pass shapes' cost
  features, idle gap and batch changes (``sim.features``): what ``calibrate --from-runs`` fits.

The per-step and per-event tables are Parquet (pyarrow; ``pandas.read_parquet`` reads them): an hour of
Azure traffic is millions of rows, ~350 MB as CSV and minutes to write, ~10x smaller and
written in a fraction of a second as columns. Request ids are dictionary-encoded.

Everything but meta.json (wall time, versions, command) is a pure function of the inputs,
so the same trace, policy, profile and seed give identical files.
"""

from __future__ import annotations

import json
import platform
import sys
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .gcpause import gc_paused
from .features import step_table, write_features
from .metrics import REQUEST_COLUMNS, request_columns, request_table, token_times_flat

# requests.csv's integer columns (the rest but id and status are floats, empty where None)
_INT_COLUMNS = ("prompt_tokens", "output_tokens", "preemptions", "recomputed_tokens", "cached_tokens", "replica")
STEP_COLUMNS = (
    "step",
    "start_s",
    "end_s",
    "predicted_s",
    "measured_s",
    "decode_rows",
    "prefill_tokens",
    "passes",
    "kv_tokens",
)


@gc_paused()  # millions of rows are made here, almost no cycles
def write_run(
    out: str | Path,
    result,
    summary: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    meta: Mapping[str, Any] | None = None,
    *,
    passes: bool = True,
) -> Path:
    """Write the run directory. ``summary``: summary.json's content, or what computes it (asked
    for once the large tables are being written: the two go on at once)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not passes:  # an earlier run's timeline must not pass for this one's
        (out / "passes.parquet").unlink(missing_ok=True)

    # pyarrow writes (and compresses) without the GIL, as numpy computes most of the summary:
    # each table is made and written in the background while the next one, the summary and
    # requests.csv are made
    token_times_flat(result)  # (made once, here: the summary's ITLs read them as well)
    with ThreadPoolExecutor(max_workers=2) as pool:
        writes = [
            pool.submit(_write_table, tokens_table, out / "tokens.parquet", result),
            pool.submit(_write_table, steps_table, out / "steps.parquet", result.steps),
        ]
        if passes:
            writes.append(
                pool.submit(_write_table, passes_table, out / "passes.parquet", result.requests, result.passes)
            )
        if callable(summary):
            summary = summary()
        stable = {k: v for k, v in summary.items() if k not in ("wall_s", "meta")}
        (out / "summary.json").write_text(json.dumps(stable, indent=2) + "\n")
        _write_requests(out / "requests.csv", request_table(result), request_columns(result))
        for job in writes:
            job.result()
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


def _write_requests(path: Path, rows: list[tuple], columns: tuple[str, ...] = REQUEST_COLUMNS) -> None:
    """requests.csv from ``request_table``'s rows (``columns``: ``request_columns``), as columns
    through pyarrow's CSV writer (a few times faster than the csv module's float formatting):
    None is an empty cell, strings are quoted, floats are written in their shortest exact form."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    n = len(rows)
    arrays = []
    for name, col in zip(columns, zip(*rows) if rows else [()] * len(columns)):
        if name in ("id", "status"):
            arrays.append(_strings([str(v) for v in col]))
        elif name in _INT_COLUMNS:
            arrays.append(_arrow(np.array(col, dtype=np.int64)))
        else:
            a = np.array(col, dtype=np.float64)  # (None becomes NaN: null below)
            valid = np.packbits(~np.isnan(a), bitorder="little")
            arrays.append(pa.Array.from_buffers(pa.float64(), n, [pa.py_buffer(valid), pa.py_buffer(a)]))
    pacsv.write_csv(pa.Table.from_arrays(arrays, names=list(columns)), path)


def requests_frame(result):
    """requests.csv as a pandas DataFrame, typed as ``read_requests_csv`` reads the file back."""
    import pandas as pd

    df = pd.DataFrame(request_table(result), columns=list(request_columns(result)))
    df["id"] = df["id"].astype(str)
    for c in _INT_COLUMNS:
        if c in df:  # (replica: a cluster's only)
            df[c] = df[c].astype(np.int64)
    for c in REQUEST_COLUMNS[1:]:
        if c not in _INT_COLUMNS and c != "status":
            df[c] = pd.to_numeric(df[c], errors="raise").astype(np.float64)
    df["status"] = df["status"].astype(str)
    return df


def read_requests_csv(path):
    """requests.csv read back: ids and status as strings, empty cells as NaN."""
    import pandas as pd

    return pd.read_csv(path, dtype={"id": str, "status": str}, keep_default_na=False, na_values=[""])


def steps_table(log):
    """steps.parquet's table (pyarrow) from the step log (``StepLog``); measured_s is null in a
    simulation."""
    import pyarrow as pa

    cols = log.arrays()
    n = len(cols[0])
    data = []
    for c in cols:
        if isinstance(c, list):  # measured_s: None in a simulation
            data.append(pa.array(c, type=pa.float64()) if c.count(None) != n else pa.nulls(n, pa.float64()))
        else:
            data.append(_arrow(c))
    names = list(STEP_COLUMNS)
    replica = getattr(log, "replica", None)  # a cluster's steps: each one's replica
    if replica is not None:
        data.append(_arrow(replica))
        names.append("replica")
    return pa.Table.from_arrays(data, names=names)


def _arrow(a: np.ndarray):
    """A numeric numpy column as an Arrow array over the same memory. (``pa.array`` would do
    as well but imports pandas, a quarter of a second a simulate command does not need.)"""
    import pyarrow as pa

    a = np.ascontiguousarray(a)
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), len(a), [None, pa.py_buffer(a)])


def _strings(values: list[str]):
    """Python strings as an Arrow string array (without ``pa.array``: see ``_arrow``)."""
    import pyarrow as pa

    data = [v.encode() for v in values]
    offsets = np.zeros(len(data) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, data), dtype=np.int32, count=len(data)), out=offsets[1:])
    return pa.Array.from_buffers(pa.string(), len(data), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))])


def _dictionary(codes: np.ndarray, values: list[str]):
    """A dictionary-encoded string column: ``codes`` index ``values``."""
    import pyarrow as pa

    return pa.DictionaryArray.from_arrays(_arrow(codes), _strings(values))


def _write_table(make, path: Path, *args) -> None:
    """The table ``make(*args)`` as Parquet, written for speed: zstd at its fastest level (~8x
    smaller than CSV), dictionary encoding only where the column already is one (request ids,
    kinds), no statistics (nothing filters these files by row group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = make(*args)
    dicts = [f.name for f in table.schema if pa.types.is_dictionary(f.type)]
    pq.write_table(
        table, path, compression="zstd", compression_level=1, use_dictionary=dicts or False, write_statistics=False
    )


def tokens_table(result):
    """tokens.parquet's table from every request's token times (``result.requests``), built as
    columns (no per-row Python)."""
    import pyarrow as pa

    requests = result.requests
    counts, times = token_times_flat(result)
    total = times.size
    owner = np.repeat(np.arange(len(requests), dtype=np.int32), counts)
    # each token's index within its request: a running sum of ones that drops back to 0 at
    # every request's first token (int32 throughout: no 64-bit arrays of millions)
    index = np.ones(total, dtype=np.int32)
    if total:
        sizes = counts[counts > 0]
        firsts = np.cumsum(sizes) - sizes
        index[firsts[1:]] = 1 - sizes[:-1]
        index[0] = 0
        np.cumsum(index, dtype=np.int32, out=index)
    return pa.Table.from_arrays(
        [_dictionary(owner, _ids(requests)), _arrow(index), _arrow(times)],
        names=["request_id", "token_index", "time_s"],
    )


def passes_table(requests, passes):
    """passes.parquet's table: per pass, its decode rows then its prefill chunks, as columns.

    A ``Plan.repeat`` run logs the same Pass object many times in a row: the rows of each
    distinct pass are built once (a template) and every logged pass indexes into them."""
    import pyarrow as pa

    pos = {r.id: i for i, r in enumerate(requests)}
    step_col, k_col, start_col, end_col, pass_col = passes.columns
    n = len(pass_col)
    # runs of the same Pass object (the log holds them all, so ids are distinct while it lives)
    ident = np.fromiter(map(id, pass_col), dtype=np.int64, count=n)
    starts_run = np.concatenate(([True], ident[1:] != ident[:-1])) if n else np.zeros(0, bool)
    distinct = [pass_col[i] for i in np.flatnonzero(starts_run).tolist()]
    run_of = np.cumsum(starts_run) - 1  # each logged pass's index in ``distinct``
    nd = np.fromiter((len(p.decode) for p in distinct), dtype=np.int64, count=len(distinct))
    npf = np.fromiter((len(p.prefill) for p in distinct), dtype=np.int64, count=len(distinct))
    # templates: every distinct pass's decode rows then its prefill rows
    width = nd + npf
    size = int(width.sum())
    owner_t = np.fromiter(
        chain.from_iterable(
            chain(map(pos.__getitem__, p.decode), map(pos.__getitem__, map(_FIRST, p.prefill))) for p in distinct
        ),
        dtype=np.int32,
        count=size,
    )
    kind_t = np.repeat(np.tile(np.array([0, 1], dtype=np.int8), len(distinct)), np.stack((nd, npf), axis=1).reshape(-1))
    tokens_t = np.ones(size, dtype=np.int32)
    tokens_t[kind_t == 1] = np.fromiter(
        chain.from_iterable(map(_prefill_tokens, distinct)), dtype=np.int32, count=int(npf.sum())
    )
    offset = np.cumsum(width) - width
    # every logged pass's rows: its template's, in order
    widths = width[run_of]
    row_start = np.cumsum(widths) - widths
    index = np.repeat(offset[run_of] - row_start, widths)
    index += np.arange(len(index))
    cols = [
        np.repeat(np.fromiter(c, dtype=dt, count=n), widths)
        for c, dt in ((step_col, np.int64), (k_col, np.int32), (start_col, np.float64), (end_col, np.float64))
    ]
    data = [
        _arrow(cols[0]),
        _arrow(cols[1]),
        _dictionary(owner_t[index], _ids(requests)),
        _dictionary(kind_t[index], ["decode", "prefill"]),
        _arrow(tokens_t[index]),
        _arrow(cols[2]),
        _arrow(cols[3]),
    ]
    names = ["step", "pass", "request_id", "kind", "tokens", "start_s", "end_s"]
    replica = getattr(passes, "replica", None)  # a cluster's passes: each one's replica
    if replica is not None:
        data.append(_arrow(np.repeat(replica, widths)))
        names.append("replica")
    return pa.Table.from_arrays(data, names=names)


def _ids(requests) -> list[str]:
    return [r.id for r in requests]


def _prefill_tokens(p) -> list[int]:
    return [t for _, t in p.prefill]


_FIRST = itemgetter(0)
