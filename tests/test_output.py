"""The run directory's tables are built as columns (no per-row Python): they must hold exactly
what the loop's logs hold, row for row."""

from __future__ import annotations

import pytest

from schedlab import traces
from schedlab.policies import make_policy
from schedlab.sim import run_replica
from schedlab.sim.output import passes_table, steps_table, tokens_table
from simkit import cost_model


@pytest.mark.parametrize("policy", ["static", "unified", "chunked-prefill", "vllm"])
def test_tables_hold_every_logged_row_in_order(policy):
    tr = traces.load("mixed.json").requests
    res = run_replica(tr, make_policy(policy), cost_model(), kv_capacity=200_000, block_size=16)
    # Plan.repeat runs log the same Pass object many times in a row: the table expands each
    assert len(res.passes) > len({id(p) for *_, p in res.passes})
    expected = []
    for step, k, start, end, p in res.passes:
        expected += [(step, k, rid, "decode", 1, start, end) for rid in p.decode]
        expected += [(step, k, rid, "prefill", n, start, end) for rid, n in p.prefill]
    t = passes_table(res.requests, res.passes).to_pydict()
    got = list(zip(t["step"], t["pass"], t["request_id"], t["kind"], t["tokens"], t["start_s"], t["end_s"]))
    assert got == expected
    assert any(e[3] == "prefill" for e in expected)

    tok = tokens_table(res).to_pydict()
    assert list(zip(tok["request_id"], tok["token_index"], tok["time_s"])) == [
        (r.id, i, t) for r in res.requests for i, t in enumerate(r.token_times)
    ]

    st = steps_table(res.steps).to_pydict()
    assert [tuple(st[c][i] for c in st) for i in range(len(res.steps))] == [tuple(s) for s in res.steps]


def test_token_index_restarts_at_every_request_with_tokens_whatever_lies_between():
    """tokens.parquet's token_index counts within each request, also next to requests with no
    token (rejected, unfinished) first, in between and last."""
    from types import SimpleNamespace

    times = [[], [1.0, 2.0, 3.0], [], [], [4.0], [5.0, 6.0], []]
    reqs = [SimpleNamespace(id=f"r{i}", token_times=t) for i, t in enumerate(times)]
    tok = tokens_table(SimpleNamespace(requests=reqs)).to_pydict()
    assert list(zip(tok["request_id"], tok["token_index"], tok["time_s"])) == [
        ("r1", 0, 1.0),
        ("r1", 1, 2.0),
        ("r1", 2, 3.0),
        ("r4", 0, 4.0),
        ("r5", 0, 5.0),
        ("r5", 1, 6.0),
    ]
    empty = tokens_table(SimpleNamespace(requests=reqs[:1])).to_pydict()
    assert empty["token_index"] == [] and empty["time_s"] == []


def test_step_log_runs_read_the_same_as_arrays_and_as_records():
    """Runs of repeated steps are kept as blocks: wherever they fall among the plain steps
    (first, back to back, last), the arrays and the records agree with the steps logged one by one."""
    from schedlab.sim.loop import StepLog

    log = StepLog()
    plain = lambda i, t: (i, t, t + 0.5, 0.5, None, 3, 7, 2, 100 + i)  # noqa: E731
    log.add_run(0, 0.0, [1.0, 2.0], [1.0, 1.0], 4, 10)  # before any plain step
    for c, v in zip(log._lists, plain(2, 2.0)):
        c.append(v)
    log.add_run(3, 2.5, [3.0], [0.5], 5, 20)
    log.add_run(4, 3.0, [4.5, 6.0, 7.5], [1.5, 1.5, 1.5], 5, 25)  # back to back
    for c, v in zip(log._lists, plain(7, 7.5)):
        c.append(v)
    log.add_run(8, 8.0, [9.0], [1.0], 1, 0)  # last
    assert len(log) == 9
    arrays = log.arrays()
    expected = [
        (0, 0.0, 1.0, 1.0, None, 4, 0, 1, 14),
        (1, 1.0, 2.0, 1.0, None, 4, 0, 1, 18),
        plain(2, 2.0),
        (3, 2.5, 3.0, 0.5, None, 5, 0, 1, 25),
        (4, 3.0, 4.5, 1.5, None, 5, 0, 1, 30),
        (5, 4.5, 6.0, 1.5, None, 5, 0, 1, 35),
        (6, 6.0, 7.5, 1.5, None, 5, 0, 1, 40),
        plain(7, 7.5),
        (8, 8.0, 9.0, 1.0, None, 1, 0, 1, 1),
    ]
    assert [tuple(c[i] if isinstance(c, list) else c[i].item() for c in arrays) for i in range(9)] == expected
    assert [tuple(s) for s in log] == expected and len(log) == 9  # the records, the blocks put in
    assert [tuple(c[i] if isinstance(c, list) else c[i].item() for c in log.arrays()) for i in range(9)] == expected
