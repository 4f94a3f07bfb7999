"""A real cluster's metrics made from its replicas' tables (``analysis.validation.tables_summary``)
are the simulator's own definitions: on a simulated cluster's files they give its summary, and
putting a replica's times on another clock (what each real replica's own clock does) is undone
by its shift."""

from __future__ import annotations

import pandas as pd
import pytest

import schedlab
from schedlab.analysis.validation import METRICS, _get, tables_summary

KEYS = [path for _, path, _ in METRICS]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run = schedlab.simulate("vllm", "mixed.json", replicas=3, router="least-requests", request_rate=2.0, seed=3)
    d = tmp_path_factory.mktemp("c")
    run.save(d)
    req = pd.read_csv(d / "requests.csv", dtype={"id": str})
    tok = pd.read_parquet(d / "tokens.parquet")
    tok = tok.merge(req[["id", "replica"]].rename(columns={"id": "request_id"}), on="request_id")
    return run, req, tok


def test_the_tables_give_the_summary(saved):
    run, req, tok = saved
    t = tables_summary(req, tok)
    for path in KEYS:
        assert _get(t, path) == pytest.approx(_get(run.summary, path), rel=1e-12), path
    assert t["finished"] == run.summary["finished"]


def test_a_replica_on_its_own_clock_is_put_back_by_its_shift(saved):
    run, req, tok = saved
    moved_r, moved_t = req.copy(), tok.copy()
    for col in ("arrival_s", "first_token_s", "finish_s"):
        moved_r.loc[moved_r["replica"] == 1, col] += 7.25
    moved_t.loc[moved_t["replica"] == 1, "time_s"] += 7.25
    off = tables_summary(moved_r, moved_t)
    back = tables_summary(moved_r, moved_t, {0: 0.0, 1: -7.25, 2: 0.0})
    assert off["makespan_s"] != pytest.approx(run.summary["makespan_s"])  # the clocks matter to the makespan
    for path in KEYS:
        assert _get(back, path) == pytest.approx(_get(run.summary, path), rel=1e-9), path
    assert _get(off, ("ttft_ms", "p99")) == pytest.approx(_get(run.summary, ("ttft_ms", "p99")))  # latencies: none
