"""The shared request state machine: it checks every plan and applies it exactly."""

from __future__ import annotations

import pytest

from schedlab.policies.base import Pass, Plan
from schedlab.sim.cost import LinearCostModel, pass_features
from schedlab.sim.state import PlanError, ReplicaState
from simkit import KNOWN, Bench, req


def raises_plan(b: Bench, plan: Plan, match: str):
    with pytest.raises(PlanError, match=match) as info:
        b.apply(plan)
    msg = str(info.value)
    assert msg.startswith("policy 'test' step ") and "\n" not in msg
    return msg


def test_decoding_a_request_that_is_not_decoding():
    b = Bench([req("a", 10, 5), req("b", 10, 5)])
    raises_plan(b, Plan(passes=(Pass(decode=("a",)),)), "decodes request a which is waiting")
    b.prefilling("b", 3)
    raises_plan(
        b, Plan(passes=(Pass(decode=("b",)),)), "decodes request b which is prefilling with 7 prompt tokens left"
    )


def test_prefilling_past_the_prompt_and_bad_chunks():
    b = Bench([req("a", 10, 5)])
    b.prefilling("a", 4)
    raises_plan(b, Plan(passes=(Pass(prefill=(("a", 7),)),)), "prefills 7 tokens of request a which has 6")
    raises_plan(b, Plan(passes=(Pass(prefill=(("a", 0),)),)), "has 0 tokens")
    raises_plan(b, Plan(passes=(Pass(prefill=(("a", 2), ("a", 2))),)), "appears twice")
    raises_plan(b, Plan(passes=(Pass(prefill=(("zz", 2),)),)), "unknown request 'zz'")


def test_admitting_twice_and_prefilling_unadmitted():
    b = Bench([req("a", 10, 5)])
    raises_plan(b, Plan(passes=(Pass(prefill=(("a", 2),)),)), "prefills request a which is waiting")
    b.prefilling("a", 0)
    raises_plan(b, Plan(admit=("a",)), "admits request a which is prefilling")


def test_kv_capacity_is_enforced_per_pass():
    b = Bench([req("a", 60, 5), req("b", 60, 5)], kv_capacity=100)
    b.prefilling("a", 60)
    msg = raises_plan(b, Plan(admit=("b",), passes=(Pass(prefill=(("b", 41),)),)), "needs 101 KV tokens")
    assert "capacity is 100" in msg


def test_requests_larger_than_capacity_are_rejected_up_front():
    st = ReplicaState([req("ok", 50, 10), req("huge", 95, 10)], kv_capacity=100, policy_name="p")
    assert [r.id for r, _ in st.rejected] == ["huge"]
    assert "needs 104 KV tokens" in st.rejected[0][1]
    assert [r.id for r in st.accepted] == ["ok"]


def test_token_accounting_prefill_then_decode():
    b = Bench([req("a", 10, 3)])
    r = b.decoding("a")
    assert (r.generated, r.kv_tokens, r.first_token_s) == (1, 10, b.t)
    b.apply(Plan(passes=(Pass(decode=("a",)),)))
    assert (r.generated, r.kv_tokens) == (2, 11)
    done = b.apply(Plan(passes=(Pass(decode=("a",)),)))
    assert done == [r] and r.phase.value == "finished" and r.finish_s == b.t
    assert len(r.token_times) == 3 and r.token_times[-1] == r.finish_s
    assert b.state.kv_used == 0 and b.state.kv_reserved == 0


def test_preemption_recomputes_prompt_plus_output():
    b = Bench([req("a", 10, 6)])
    r = b.decoding("a")
    b.apply(Plan(passes=(Pass(decode=("a",)),)))  # 2 tokens out, KV holds 11
    assert b.state.kv_used == 11
    b.apply(Plan(preempt=("a",)))
    assert r.phase.value == "waiting" and b.state.kv_used == 0 and r.preemptions == 1
    # re-admitted, it prefills prompt + generated (12 tokens) and the pass yields token 3
    b.apply(Plan(admit=("a",), passes=(Pass(prefill=(("a", 12),)),)))
    assert r.generated == 3 and r.kv_tokens == 12 and b.state.kv_used == 12
    assert r.first_token_s < r.token_times[-1]  # TTFT kept from the first time around
    while r.phase.value != "finished":
        b.apply(Plan(passes=(Pass(decode=("a",)),)))
    assert r.generated == 6 and len(r.token_times) == 6


def test_token_times_follow_each_row_in_and_out_of_the_batch():
    # The batch's rows share one list of pass ends (a row's times are copied in when read or
    # when it leaves): a row parked out of the batch, one rejoining, one preempted from it and
    # one handed off from prefilling must each get exactly the ends of the passes it was in.
    b = Bench([req("a", 10, 9), req("b", 10, 9), req("c", 10, 9), req("h", 10, 5)])
    st = b.state
    a, bb, c = (b.decoding(x) for x in "abc")  # one token each from their prefill
    h = b.prefilling("h", 9)  # one prompt token left: it joins by a hand-off
    want = {x: [x.token_times[0]] for x in (a, bb, c)}

    def dec(*rows):
        b.apply(Plan(passes=(Pass(decode=rows),)))
        for x in rows:
            want.setdefault(st.by_id[x], []).append(b.t)

    dec("a", "b", "c")
    dec("a", "b", "c")
    assert a.token_times == want[a]  # read while it is still in the batch
    dec("a", "c")  # b is parked: it leaves the batch, still decoding
    dec("a", "c", "h")  # h handed off: its first token comes from this pass
    assert h.first_token_s == b.t and h.token_times == [b.t]
    dec("a", "b", "c", "h")  # b rejoins
    b.apply(Plan(preempt=("c",)))  # c leaves the batch by preemption
    dec("a", "b", "h")
    for x in (a, bb, c, h):
        assert x.token_times == want[x], x.id
    assert st.batch == {"a", "b", "h"}
    while a.phase.value != "finished":
        dec("a", "b", "h")
    assert a.token_times == want[a] and len(a.token_times) == 9 and a.token_times[-1] == a.finish_s
    assert bb.token_times == want[bb] and h.token_times == want[h]


def test_finishing_and_new_block_counts_equal_a_count_over_the_rows():
    # shape() looks the batch's finishing rows and block-starting rows up instead of counting
    # them (sim.state: _by_end, _by_offset, kept as rows join and leave): drive a replica at
    # block size 4 through joins, parks, rejoins, hand-offs, preemptions and EOS stops in a
    # fixed random order and check every decode pass's counts against a count over its rows.
    import random

    rng = random.Random(7)
    reqs = [req(f"r{i}", rng.randint(3, 40), rng.randint(2, 30)) for i in range(80)]
    b = Bench(reqs, block_size=4)
    st = b.state
    checked = stops = preempts = parks = 0
    for _ in range(1000):
        waiting = [r.id for r in st.waiting_q]
        prefilling = [r for r in st.prefilling_q]
        decoding = [r.id for r in st.decoding_q]
        if waiting and rng.random() < 0.3:
            b.apply(Plan(admit=(waiting[0],)))
            continue
        if decoding and rng.random() < 0.05:
            b.apply(Plan(preempt=(rng.choice(decoding),)))
            preempts += 1
            continue
        rows = [x for x in decoding if rng.random() < 0.9]  # the others are parked
        parks += len(decoding) - len(rows)
        chunks = []
        for r in prefilling:
            left = r.prefill_target - r.prefilled
            if left == 1 and rng.random() < 0.5:
                rows.append(r.id)  # hand-off: its last prompt token is the decode input
            else:
                chunks.append((r.id, min(left, rng.randint(1, 12))))
        if not rows and not chunks:
            if not waiting and not prefilling and not decoding:
                break
            continue
        p = Pass(decode=tuple(rows), prefill=tuple(chunks))
        st.apply_admin(Plan(), b.t)
        shape = st.shape(p)
        new, finishing = st._shaped.new_blocks, st._shaped.finishing
        ctxs = [st.by_id[x].context for x in rows]
        assert finishing == sum(st.by_id[x].tokens_left == 1 for x in rows)
        want = sum(c % 4 == 1 for c in ctxs)
        for rid, n in chunks:
            p0 = st.by_id[rid].prefilled
            want += -(-(p0 + n) // 4) - -(-p0 // 4)
        assert new == want
        if rows:  # (a pass without decode rows leaves the batch as it is)
            assert shape.leaves == len(st.batch) - (len(rows) - shape.joins) + finishing
        if rows and rng.random() < 0.1:  # EOS: the row's token from this pass is its last
            st.stop(rng.choice(rows))
            stops += 1
        b.t += 0.01
        st.apply_pass(p, b.t)
        st.step_index += 1
        checked += bool(rows)
    assert checked > 100 and stops and preempts and parks
    assert st.finished > 20


def test_shape_reports_contexts_joins_and_leaves():
    b = Bench([req("a", 10, 2), req("b", 20, 9), req("c", 30, 9)])
    for rid in "abc":
        b.decoding(rid)
    st = b.state
    s = st.shape(Pass(decode=("a", "b")))
    assert s.decode_contexts == (11, 21) and s.joins == 2 and s.batch_rows_before == 0
    assert s.join_context == 11 + 21  # both rows' own caches are merged
    assert s.leaves == 1  # a finishes in this pass and is filtered out
    b.apply(Plan(passes=(Pass(decode=("a", "b")),)))
    assert st.batch == {"b"}
    s = st.shape(Pass(decode=("b", "c")))
    assert (s.batch_rows_before, s.joins, s.leaves) == (1, 1, 0)
    assert s.join_context == st.by_id["c"].context  # only the newcomer's cache is merged
    assert st.shape(Pass(decode=("b",))).join_context == 0
    s = st.shape(Pass(decode=("c",)))  # b would be parked: it leaves the batch
    assert (s.batch_rows_before, s.joins, s.leaves) == (1, 1, 1)


def test_cost_model_features_and_prediction_agree():
    """The fast pass_seconds and the feature vector the fit uses are the same function."""
    from schedlab.sim.cost import FEATURES

    from schedlab.sim.cost import IDLE_CAP_S, idle_features, step_features

    known = {
        **KNOWN,
        "c_join_row": 3e-5,
        "c_leave_row": 2e-5,
        "c_join_ctx": 3e-7,
        "c_extend": 5e-8,
        "s_pass": 1e-4,
        "i_wake": 2e-4,
        "i_step": 1e-3,
        "i_gap": 4e-3,
        "i_after": 7e-4,
        "d_few": 4e-4,
        "d_kv_long": 6e-7,
        "p_small": 3e-5,
        "v_pass": 2e-3,
        "v_tokens": 4e-4,
        "v_attn": 9e-7,
    }
    assert set(known) == set(FEATURES)  # every term is exercised below
    cm = LinearCostModel(dict(known))
    for n_passes, rows in ((1, 1), (2, 9)):
        f = step_features(n_passes, rows)
        assert cm.step_overhead_seconds(n_passes, rows) == pytest.approx(sum(known[k] * v for k, v in f.items()))
    for idle in (0.01, 0.5, 3.0):
        f = idle_features(idle)
        assert f == {"i_step": 1.0, "i_gap": min(idle, IDLE_CAP_S)}
        assert cm.idle_seconds(idle) == pytest.approx((known["i_wake"], sum(known[k] * v for k, v in f.items())))
    from schedlab.sim.cost import AFTER_WAKE_STEPS, after_wake_features

    for k in range(AFTER_WAKE_STEPS + 3):
        f = after_wake_features(k)
        assert cm.after_wake_seconds(k) == pytest.approx(known["i_after"] * f["i_after"])
        assert f["i_after"] == (0.5 ** (k - 1) if 1 <= k <= AFTER_WAKE_STEPS else 0.0)  # the wake's own step: 0
    KNOWN_ = known
    b = Bench([req(i, 50 + 10 * i, 20) for i in range(6)])
    for i in range(3):
        b.decoding(i)
    b.prefilling(3, 10)
    b.prefilling(4, 0)
    shapes = [
        b.state.shape(Pass(decode=("0", "1"))),
        b.state.shape(Pass(decode=("2",))),
        b.state.shape(Pass(prefill=(("3", 20), ("4", 64)), padded=True)),
        b.state.shape(Pass(prefill=(("3", 20), ("4", 64)))),
        b.state.shape(Pass(decode=("0", "1", "2"), prefill=(("4", 7),))),
    ]
    b.apply(Plan(passes=(Pass(decode=("0", "1", "2")),)))
    shapes.append(b.state.shape(Pass(decode=("0", "1"))))  # 2 leaves (parked) the batch
    assert shapes[-1].leaves == 1 and pass_features(shapes[-1])["c_leave"] > 0
    b.decoding(5)
    shapes.append(b.state.shape(Pass(decode=("0", "1", "2", "5"))))  # 5 joins the batch: extend
    f = pass_features(shapes[-1])
    assert f["c_join_ctx"] == shapes[-1].join_context == b.state.by_id["5"].context
    assert f["c_extend"] == f["c_join"] == 4 * max(shapes[-1].decode_contexts)
    assert pass_features(shapes[0])["c_extend"] == 0 < pass_features(shapes[0])["c_join"]  # a merge from nothing
    from schedlab.sim.cost import FEW_ROWS, KV_KNEE

    long = Bench([req(i, KV_KNEE + 40 * i, 20) for i in range(6)])
    for i in range(6):
        long.decoding(i)
    for ids in (("0",), ("1",), ("0", "1", "2"), ("0", "1", "2", "3", "4", "5")):
        s = long.state.shape(Pass(decode=ids))
        f = pass_features(s)
        assert f["d_few"] == min(len(ids), FEW_ROWS) - 1
        assert f["d_kv_long"] == len(ids) * max(max(s.decode_contexts) - KV_KNEE, 0)
        shapes.append(s)
    assert pass_features(shapes[-1])["d_kv_long"] > 0
    s = long.state.shape(Pass(decode=("0", "1", "2"), draft=(3, 0, 1)))  # verify rows: padded to the widest
    f = pass_features(s)
    assert (f["v_pass"], f["v_tokens"], f["v_attn"]) == (1, 3 * 3, 3 * 3 * max(s.decode_contexts))
    assert pass_features(long.state.shape(Pass(decode=("0", "1", "2"))))["v_tokens"] == 0
    shapes.append(s)
    for s in shapes:
        f = pass_features(s)
        assert cm.pass_seconds(s) == pytest.approx(sum(KNOWN_[k] * v for k, v in f.items()), rel=1e-12)
    padded, unpadded = shapes[2], shapes[3]
    assert pass_features(padded)["p_tokens"] == 2 * 64  # rows x longest
    assert pass_features(unpadded)["p_tokens"] == 84
    # one batched forward vs one forward per chunk: padding trades waste for dispatches
    assert (pass_features(padded)["p_pass"], pass_features(unpadded)["p_pass"]) == (1, 2)
