"""Closed-loop clients (``sim.sources.ClientSource``): at most C requests in flight, requests
issued at their schedule in trace order and sent when a slot is free, as ``vllm bench serve
--max-concurrency`` does; on the simulated clock (the replica runs ahead of SimPy) and on the
wall clock; through simulate, run-real's options and sweep.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from schedlab import traces
from schedlab.policies import make_policy
from schedlab.sim import ClientSource, WallClock, run_replica, summarize
from schedlab.sim.sources import clients
from simkit import command, drawn_fraction, png_rgb, read_table, svg_series, svg_texts
from test_loop import FixedBackend, cost
from schedlab.traces.schema import Request

BIN = Path(sys.executable).parent


def in_flight(rows) -> int:
    """Most requests sent and not finished at once, from a run's request times ([send, finish))."""
    events = sorted([(float(r["arrival_s"]), 1) for r in rows] + [(float(r["finish_s"]), -1) for r in rows])
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def test_one_client_sends_each_request_when_the_previous_finishes():
    reqs = [Request("A", 0.0, 10, 3), Request("B", 0.0, 5, 2), Request("C", 0.2, 4, 1)]
    res = run_replica(ClientSource(reqs, 1), make_policy("unified"), cost(), kv_capacity=1000, backend=FixedBackend())
    by = {r.id: r for r in res.requests}
    # A: prefill [0, 1], decodes to 1.5; B sent at 1.5: prefill [1.5, 2.5], decode to 2.75;
    # C sent at 2.75 (issued at 0.2, queued behind the semaphore): prefill [2.75, 3.75]
    assert by["A"].token_times == [1.0, 1.25, 1.5]
    assert by["B"].arrival_s == 1.5 and by["B"].token_times == [2.5, 2.75]
    assert by["C"].arrival_s == 2.75 and by["C"].token_times == [3.75]
    s = summarize(res)
    assert s["clients"]["max_concurrency"] == 1 and s["clients"]["peak_concurrency"] == 1
    # client queue time: C waited from its schedule (0.2) to 2.75
    assert s["clients"]["client_queue_ms"]["mean"] == pytest.approx((0 + 1500 + 2550) / 3)


def test_two_clients_and_the_schedule():
    """Issue times are earliest send times; a freed slot goes to the next request in order."""
    reqs = [Request(f"r{i}", t, 4, 2) for i, t in enumerate([0.0, 0.1, 0.2, 5.0, 5.0])]
    res = run_replica(ClientSource(reqs, 2), make_policy("unified"), cost(), kv_capacity=1000, backend=FixedBackend())
    by = {r.id: r for r in res.requests}
    # r0 [0,1] prefill, r1 arrives 0.1 (slot 2); step [1,2]: decode r0 (finishes at 2) + prefill r1
    assert by["r0"].finish_s == 2.0 and by["r1"].arrival_s == 0.1
    assert by["r2"].arrival_s == 2.0  # sent when r0's slot frees
    assert by["r3"].arrival_s == 5.0 and by["r4"].arrival_s == 5.0  # slots free by then: on schedule
    rows = [{"arrival_s": r.arrival_s, "finish_s": r.finish_s} for r in res.requests]
    assert in_flight(rows) == 2


def test_think_time_delays_the_next_send():
    reqs = [Request("A", 0.0, 4, 1), Request("B", 0.0, 4, 1)]
    res = run_replica(
        ClientSource(reqs, 1, think_s=3.0), make_policy("unified"), cost(), kv_capacity=1000, backend=FixedBackend()
    )
    by = {r.id: r for r in res.requests}
    assert by["A"].finish_s == 1.0 and by["B"].arrival_s == 4.0 and by["B"].finish_s == 5.0


def test_a_refused_request_frees_its_slot_at_once():
    reqs = [Request("big", 0.0, 5000, 10), Request("ok", 0.0, 4, 1)]
    res = run_replica(ClientSource(reqs, 1), make_policy("unified"), cost(), kv_capacity=1000, backend=FixedBackend())
    assert [r.id for r, _ in res.rejected] == ["big"]
    ok = {r.id: r for r in res.requests}["ok"]
    assert ok.arrival_s == 0.0 and ok.finish_s == 1.0


def test_the_simulated_clock_runs_ahead_and_still_honours_the_limit():
    """With the cost model's seconds the replica plans many steps ahead of SimPy; a finish
    must make the next send time known to it (next_arrival_s) so the send is not late."""
    from schedlab.sim.cost import LinearCostModel
    from schedlab.sim.profiles import resolve_profile

    cm = LinearCostModel.from_profile(resolve_profile(None))
    tr = traces.load("random:n=120,input_len=256,output_len=64,range_ratio=0.5")  # all issued at t=0
    for c in (1, 3, 8):
        res = run_replica(clients(tr.requests, c), make_policy("unified"), cm, kv_capacity=200_000)
        rows = [{"arrival_s": r.arrival_s, "finish_s": r.finish_s} for r in res.requests]
        assert all(r.finish_s is not None for r in res.requests)
        assert in_flight(rows) == c
        # closed loop: every send after the first c happens exactly at some request's finish
        finishes = sorted(r.finish_s for r in res.requests)
        sends = sorted(r.arrival_s for r in res.requests)[c:]
        assert all(s in set(finishes) for s in sends)
        # and the replica was never idle while a request was waiting to be sent
        assert sorted(r.arrival_s for r in res.requests)[c] == finishes[0]


def test_request_rate_schedule_with_a_limit():
    tr = traces.load("random:n=60,input_len=128,output_len=32")
    src = clients(tr.requests, 4, request_rate=2.0, burstiness=0.5, seed=3)
    want = traces.request_times(60, 2.0, 0.5, 3)
    assert src.schedule == want
    res = run_replica(src, make_policy("vllm"), cost(), kv_capacity=100_000, backend=FixedBackend())
    for r in res.requests:
        assert r.arrival_s >= src.scheduled_s[r.id]
    rows = [{"arrival_s": r.arrival_s, "finish_s": r.finish_s} for r in res.requests]
    assert in_flight(rows) <= 4
    # no limit: the schedule alone (an open loop)
    res = run_replica(
        clients(tr.requests, None, request_rate=2.0, burstiness=0.5, seed=3),
        make_policy("unified"),
        cost(),
        kv_capacity=100_000,
        backend=FixedBackend(),
    )
    assert [r.arrival_s for r in res.requests] == want
    assert clients(tr.requests) is tr.requests  # no client option: a plain replay


class SleepBackend(FixedBackend):
    """Real time: every pass sleeps a few milliseconds."""

    def make_clock(self):
        return WallClock()

    def execute(self, p, shape, state):
        time.sleep(0.004 if p.prefill else 0.002)
        return 0.0


def test_clients_on_the_wall_clock():
    reqs = [Request(f"w{i}", 0.002 * i, 8, 4) for i in range(12)]
    res = run_replica(ClientSource(reqs, 3), make_policy("unified"), cost(), kv_capacity=1000, backend=SleepBackend())
    assert res.error is None and all(r.finish_s is not None for r in res.requests)
    rows = [{"arrival_s": r.arrival_s, "finish_s": r.finish_s} for r in res.requests]
    assert in_flight(rows) <= 3
    assert summarize(res)["clients"]["peak_concurrency"] == in_flight(rows)


def test_live_source_takes_requests_from_another_thread_while_the_replica_runs():
    """sim.sources.LiveSource (serve's): requests submitted from a thread are stamped on the run's
    clock in submission order, all served; nothing is taken before the clock runs or after close()."""
    import threading

    from schedlab.sim import LiveSource, SourceClosed

    backend = SleepBackend()
    clock = WallClock()
    finished = []
    ready = threading.Event()
    src = LiveSource(clock, on_ready=ready.set, on_finish=lambda r, t: finished.append((r.id, r.finish_s, t)))
    with pytest.raises(SourceClosed, match="not taking"):
        src.submit(Request("early", 0.0, 8, 4))
    stamped = []

    def client():
        ready.wait(10)
        for i in range(8):
            stamped.append(src.submit(Request(f"l{i}", 123.0, 8, 3)))  # any arrival_s: stamped now
            time.sleep(0.003 * (i % 3))
        stamped.append(src.submit(Request("huge", 0.0, 900, 200)))  # larger than the KV capacity
        src.close()
        with pytest.raises(SourceClosed, match="shutting down"):
            src.submit(Request("late", 0.0, 8, 4))

    t = threading.Thread(target=client)
    t.start()
    res = run_replica(src, make_policy("vllm"), cost(), kv_capacity=1000, backend=backend, clock=clock)
    t.join()
    assert res.error is None and [r.id for r in src.received] == [r.id for r in stamped]
    times = [r.arrival_s for r in stamped]
    assert times == sorted(times) and 0 <= times[0] < 10 and times[0] != 123.0
    assert [r.arrival_s for r in res.requests] == times[:8] + [times[8]]
    assert all(r.finish_s is not None and r.generated == 3 for r in res.requests if r.id != "huge")
    done = {rid: (fs, t) for rid, fs, t in finished}
    assert set(done) == {r.id for r in stamped} and done["huge"][0] is None  # refused: told at once
    assert [r.id for r, _ in res.rejected] == ["huge"]


def test_bad_client_arguments():
    reqs = [Request("a", 0.0, 4, 1)]
    for kw, msg in (
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"think_s": -1.0}, "think time"),
        ({"schedule": [1.0, 2.0]}, "2 scheduled times for 1"),
    ):
        with pytest.raises(ValueError, match=msg):
            ClientSource(reqs, **kw)


# ---------------------------------------------------------------------- commands


def cli(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*command(name), *map(str, args)], capture_output=True, text=True, timeout=300)


def test_simulate_max_concurrency_keeps_at_most_c_in_flight(tmp_path):
    """Acceptance: at most 8 requests in flight, read from requests.csv's timestamps."""
    out = tmp_path / "run"
    proc = cli(
        "simulate",
        "--policy",
        "vllm",
        "--trace",
        "random:n=300,input_len=512,output_len=128,range_ratio=0.5",
        "--max-concurrency",
        "8",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Maximum request concurrency:             8" in proc.stdout
    assert "Peak concurrent requests:                8" in proc.stdout
    rows = read_table(out / "requests.csv")
    assert len(rows) == 300 and all(r["status"] == "finished" for r in rows)
    assert in_flight(rows) == 8
    assert all(float(r["arrival_s"]) >= float(r["scheduled_s"]) for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clients"]["max_concurrency"] == 8 and summary["clients"]["peak_concurrency"] == 8
    meta = json.loads((out / "meta.json").read_text())
    assert meta["block_size"] == 16


def test_simulate_request_rate_and_bad_client_options(tmp_path):
    out = tmp_path / "run"
    proc = cli(
        "simulate",
        "-p",
        "unified",
        "-t",
        "real-mixed",
        "--request-rate",
        "4",
        "--burstiness",
        "2",
        "--max-concurrency",
        "3",
        "--think-time",
        "0.5",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clients"]["request_rate"] == 4 and summary["clients"]["burstiness"] == 2
    assert summary["clients"]["think_s"] == 0.5
    for args, msg in (
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--burstiness", "2"], "give --request-rate too"),
        (["--think-time", "1"], "give --max-concurrency too"),
        (["--request-rate", "fast"], "--request-rate must be a number"),
        (["--block-size", "0"], "--block-size must be >= 1"),
    ):
        proc = cli("simulate", "-p", "unified", "-t", "real-smoke", *args)
        assert proc.returncode == 2, proc.stdout
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and msg in lines[0], proc.stderr


def test_sweep_over_concurrency(tmp_path):
    out = tmp_path / "sw"
    proc = cli(
        "sweep",
        "--policy",
        "vllm,unified",
        "--trace",
        "random:n=80,input_len=256,output_len=64",
        "--concurrency",
        "4,1",
        "--kv-tokens",
        "4096",
        "--workers",
        "1",
        "--out",
        out,
        "--format",
        "png,svg",
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 policies x 2 concurrencies" in proc.stderr
    data = json.loads((out / "sweep.json").read_text())
    assert data["concurrency"] == [1, 4] and data["block_size"] == 16
    rows = data["rows"]
    assert [(r["policy"], r["max_concurrency"]) for r in rows] == [
        ("vllm", 1),
        ("vllm", 4),
        ("unified", 1),
        ("unified", 4),
    ]
    assert all(r["peak_concurrency"] == r["max_concurrency"] and r["finished"] == 80 for r in rows)
    # a row equals simulate's summary of the same run
    direct = cli(
        "simulate",
        "--policy",
        "vllm",
        "--trace",
        "random:n=80,input_len=256,output_len=64",
        "--max-concurrency",
        "4",
        "--kv-tokens",
        "4096",
        "--out",
        tmp_path / "one",
    )
    assert direct.returncode == 0, direct.stderr
    s = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert rows[1]["ttft_p99_ms"] == pytest.approx(s["ttft_ms"]["p99"], rel=1e-12)
    assert rows[1]["preemptions"] == s.get("preemptions", 0)
    with open(out / "sweep.csv") as f:
        assert "max_concurrency" in next(csv.reader(f))
    # the figure: latency and throughput against the number of clients (12.5 x 8.6 in at 110 dpi)
    img = png_rgb(out / "latency_vs_load.png")
    assert img.shape[:2] == (946, 1375) and drawn_fraction(img) > 0.035
    texts = svg_texts(out / "latency_vs_load.svg")
    assert texts.count("clients (max concurrency)") == 4 and {"vllm", "unified"} <= set(texts)
    # in each panel each policy's series (p50 solid, p99 dashed) through both concurrencies,
    # going the way its rows go (page y grows downwards)
    colours = {"#1f77b4": "vllm", "#ff7f0e": "unified"}  # C0, C1: the policies in order
    panels = [("ttft_p50_ms", "ttft_p99_ms"), ("itl_p50_ms", "itl_p99_ms"), ("output_throughput_tok_s",)]
    panels.append(("request_throughput_rps",))
    series = svg_series(out / "latency_vs_load.svg")
    assert len(series) == 4
    for lines, keys in zip(series, panels):
        mine = [(colours[c], pts, dashed) for c, pts, dashed in lines if c in colours]
        assert sorted((pol, dashed) for pol, _, dashed in mine) == sorted(
            (pol, key.endswith("p99_ms")) for pol in colours.values() for key in keys
        ), keys
        for pol, pts, dashed in mine:
            key = keys[1] if dashed else keys[0]
            assert len(pts) == 2, (pol, key, pts)
            (_, y1), (_, y4) = pts  # concurrency 1, then 4
            r1, r4 = (r[key] for r in rows if r["policy"] == pol)
            assert (y4 < y1) == (r4 > r1), (pol, key, pts, r1, r4)
    bad = cli("sweep", "--policy", "vllm", "--trace", "real-smoke", "--out", tmp_path / "x")
    assert bad.returncode == 2 and "--rates" in bad.stderr and "--concurrency" in bad.stderr


def test_a_policy_that_stalls_a_closed_loop_is_a_one_line_error():
    class Idle:
        name = "idle"

        def plan(self, view):
            from schedlab.policies.base import Plan

            return Plan()

    res = run_replica(
        ClientSource([Request("a", 0.0, 4, 1), Request("b", 0.0, 4, 1)], 1),
        Idle(),
        cost(),
        kv_capacity=100,
        backend=FixedBackend(),
    )
    assert res.error == (
        "policy 'idle' step 0: planned nothing with 1 request(s) unfinished while the "
        "arrival source waits for one of them to finish"
    )
