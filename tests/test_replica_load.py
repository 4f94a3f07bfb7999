"""The per-replica load figure (``plot``'s ``replica_load``) of a cluster's run: one line per
replica whose value at any time is the number of that replica's requests that requests.csv says
had arrived and not finished (rejected ones never count); many replicas as a band; none for a
single replica's run."""

from __future__ import annotations

import subprocess

import numpy as np

import schedlab
from schedlab import ClusterOptions, ReplicaGroup
from schedlab.traces.schema import Request
from simkit import command, read_table

REQS = [Request(f"q{i}", i * 0.02, 60 + (i * 37) % 400, 8 + (i * 13) % 40) for i in range(48)]


def expected(rows: list[dict], replica: int, t: float) -> int:
    """Requests of ``replica`` arrived at ``t`` and not finished by then, from requests.csv's rows."""
    return sum(
        1
        for r in rows
        if int(r["replica"]) == replica
        and r["status"] != "rejected"
        and float(r["arrival_s"]) <= t
        and not (r["finish_s"] != "" and float(r["finish_s"]) <= t)
    )


def value_at(line, t: float) -> float:
    """A step line's value (drawn 'post': each value holds until the next x) at ``t``."""
    x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
    i = np.searchsorted(x, t, "right") - 1
    return float(y[i]) if i >= 0 else 0.0


def probes(rows: list[dict]) -> list[float]:
    """Every arrival and finish, the midpoints between them, and before and after them all."""
    ts = sorted({float(r["arrival_s"]) for r in rows} | {float(r["finish_s"]) for r in rows if r["finish_s"]})
    return [ts[0] - 1, *ts, *((a + b) / 2 for a, b in zip(ts, ts[1:])), ts[-1] + 1]


def test_one_line_per_replica_that_counts_what_requests_csv_says(tmp_path):
    cluster = ClusterOptions(
        router="round-robin",
        groups=[ReplicaGroup("unified", 2), ReplicaGroup("vllm", kv_tokens=300, options={"max_num_seqs": 2})],
    )
    run = schedlab.simulate(None, REQS, cluster=cluster)
    out = run.save(tmp_path / "run")
    rows = read_table(out / "requests.csv")
    assert any(r["status"] == "rejected" for r in rows)  # (replica 2's small KV: these never count)
    proc = subprocess.run(
        [*command("plot"), str(out), "--out", str(tmp_path / "plots"), "-f", "png"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert str(tmp_path / "plots" / "replica_load.png") in proc.stdout.split()
    assert (tmp_path / "plots" / "replica_load.png").stat().st_size > 0

    fig = schedlab.plot(out, kinds="replica_load")["replica_load"]
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [ln.get_label() for ln in lines] == [
        "replica 0 (group 1: unified)",
        "replica 1 (group 1: unified)",
        "replica 2 (group 2: vllm)",
    ]
    peak = 0
    for j, line in enumerate(lines):
        for t in probes(rows):
            want = expected(rows, j, t)
            assert value_at(line, t) == want, (j, t)
            peak = max(peak, want)
    assert peak > 2  # (the replicas held several requests at once)
    # a single replica's run has no such figure
    one = schedlab.simulate("vllm", REQS).save(tmp_path / "one")
    assert "replica_load" not in schedlab.plot(one, kinds=("ttft", "replica_load"))


def test_many_replicas_are_a_band_and_a_median(tmp_path):
    reqs = [Request(f"r{i}", i * 0.01, 200 + (i * 53) % 300, 20 + (i * 7) % 30) for i in range(120)]
    out = schedlab.simulate("vllm", reqs, replicas=10, router="least-requests").save(tmp_path / "run")
    rows = read_table(out / "requests.csv")
    (ax,) = schedlab.plot(out, kinds="replica_load")["replica_load"].axes
    (median,) = ax.get_lines()
    assert median.get_label() == "median" and len(ax.collections) == 1  # (the min-max band)
    for t in probes(rows):
        counts = [expected(rows, j, t) for j in range(10)]
        assert value_at(median, t) == np.median(counts), t
