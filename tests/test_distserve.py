"""DistServe's headline as simulated by ``bench/distserve.py``, checked at HEAD in seconds: what
bench/results/distserve.json records was run with the bench's constants, its cluster files are the
placements it names (3 GPUs each, a TP-2 replica counting 2), and the one fixed-rate run of
DistServe's placement and of co-located vLLM per workload is what the code gives now, in the order
the recording found: co-located ahead on vLLM's ShareGPT sampling, disaggregated ahead on
ShareGPT as DistServe prepares it."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
RECORDED = json.loads((BENCH / "results" / "distserve.json").read_text())


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("distserve")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def files(bench, tmp_path_factory):
    return bench.cluster_files(tmp_path_factory.mktemp("distserve"))


def test_the_recording_ran_the_bench_constants(bench):
    assert RECORDED["setup"] == bench.setup()
    assert RECORDED["published"] == bench.PUBLISHED
    assert RECORDED["model"] == bench.model_facts()
    assert set(RECORDED["workloads"]) == set(bench.WORKLOADS)
    dis, co = bench.HEADLINE
    for name, w in RECORDED["workloads"].items():
        rows = w["configurations"]
        assert set(rows) == set(bench.PLACEMENTS), name
        for label, r in rows.items():
            assert r["gpus"] == bench.GPUS and r["per_gpu_rps"] == r["capacity_rps"] / bench.GPUS, (name, label)
        assert w["prefill_s_at_p90_prompt"] == bench.prefill_seconds(w["prompt_tokens_p90"])
        h = w["headline"]
        assert (h["disaggregated"], h["co_located"]) == (dis, co)
        assert h["ratio"] == rows[dis]["per_gpu_rps"] / rows[co]["per_gpu_rps"]
        best = w["best_disaggregated"]
        assert best["per_gpu_rps"] == max(r["per_gpu_rps"] for k, r in rows.items() if k.startswith("pd-"))
        # the spot rate lies between the two capacities, on the side each run's attainment says
        rate, spot = bench.SPOT_RATES[name], w["spot"]
        for label in (dis, co):
            passed = spot[label]["slo_attainment"] >= bench.ATTAINMENT
            assert passed == (rate <= rows[label]["capacity_rps"]), (name, label)


def test_the_cluster_files_are_the_placements_on_3_gpus(bench, files):
    from schedlab.api.capacities import _gpus
    from schedlab.api.options import ClusterOptions

    assert set(files) == set(bench.PLACEMENTS)
    for label, f in files.items():
        cu = ClusterOptions.from_file(f)
        assert _gpus(cu) == bench.GPUS, label
        assert {g.model_config for g in cu.groups} == {bench.MODEL} and {g.policy for g in cu.groups} == {"vllm"}
        assert cu.disaggregated == label.startswith("pd-"), label
    pre, dec = ClusterOptions.from_file(files["pd-tp2-1"]).groups
    assert (pre.pool, pre.count, pre.hardware) == ("prefill", 1, "a100-80gb-sxm:tp=2")
    assert (dec.pool, dec.count, dec.hardware) == ("decode", 1, "a100-80gb-sxm")


@pytest.mark.parametrize("name,ahead", [("sharegpt", "co-located-3"), ("distserve-sharegpt", "pd-tp2-1")])
def test_the_spot_runs_are_todays(bench, files, name, ahead):
    """One run of each of the two at the workload's spot rate: the recorded attainments and
    latencies, float for float; the one ahead meets the 90 % attainment, the other does not."""
    got = bench.spot(files, bench.workload(name), bench.SPOT_RATES[name])
    assert got == RECORDED["workloads"][name]["spot"]
    behind = next(k for k in bench.HEADLINE if k != ahead)
    assert got[ahead]["slo_attainment"] >= bench.ATTAINMENT > got[behind]["slo_attainment"]
