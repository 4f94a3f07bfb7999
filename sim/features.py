"""What a fit of the cost model needs from a real run: one row per measured step.

``step_table(result)`` turns a real run's logs (steps, passes with their ``PassShape``, the
wakes of the idle replica) into columns: the step's measured and predicted seconds, the
passes' own time and the rest of the step (planning, state updates, SimPy hops), how long the
replica sat idle before it, whether the batch changed, the raw shape of its passes, and every
cost term's feature summed over its passes (``pass_features``: the cost model's own
prediction with one coefficient at 1, so that the coefficients a fit finds predict these
steps as ``simulate`` would). ``write_run`` writes it as ``features.parquet`` beside
``steps.parquet`` when the run measured its steps; a simulation has none.

Columns:

==================  ==================================================================
step                the step's index (as in steps.parquet)
start_s, end_s      when it started and ended (wall clock, run time)
measured_s          end - start: what the cost model should predict
predicted_s         the run's cost model's prediction (as in steps.parquet)
passes_s            the passes' own wall time (execute), summed
overhead_s          measured_s - passes_s: planning, state updates, the loop's hops
after_idle          1 when the replica waited for an arrival right before this step
idle_before_s       how long it waited (0 for steps run back to back)
wake_s              from the arrival that woke it to the step's start (0 back to back)
batch_changed       1 when rows join or leave the decode batch in this step
after_change        1 when the previous step changed the batch
passes, decode_rows, decode_ctx (longest), joins, leaves, batch_rows_before,
prefill_chunks, prefill_tokens, prefill_ctx (sum), done_chunks, padded (passes)
<term>              every cost term's feature (sim.cost.FEATURES but i_wake), summed
==================  ==================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .cost import (
    FEATURES,
    SHAPE_TERMS,
    after_wake_features,
    idle_features,
    pass_features,
    shape_features,
    step_features,
)

STEP_TERMS = tuple(k for k in FEATURES if k != "i_wake")  # i_wake is charged before the step
RAW = (
    "passes",
    "decode_rows",
    "decode_ctx",
    "joins",
    "leaves",
    "batch_rows_before",
    "prefill_chunks",
    "prefill_tokens",
    "prefill_ctx",
    "done_chunks",
    "padded",
)
COLUMNS = (
    (
        "step",
        "start_s",
        "end_s",
        "measured_s",
        "predicted_s",
        "passes_s",
        "overhead_s",
        "after_idle",
        "idle_before_s",
        "wake_s",
        "batch_changed",
        "after_change",
    )
    + RAW
    + STEP_TERMS
)


def step_table(result: Any) -> dict[str, np.ndarray] | None:
    """The features table of a real run (None when the run kept no pass shapes)."""
    shapes = result.shapes
    if not shapes:
        return None
    p_step, _, p_start, p_end, _ = result.passes.columns
    if len(shapes) != len(p_step):
        raise ValueError(f"{len(shapes)} pass shapes for {len(p_step)} logged passes")
    s_index, s_start, s_end, s_pred, s_meas = result.steps.columns[:5]
    keep = [i for i, m in enumerate(s_meas) if m is not None]
    pos = {s_index[i]: j for j, i in enumerate(keep)}
    n = len(keep)
    cols: dict[str, np.ndarray] = {k: np.zeros(n) for k in COLUMNS}
    cols["step"] = np.array([s_index[i] for i in keep], dtype=np.int64)
    cols["start_s"] = np.array([s_start[i] for i in keep], dtype=float)
    cols["end_s"] = np.array([s_end[i] for i in keep], dtype=float)
    cols["measured_s"] = np.array([s_meas[i] for i in keep], dtype=float)
    cols["predicted_s"] = np.array([s_pred[i] for i in keep], dtype=float)
    cache: dict = {}
    for st, t0, t1, shape in zip(p_step, p_start, p_end, shapes):
        j = pos.get(st)
        if j is None:
            continue
        f = cache.get(shape)
        if f is None:
            f = cache[shape] = [(k, v) for k, v in pass_features(shape).items() if v]
        for k, v in f:
            cols[k][j] += v
        cols["passes_s"][j] += t1 - t0
        cols["passes"][j] += 1
        rows = len(shape.decode_contexts)
        cols["decode_rows"][j] += rows
        if rows:
            cols["decode_ctx"][j] = max(cols["decode_ctx"][j], max(shape.decode_contexts))
            cols["joins"][j] += shape.joins
            cols["leaves"][j] += shape.leaves
            cols["batch_rows_before"][j] = max(cols["batch_rows_before"][j], shape.batch_rows_before)
        if shape.prefill:
            cols["prefill_chunks"][j] += len(shape.prefill)
            cols["prefill_tokens"][j] += shape.prefill_tokens
            cols["prefill_ctx"][j] += sum(b for _, b in shape.prefill)
            cols["done_chunks"][j] += sum(1 for d in shape.prefill_done if d)
            cols["padded"][j] += 1 if shape.padded else 0
    for j in range(n):
        rows = int(cols["decode_rows"][j] + cols["prefill_chunks"][j])
        for k, v in step_features(int(cols["passes"][j]), rows).items():
            cols[k][j] = v
    wakes = getattr(result, "wakes", None) or {}
    for st, (idle_s, wake_s) in wakes.items():
        j = pos.get(st)
        if j is None:
            continue
        cols["after_idle"][j] = 1.0
        cols["idle_before_s"][j] = idle_s
        cols["wake_s"][j] = wake_s
        for k, v in idle_features(idle_s).items():
            cols[k][j] = v
    cols["i_after"] = after_wake_column(cols["after_idle"])
    cols["overhead_s"] = cols["measured_s"] - cols["passes_s"]
    cols["batch_changed"] = ((cols["joins"] + cols["leaves"]) > 0).astype(float)
    cols["after_change"][1:] = cols["batch_changed"][:-1]
    return cols


def steps_since_wake(after_idle: np.ndarray) -> np.ndarray:
    """Per step, how many steps after the last wake it ran (0: the wake's own step; -1: before
    any wake): the loop's own count (every step of a real run is measured, so steps are
    consecutive)."""
    out = np.full(len(after_idle), -1, dtype=np.int64)
    k = -1
    for j, woke in enumerate(after_idle):
        k = 0 if woke else (k + 1 if k >= 0 else -1)
        out[j] = k
    return out


def after_wake_column(after_idle: np.ndarray) -> np.ndarray:
    """``i_after``'s feature per step, from which steps followed a wait."""
    return np.array([after_wake_features(int(k))["i_after"] if k > 0 else 0.0 for k in steps_since_wake(after_idle)])


def write_features(path: Path, cols: dict[str, np.ndarray]) -> None:
    import pyarrow.parquet as pq

    pq.write_table(features_table(cols), path, compression="zstd")


def features_table(cols: dict[str, np.ndarray]):
    """features.parquet's table (pyarrow): counts as integers, the rest as floats."""
    import pyarrow as pa

    ints = {
        "step",
        "passes",
        "decode_rows",
        "decode_ctx",
        "joins",
        "leaves",
        "batch_rows_before",
        "prefill_chunks",
        "prefill_tokens",
        "prefill_ctx",
        "done_chunks",
        "padded",
        "after_idle",
        "batch_changed",
        "after_change",
    }
    return pa.table({k: (cols[k].astype(np.int64) if k in ints else cols[k].astype(np.float64)) for k in COLUMNS})


def read_features(path: str | Path) -> dict[str, np.ndarray]:
    """features.parquet (a file, or a run directory holding one) as numpy columns."""
    import pyarrow.parquet as pq

    p = Path(path)
    if p.is_dir():
        p = p / "features.parquet"
    table = pq.read_table(p)
    cols = {name: table.column(name).to_numpy(zero_copy_only=False).astype(float) for name in table.column_names}
    missing = [k for k in SHAPE_TERMS if k not in cols]
    if missing and "decode_rows" in cols:  # written before these terms existed
        derived = [
            shape_features(int(r), int(c), int(n), int(t), bool(p))
            for r, c, n, t, p in zip(  # p_tokens: rows x
                cols["decode_rows"],
                cols["decode_ctx"],
                cols["prefill_chunks"],
                cols["p_tokens"],  # longest
                cols["padded"],
            )
        ]  # when padded
        for k in missing:
            cols[k] = np.array([d[k] for d in derived], dtype=float)
    if "i_after" not in cols and "after_idle" in cols:  # written before it
        cols["i_after"] = after_wake_column(cols["after_idle"])
    return cols
