"""The deterministic results of record, recomputed at HEAD: the simulated (not timed) numbers of
``bench/results/policies.json``, ``capacity.json`` and ``cluster.json``, which README.md and the
docs quote, are what the code gives now. A change that moves a simulated output fails here, not
weeks later when someone reruns a bench.

A cheap subset (seconds, not the benches' minutes): every policy of the policy table (300
requests each); one capacity configuration's run at its recorded capacity (the Azure hour,
time-scaled, on the H100 preset: its attainment, its misses per SLO, its simulated span); one
row of the cluster table (the Azure hour on 16 replicas). Through the public API, so a
refactor of the runners underneath is checked by the same lines."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import schedlab
from schedlab import traces
from schedlab.policies import POLICIES

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"

pytestmark = pytest.mark.slow


def recorded(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


@pytest.fixture(scope="module")
def azure():
    return traces.load("azure2023_conv")


def test_the_policy_table_is_todays():
    """``bench/policies.py``: every bundled policy on mixed.json with the bundled profile gives
    the recorded summary.json exactly, and the recorded share of its makespan spent in steps."""
    rec = recorded("policies.json")
    assert list(rec["summaries"]) == list(POLICIES), "a policy added or removed: run bench/policies.py"
    for policy, summary in rec["summaries"].items():
        run = schedlab.simulate(policy, rec["trace"])
        assert Path(run.meta["profile"]).name == rec["profile"]
        assert run.summary == summary, policy
        busy = float((run.steps["end_s"] - run.steps["start_s"]).sum()) / run.summary["makespan_s"]
        assert busy == pytest.approx(rec["busy"][policy], rel=1e-12), policy


def test_a_capacity_of_record_is_todays(azure):
    """``bench/capacity.py``: chunked-prefill on one H100 (Llama 3.1 8B) at its recorded capacity
    (the cheapest of the six configurations to run): the run at that rate meets the attainment,
    with the recorded attainment, misses per SLO and simulated span, to the last bit."""
    rec = recorded("capacity.json")
    cmd = rec["command"]
    assert cmd["trace"] == azure.name
    (row,) = [c for c in rec["configurations"] if c["policy"] == "chunked-prefill" and c["replicas"] == 1]
    (point,) = [p for p in row["points"] if p["rate_rps"] == row["capacity_rps"]]
    assert point["passed"] and not point["stopped_early"]
    slo = {f"{k}_ms": float(v) for k, v in (kv.split("=") for kv in cmd["slo"].split(","))}
    run = schedlab.simulate(
        "chunked-prefill",
        traces.to_rate(azure, row["capacity_rps"]),
        hardware=cmd["hardware"],
        model_config=cmd["model_config"],
        slo=slo,
        passes=False,
    )
    req = run.requests
    done = req[req["status"] == "finished"]
    misses = {k: int((done[k] > limit).sum()) for k, limit in slo.items()}
    misses["unfinished"] = int((req["status"] != "finished").sum())
    assert run.summary["slo_attainment"] == point["attainment"] == row["attainment_at_capacity"]
    assert run.summary["slo_attainment"] >= cmd["attainment"]
    assert misses == point["misses"]
    assert run.summary["makespan_s"] - req["arrival_s"].min() == point["simulated_s"]


def test_a_cluster_makespan_of_record_is_todays(azure):
    """``bench/cluster.py``: the Azure hour's arrivals divided by 16 on 16 replicas (``unified``,
    ``least-requests``, the bundled profile) finish every request, in the recorded number of
    steps and makespan."""
    rec = recorded("cluster.json")
    assert rec["trace"] == azure.name
    (row,) = [r for r in rec["rows"] if r["replicas"] == 16]
    reqs = [dataclasses.replace(r, arrival_s=r.arrival_s / 16) for r in azure.requests]
    run = schedlab.simulate(rec["policy"], reqs, replicas=16, router=rec["router"], passes=False)
    s = run.summary
    assert (s["requests"], s["finished"]) == (row["requests"], row["finished"])
    assert s["steps"] == row["steps"]
    assert s["makespan_s"] == row["makespan_s"]
