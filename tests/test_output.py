"""The run directory's tables are built as columns (no per-row Python): they must hold exactly
what the loop's logs hold, row for row."""

from __future__ import annotations

import pytest

import traces
from policies import make_policy
from sim import run
from sim.output import passes_table, steps_table, tokens_table
from simkit import cost_model


@pytest.mark.parametrize("policy", ["static", "unified", "chunked-prefill", "vllm"])
def test_tables_hold_every_logged_row_in_order(policy):
    tr = traces.load("mixed.json").requests
    res = run(tr, make_policy(policy), cost_model(), kv_capacity=200_000, block_size=16)
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
        (r.id, i, t) for r in res.requests for i, t in enumerate(r.token_times)]

    st = steps_table(res.steps.columns).to_pydict()
    assert [tuple(st[c][i] for c in st) for i in range(len(res.steps))] == [tuple(s) for s in res.steps]
