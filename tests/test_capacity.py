"""capacity: the highest rate each configuration serves within its SLOs, by bracketing and
bisection, with runs that can no longer pass stopped early.

A planted capacity is found within the tolerance (one request at a time at a fixed cost per
request: the queue is stable iff rate <= 1 / cost, the capacity known in closed form);
capacities grow with the replica count; early stopping never changes a run's pass or fail (the
same searches with it off, every run to its end); requests per dollar follow the hardware
preset's price (read back from hardware.json) or a given one; bad input is one line. Cost
coefficients are made up for the tests and mean nothing about any machine.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess

import pytest
from simkit import command, cost_model

import schedlab
from schedlab import traces
from schedlab.analysis.analytic.hardware import HARDWARE_FILE, load_hardware, preset_price
from schedlab.analysis.capacity import format_table
from schedlab.sim.cost import LinearCostModel

SERVICE_S = 0.05  # seconds per request: one prefill pass of a one-token request, nothing else


def even_trace(n: int = 60) -> traces.Trace:
    """``n`` one-token requests, one a second (rescaled to each rate tried)."""
    return traces.Trace("even", "", [traces.Request(f"e{i}", float(i), 10, 1) for i in range(n)])


def mixed_trace(n: int = 60) -> traces.Trace:
    """Small requests of varied lengths in uneven gaps (deterministic)."""
    reqs, t = [], 0.0
    for i in range(n):
        t += 0.2 + (i * 7 % 5) * 0.15
        reqs.append(traces.Request(f"m{i}", t, 40 + (i * 37) % 300, 4 + (i * 13) % 40))
    return traces.Trace("small-mix", "", reqs)


def test_finds_the_planted_capacity_within_the_tolerance():
    # slots with one slot serves one request at a time; a one-token request costs one prefill
    # pass of SERVICE_S. Arrivals every g = 1/rate seconds: with g >= S no request waits (TTFT =
    # S); with g < S request i waits i (S - g). The TTFT SLO allows S (1 + d): request i is good
    # iff i (S - g) <= d S, so at least 54 of 60 (attainment 0.9) are good iff 53 (S - g) <= d S,
    # i.e. rate <= 1 / (S (1 - d / 53)).
    n, att, tol, d = 60, 0.9, 0.02, 1e-3
    planted = 1 / (SERVICE_S * (1 - d / (att * n - 1)))
    table = schedlab.capacity(
        "slots",
        even_trace(n),
        options={"n_slots": 1},
        cost=LinearCostModel({"p_pass": SERVICE_S}),
        slo={"ttft": SERVICE_S * 1e3 * (1 + d)},  # (vllm bench serve --goodput's name)
        attainment=att,
        tolerance=tol,
        workers=1,
    )
    row = table.iloc[0]
    assert row["error"] is None and not row["limited"]
    cap, hi = row["capacity_rps"], row["first_failing_rps"]
    assert planted / (1 + tol) <= cap <= planted < hi <= cap * (1 + tol)
    assert row["binding"] == "ttft_ms" and row["capacity_per_replica_rps"] == cap
    points = table.attrs["points"]["slots"]
    assert row["runs"] == len(points) and row["early_stops"] == sum(p["stopped_early"] for p in points) > 0
    # the attainment at the capacity is summarize's slo_attainment of that run
    run = schedlab.simulate(
        "slots",
        traces.to_rate(even_trace(n), cap),
        options={"n_slots": 1},
        cost=LinearCostModel({"p_pass": SERVICE_S}),
        slo={"ttft_ms": SERVICE_S * 1e3 * (1 + d)},
    )
    assert run.summary["slo_attainment"] == row["attainment_at_capacity"] >= att


def test_capacity_grows_with_the_replica_count(tmp_path):
    table = schedlab.capacity(
        "chunked-prefill",
        mixed_trace(),
        cost=cost_model(),
        slo="ttft_ms=300,tpot_ms=40",
        attainment=0.9,
        tolerance=0.05,
        replicas="1,2,4",
        workers=2,
        out=tmp_path / "out",
    )
    assert list(table["configuration"]) == [
        "chunked-prefill",
        "chunked-prefill x2 round-robin",
        "chunked-prefill x4 round-robin",
    ]
    caps = list(table["capacity_rps"])
    assert table["error"].isna().all() and not table["limited"].any()
    assert caps[0] <= caps[1] <= caps[2] and caps[2] > caps[0]
    assert list(table["capacity_per_replica_rps"]) == [c / n for c, n in zip(caps, (1, 2, 4))]
    out = tmp_path / "out"
    assert {f.name for f in out.iterdir()} == {
        "capacity.csv",
        "capacity.json",
        "capacity.png",
        "capacity.svg",
        "attainment_vs_rate.png",
        "attainment_vs_rate.svg",
    }
    data = json.loads((out / "capacity.json").read_text())
    assert data["slo"] == {"ttft_ms": 300.0, "tpot_ms": 40.0} and data["attainment"] == 0.9
    for conf, row in zip(data["configurations"], table.itertuples()):
        assert conf["capacity_rps"] == row.capacity_rps
        assert len(conf["points"]) == conf["runs"]
        assert {"rate_rps", "attainment", "passed", "stopped_early"} <= set(conf["points"][0])


def test_early_stop_never_changes_the_answer():
    # every SLO kind, one replica (the plain loop) and two (the cluster): the searches with the
    # early stop and with every run to its end try the same rates and agree on every one
    args = dict(
        cost=cost_model(),
        slo="ttft=250,tpot=30,e2el=2500",
        attainment=0.95,
        tolerance=0.05,
        replicas=[1, 2],
        workers=1,
    )
    fast = schedlab.capacity("chunked-prefill", mixed_trace(), **args)
    full = schedlab.capacity("chunked-prefill", mixed_trace(), early_stop=False, **args)
    assert list(fast["capacity_rps"]) == list(full["capacity_rps"])
    assert list(fast["binding"].notna()) == list(full["binding"].notna())
    stopped = 0
    for conf, points in fast.attrs["points"].items():
        whole = full.attrs["points"][conf]
        assert [(p["rate_rps"], p["passed"]) for p in points] == [(p["rate_rps"], p["passed"]) for p in whole]
        for p, q in zip(points, whole):
            assert not q["stopped_early"]
            if p["stopped_early"]:
                stopped += 1
                assert p["attainment"] is None and q["attainment"] <= p["attainment_max"] < 0.95
                assert p["simulated_s"] < q["simulated_s"]
            else:
                assert p["attainment"] == q["attainment"]
    assert stopped > 0 and list(full["early_stops"]) == [0, 0]
    assert list(fast["early_stops"]) == [sum(p["stopped_early"] for p in v) for v in fast.attrs["points"].values()]


def test_the_default_start_finds_what_a_start_at_the_traces_own_rate_finds():
    """The default first rate is twice the trace's own (per replica): the same grid as starting at
    the trace's rate, so the same capacities. Where twice the trace's rate passes, the run at its
    own rate is never made; where it fails, the search tries the same rates in another order."""
    tr = traces.to_rate(mixed_trace(), 25.0)  # one replica holds ~35 req/s here, two ~77, four far more
    args = dict(cost=cost_model(), slo="ttft_ms=300,tpot_ms=40", attainment=0.9, tolerance=0.05, workers=1)
    own = traces.mean_rate(tr)
    default = schedlab.capacity("chunked-prefill", tr, replicas=[1, 2, 4], **args)
    at_own = schedlab.capacity("chunked-prefill", tr, replicas=[1, 2, 4], start_rps=own, **args)
    assert list(default["capacity_rps"]) == list(at_own["capacity_rps"])
    assert list(default["first_failing_rps"]) == list(at_own["first_failing_rps"])
    first = []
    for (conf, pts), n in zip(default.attrs["points"].items(), (1, 2, 4)):
        others = at_own.attrs["points"][conf]
        assert pts[0]["rate_rps"] == pytest.approx(2 * own * n)
        first.append(pts[0]["passed"])
        if pts[0]["passed"]:  # the trace's own rate was not needed: one run fewer
            assert not any(p["rate_rps"] == pytest.approx(own * n) for p in pts) and len(pts) == len(others) - 1
        else:  # the same rates, the failing one first
            assert sorted(p["rate_rps"] for p in pts) == pytest.approx(sorted(p["rate_rps"] for p in others))
    assert first == [False, False, True]  # both ways, on this trace


# ---------------------------------------------------------------------- per dollar

PRICED = dict(hardware="h100-sxm", model_config="llama-3.1-8b")  # an analytic H100: tiny runs
PRICED_SLO = dict(slo="ttft_ms=40,tpot_ms=10", attainment=0.9, tolerance=0.1)


def test_the_preset_prices_have_sources():
    data = json.loads(HARDWARE_FILE.read_text())
    priced = {name for name, p in data["presets"].items() if "price_usd_per_hour" in p}
    assert {"h100-sxm", "a100-80gb-sxm", "a100-40gb-sxm"} <= priced
    assert not any(data["presets"][n]["kind"] == "apple-gpu" for n in priced)  # bought, not rented
    for name in priced:
        fig = data["presets"][name]["price_usd_per_hour"]
        assert math.isfinite(fig["value"]) and fig["value"] > 0 and fig["sources"] and fig["note"], name
        assert all(sid in data["sources"] for sid in fig["sources"]), name
        got = preset_price(name)
        assert got["value"] == fig["value"] == load_hardware(name).price_usd_per_hour
        assert [s["url"] for s in got["sources"]] == [data["sources"][sid]["url"] for sid in fig["sources"]]
    assert preset_price("m4-max") is None and load_hardware("m4-max").price_usd_per_hour is None


def test_requests_per_usd_from_the_preset_price(tmp_path):
    data = json.loads(HARDWARE_FILE.read_text())
    fig = data["presets"]["h100-sxm"]["price_usd_per_hour"]
    price = fig["value"]
    table = schedlab.capacity(
        "chunked-prefill", mixed_trace(30), replicas="1,2", workers=1, out=tmp_path / "o", **PRICED, **PRICED_SLO
    )
    assert table["error"].isna().all() and table["capacity_rps"].notna().all()
    for row in table.itertuples():
        assert row.price_usd_per_hour == price
        assert row.requests_per_usd == pytest.approx(row.capacity_rps * 3600 / (row.replicas * price), rel=1e-12)
    urls = ", ".join(data["sources"][sid]["url"] for sid in fig["sources"])
    info = table.attrs["info"]
    assert info["price_source"] == f"preset h100-sxm ({urls})" and info["price_usd_per_hour"] == price
    saved = json.loads((tmp_path / "o" / "capacity.json").read_text())
    assert saved["price_source"] == info["price_source"]
    assert [c["requests_per_usd"] for c in saved["configurations"]] == list(table["requests_per_usd"])
    with open(tmp_path / "o" / "capacity.csv") as f:
        header = next(csv.reader(f))
    assert {"price_usd_per_hour", "requests_per_usd"} <= set(header)
    rows = table.astype(object).where(table.notna(), None).to_dict("records")
    assert "req/$" in format_table(rows).splitlines()[0]


def test_a_tensor_parallel_replica_counts_its_gpus_and_their_price(tmp_path):
    """--hardware PRESET:tp=2: every replica spans 2 GPUs, so the per-GPU capacity is the capacity over
    2 x replicas and a replica costs 2 GPUs' price; the printed table gains a per-GPU column."""
    gpu_price = preset_price("a100-80gb-sxm")["value"]
    table = schedlab.capacity(
        "vllm",
        mixed_trace(30),
        replicas="1,2",
        workers=1,
        hardware="a100-80gb-sxm:tp=2",
        model_config="opt-13b",
        slo="ttft_ms=100,tpot_ms=20",
        attainment=0.9,
        tolerance=0.1,
    )
    assert table["error"].isna().all() and table["capacity_rps"].notna().all()
    for row in table.itertuples():
        assert row.gpus == 2 * row.replicas
        assert row.capacity_per_gpu_rps == row.capacity_rps / row.gpus
        assert row.capacity_per_replica_rps == row.capacity_rps / row.replicas
        assert row.price_usd_per_hour == 2 * gpu_price
        assert row.requests_per_usd == pytest.approx(row.capacity_rps * 3600 / (row.gpus * gpu_price), rel=1e-12)
    rows = table.astype(object).where(table.notna(), None).to_dict("records")
    assert "per GPU" in format_table(rows).splitlines()[0]
    # one GPU per replica: no per-GPU column (it would repeat the per-replica one)
    plain = [dict(r, gpus=r["replicas"]) for r in rows]
    assert "per GPU" not in format_table(plain).splitlines()[0]


def test_a_given_price_overrides_the_preset_and_prices_cluster_files(tmp_path):
    p = capacity_cmd(
        "--policy", "chunked-prefill", "--trace", _trace_file(tmp_path, 30), "--cluster", "h100-a100",
        "--hardware", "h100-sxm", "--model-config", "llama-3.1-8b", "--slo", "ttft_ms=40,tpot_ms=10",
        "--attainment", "0.9", "--tolerance", "0.1", "--price-per-hour", "1.5", "-j", "1", "--out", tmp_path / "o",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "req/$" in p.stdout
    saved = json.loads((tmp_path / "o" / "capacity.json").read_text())
    assert saved["price_source"] == "given" and saved["price_usd_per_hour"] == 1.5
    confs = saved["configurations"]
    assert [c["configuration"] for c in confs] == ["chunked-prefill", "h100-a100"] and confs[1]["replicas"] > 1
    for c in confs:  # the cluster file too: the price is per replica
        assert c["capacity_rps"] and c["price_usd_per_hour"] == 1.5
        assert c["requests_per_usd"] == pytest.approx(c["capacity_rps"] * 3600 / (c["replicas"] * 1.5), rel=1e-12)


def test_a_profile_run_has_no_price(tmp_path):
    table = schedlab.capacity(
        "chunked-prefill",
        mixed_trace(20),
        profile=_profile_file(tmp_path),
        slo="ttft_ms=300",
        attainment=0.9,
        tolerance=0.1,
        workers=1,
    )
    assert table["capacity_rps"].notna().all()
    assert table["price_usd_per_hour"].isna().all() and table["requests_per_usd"].isna().all()
    assert table.attrs["info"]["price_source"] is None and table.attrs["info"]["price_usd_per_hour"] is None
    rows = table.astype(object).where(table.notna(), None).to_dict("records")
    assert rows[0]["requests_per_usd"] is None and "req/$" not in format_table(rows)


def _trace_file(tmp_path, n: int = 20):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(mixed_trace(n).to_json()))
    return trace


def _profile_file(tmp_path):
    prof = tmp_path / "prof.json"
    prof.write_text(
        json.dumps({"schema": "schedlab-profile/1", "model": "test", "coefficients": dict(cost_model().coefficients)})
    )
    return prof


def capacity_cmd(*args):
    return subprocess.run([*command("capacity"), *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--slo", "ttft_s=300"], "unknown SLO key 'ttft_s'"),
        (["--slo", "ttft=300,ttft_ms=200"], "SLO ttft_ms is given twice"),
        (["--policy", " , "], "--policy needs at least one policy"),
        (["--replicas", ","], "--replicas needs at least one count"),
        (["--router", ","], "--router needs at least one router"),
        (["--attainment", "1.5"], "--attainment must be in (0, 1]"),
        (["--tolerance", "0"], "--tolerance must be a finite number > 0"),
        (["--slo", "ttft_ms=0.01"], "no rate meets the SLOs even at"),
        (["--executor", "dask"], "unknown executor 'dask': choose local or ray"),
        (["--price-per-hour", "0"], "--price-per-hour must be a finite number > 0 (USD per hour of one replica)"),
        (["--price-per-hour", "-1"], "--price-per-hour must be a finite number > 0"),
        (["--price-per-hour", "nan"], "--price-per-hour must be a finite number > 0"),
        (["--price-per-hour", "abc"], "Invalid value for '--price-per-hour': 'abc' is not a valid float"),
        (["--executor", "ray", "--ray-address", "127.0.0.1:1"], "cannot reach the Ray cluster at 127.0.0.1:1"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, expect):
    trace, prof = _trace_file(tmp_path), _profile_file(tmp_path)
    base = {"--policy": "chunked-prefill", "--trace": str(trace), "--slo": "ttft_ms=300", "--profile": str(prof)}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    p = capacity_cmd(*[x for kv in base.items() for x in kv], "--out", tmp_path / "o", "-j", "1")
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("schedlab capacity: error:"), p.stderr
    assert expect in lines[0]
    assert not (tmp_path / "o").exists()
