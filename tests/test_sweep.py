"""sweep: one trace rescaled to several rates, every (policy, rate) simulated in workers.

Each row is checked against a direct sim.run + summarize of the trace rescaled by hand;
the highest sustained rate is checked on constructed rows. Cost coefficients are made up
for the tests and mean nothing about any machine.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from schedlab import traces
from schedlab.policies import make_policy
from schedlab.sim import run_replica, summarize
from schedlab.sim.cost import LinearCostModel
from schedlab.analysis.sweep import ROW_FIELDS, format_table, max_sustained_rate, sweep

COEFFS = {
    "d_pass": 0.02,
    "d_rows": 0.001,
    "d_kv": 1e-6,
    "p_pass": 0.01,
    "p_tokens": 2e-4,
    "p_attn": 1e-8,
    "s_step": 0.001,
}
SLO = {"ttft_ms": 400.0, "tpot_ms": 60.0}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def small_trace() -> traces.Trace:
    spec = [
        (0.0, 300, 20),
        (0.3, 120, 12),
        (0.5, 600, 15),
        (0.9, 50, 1),
        (1.6, 200, 10),
        (2.0, 80, 18),
        (2.1, 400, 8),
        (3.2, 90, 14),
        (3.9, 700, 6),
        (4.4, 60, 11),
    ]
    return traces.Trace("small", "", [traces.Request(f"s{i}", a, p, o) for i, (a, p, o) in enumerate(spec)])


def write_trace(path, trace: traces.Trace):
    path.write_text(json.dumps(trace.to_json()))
    return path


def by_hand(trace, rps):
    """The rescaling sweep promises, written out: mean rate (n-1)/span becomes rps, first arrival 0."""
    a = [r.arrival_s for r in trace.requests]
    k = rps / ((len(a) - 1) / (a[-1] - a[0]))
    return [replace(r, arrival_s=(r.arrival_s - a[0]) / k) for r in trace.requests]


@pytest.fixture(scope="module")
def cost():
    return LinearCostModel(dict(COEFFS))


def test_rows_equal_direct_runs_of_the_rescaled_trace(cost):
    tr = small_trace()
    rates = [1.0, 4.0, 12.0]
    policies = ["chunked-prefill", "prefer-prefill"]
    rows = sweep(tr, policies, rates, cost, 100_000, slo=SLO, workers=2)
    assert [(r["policy"], r["rate_rps"]) for r in rows] == [(p, x) for p in policies for x in rates]
    for row in rows:
        reqs = by_hand(tr, row["rate_rps"])
        span = reqs[-1].arrival_s - reqs[0].arrival_s
        assert (len(reqs) - 1) / span == pytest.approx(row["rate_rps"], rel=1e-12)
        res = run_replica(reqs, make_policy(row["policy"]), cost, kv_capacity=100_000)
        s = summarize(res, slo=SLO)
        assert row["error"] is None and row["finished"] == len(reqs)
        for key, want in (
            ("ttft_p50_ms", s["ttft_ms"]["p50"]),
            ("ttft_p99_ms", s["ttft_ms"]["p99"]),
            ("itl_p50_ms", s["itl_ms"]["p50"]),
            ("itl_p99_ms", s["itl_ms"]["p99"]),
            ("output_throughput_tok_s", s["output_throughput_tok_s"]),
            ("goodput_rps", s["goodput_rps"]),
            ("slo_attainment", s["slo_attainment"]),
        ):
            assert row[key] == pytest.approx(want, rel=1e-9), key
    # more load, longer waits: TTFT p99 grows with rate for each policy on this trace
    for p in policies:
        ttft = [r["ttft_p99_ms"] for r in rows if r["policy"] == p]
        assert ttft == sorted(ttft) and ttft[-1] > ttft[0]


def test_in_process_and_worker_processes_agree(cost):
    tr = small_trace()
    one = sweep(tr, ["unified", "slots"], [2.0, 6.0], cost, 100_000, workers=1)
    two = sweep(tr, ["unified", "slots"], [2.0, 6.0], cost, 100_000, workers=2)
    assert one == two


def test_a_failing_job_is_an_error_row_and_the_rest_still_run(cost):
    tr = small_trace()
    rows = sweep(tr, ["chunked-prefill", "no-such-policy"], [2.0], cost, 100_000, workers=1)
    assert rows[0]["error"] is None and rows[0]["finished"] == len(tr)
    assert "no-such-policy" in rows[1]["error"] and rows[1]["ttft_p50_ms"] is None


def _row(policy, rate, attainment, error=None):
    r = {k: None for k in ROW_FIELDS}
    r.update(policy=policy, rate_rps=rate, slo_attainment=attainment, error=error)
    return r


def test_highest_sustained_rate_on_constructed_rows():
    rows = [
        # a: passes up to 2, fails at 4, passes again at 8: the later lucky point does not count
        _row("a", 8.0, 0.95),
        _row("a", 1.0, 0.99),
        _row("a", 4.0, 0.85),
        _row("a", 2.0, 0.90),
        # b: fails at the lowest rate
        _row("b", 1.0, 0.5),
        _row("b", 2.0, 0.95),
        # c: passes everywhere: the sweep, not the policy, set the limit
        _row("c", 1.0, 1.0),
        _row("c", 2.0, 0.97),
        # d: an error row is a failure
        _row("d", 1.0, 0.99),
        _row("d", 2.0, None, error="PolicyError: boom"),
    ]
    got = max_sustained_rate(rows, 0.9)
    assert got["a"] == {"rate_rps": 2.0, "first_failing_rate_rps": 4.0, "limited_by_sweep": False}
    assert got["b"] == {"rate_rps": None, "first_failing_rate_rps": 1.0, "limited_by_sweep": False}
    assert got["c"] == {"rate_rps": 2.0, "first_failing_rate_rps": None, "limited_by_sweep": True}
    assert got["d"]["rate_rps"] == 1.0
    # the threshold is a parameter: at 0.96 policy a is sustained only at 1 req/s
    assert max_sustained_rate(rows, 0.96)["a"]["rate_rps"] == 1.0


def test_table_has_a_line_per_row():
    rows = [_row("a", 1.0, 0.9), _row("b", 2.5, None, error="X: y")]
    text = format_table(rows, slo=True).splitlines()
    assert len(text) == 4 and text[0].split()[:2] == ["policy", "rate/s"]
    assert text[2].split()[:2] == ["a", "1"] and "90%" in text[2]
    assert "error" in text[3]


# ---------------------------------------------------------------- the CLI


def sweep_cmd(*args):
    return [
        sys.executable,
        "-c",
        "import sys; from schedlab.commands.sweep import main; sys.argv[0] = 'sweep'; main()",
        *map(str, args),
    ]


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    p = tmp_path_factory.mktemp("prof") / "prof.json"
    p.write_text(json.dumps({"schema": "schedlab-profile/1", "model": "test", "coefficients": COEFFS}))
    return p


@pytest.mark.slow
def test_cli_prints_table_writes_csv_json_and_figures(tmp_path, profile, cost):
    trace = write_trace(tmp_path / "t.json", small_trace())
    out = tmp_path / "out"
    p = subprocess.run(
        sweep_cmd(
            "--policy",
            "chunked-prefill,unified",
            "--trace",
            trace,
            "--rates",
            "8,1,3",
            "--profile",
            profile,
            "--workers",
            "2",
            "--slo",
            "ttft_ms=400,tpot_ms=60",
            "--out",
            out,
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert {f.name for f in out.iterdir()} == {"sweep.csv", "sweep.json", "latency_vs_load.png", "latency_vs_load.svg"}
    assert (out / "latency_vs_load.png").read_bytes().startswith(PNG_MAGIC)
    assert ET.fromstring((out / "latency_vs_load.svg").read_bytes()).tag.endswith("svg")
    data = json.loads((out / "sweep.json").read_text())
    assert data["rates_rps"] == [1.0, 3.0, 8.0] and data["slo"] == {"ttft_ms": 400.0, "tpot_ms": 60.0}
    with open(out / "sweep.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(data["rows"]) == 6
    direct = {
        (r["policy"], r["rate_rps"]): r
        for r in sweep(small_trace(), ["chunked-prefill", "unified"], [1.0, 3.0, 8.0], cost, 262144, slo=SLO, workers=1)
    }
    for c, j in zip(csv_rows, data["rows"]):
        want = direct[(j["policy"], j["rate_rps"])]
        assert float(c["ttft_p99_ms"]) == pytest.approx(want["ttft_p99_ms"], rel=1e-12)
        assert j["goodput_rps"] == pytest.approx(want["goodput_rps"], rel=1e-12)
        assert float(c["slo_attainment"]) == pytest.approx(want["slo_attainment"], rel=1e-12)
    assert data["max_sustained_rate"] == max_sustained_rate(list(direct.values()), 0.9)
    lines = p.stdout.splitlines()
    assert sum(1 for line in lines if line.startswith(("chunked-prefill ", "unified "))) == 6
    assert "Highest sustained rate" in p.stdout


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--rates", "0,1"], "every rate must be a finite number > 0"),
        (["--rates", "fast"], "'fast' is not a number"),
        (["--slo", "ttft_s=3"], "unknown SLO key 'ttft_s'"),
        (["--attainment", "1.5"], "--attainment must be in (0, 1]"),
        (["--trace", "/no/such/trace.json"], "trace not found"),
        (["--trace", "ONE"], "cannot set a rate"),
        (["-o", "budget=abc"], "budget='abc' is not a valid int"),
        (["--profile", "/no/profile.json"], "profile not found"),
        (["--executor", "dask"], "unknown executor 'dask': choose local or ray"),
        (["--ray-address", "127.0.0.1:6379"], "--ray-address goes with the ray executor"),
        (["--executor", "ray", "--ray-address", "nowhere"], "'nowhere' is not host:port or ray://host:port"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path, profile, args, expect):
    trace = write_trace(tmp_path / "t.json", small_trace())
    one = write_trace(tmp_path / "one.json", traces.Trace("one", "", [traces.Request("x", 0.0, 5, 5)]))
    base = {"--policy": "chunked-prefill", "--trace": str(trace), "--rates": "1,2", "--profile": str(profile)}
    args = [str(one) if a == "ONE" else a for a in args]
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    flat = [x for kv in base.items() for x in kv]
    p = subprocess.run(sweep_cmd(*flat, "--out", tmp_path / "o", "-q"), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sweep: error:"), p.stderr
    assert expect in lines[0]
    assert not (tmp_path / "o").exists()


def _workers_of(pid: int) -> dict[int, int]:
    """The sweep's worker processes (spawned by multiprocessing: children of ``pid`` running
    ``spawn_main``; Linux /proc), each with its ignored-signals mask."""
    kids = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                argv = (d / "cmdline").read_bytes()
                status = (d / "status").read_text()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == pid and state != "Z" and b"spawn_main" in argv:
                ign = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:"))
                kids[int(d.name)] = int(ign, 16)
    return kids


def _running(pids) -> list[int]:
    """Those of ``pids`` still running a worker (not gone, not a zombie, not a reused id)."""
    alive = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z" and b"spawn_main" in argv:
            alive.append(pid)
    return alive


def test_ctrl_c_cancels_cleanly(tmp_path, profile):
    # a sweep long enough to be interrupted: 6 jobs over a 4000-request trace
    reqs = [traces.Request(f"r{i}", i * 0.25, 200 + (i * 37) % 500, 40 + (i * 13) % 120) for i in range(4000)]
    trace = write_trace(tmp_path / "big.json", traces.Trace("big", "", reqs))
    err_path = tmp_path / "err.txt"
    with open(err_path, "w") as err:
        p = subprocess.Popen(
            sweep_cmd(
                "--policy",
                "chunked-prefill,unified",
                "--trace",
                trace,
                "--rates",
                "1,2,4",
                "--profile",
                profile,
                "--workers",
                "2",
                "--out",
                tmp_path / "o",
            ),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
            # Ctrl-C as in a terminal: a test run started in the background of a script inherits
            # SIGINT ignored, and the sweep would too (rightly ignoring it)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 60
        while err_path.stat().st_size == 0 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)  # the start line comes once the worker processes exist
        # both workers up (likely still importing): Ctrl-C now must not make them print
        workers = _workers_of(p.pid)
        while len(workers) < 2 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.01)
            workers = _workers_of(p.pid)
        assert p.poll() is None, "the sweep finished before it could be interrupted"
        assert len(workers) == 2, workers
        # they ignore SIGINT from their first instruction on (inherited through exec), not only
        # once their initializer has run: the parent alone answers a Ctrl-C
        sigint = 1 << (signal.SIGINT - 1)
        assert all(mask & sigint for mask in workers.values()), {w: hex(m) for w, m in workers.items()}
        os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
        out, _ = p.communicate(timeout=30)
    # the parent stopped its workers (and waited for them) before it exited: none is left running
    assert not _running(workers), _running(workers)
    text = err_path.read_text()
    assert p.returncode == 130, text
    assert "Traceback" not in text, text
    lines = text.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("sweep: 2 policies x 3 rates")
    assert lines[1].startswith("sweep: interrupted:") and "of 6 simulations done" in lines[1]
    assert not (tmp_path / "o").exists()
