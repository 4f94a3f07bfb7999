"""Cancellation: a request whose client goes away (``Request.cancel_after_s``, or
``ReplicaLoop.cancel`` from a live server) is ended at the first step that starts at or after
that time, waiting, prefilling or decoding; its KV is freed at once and a partial prefill stops
taking budget; on a hybrid model (a recurrent state per request) that state is freed with its KV.
A request with an empty prompt is refused in one line and wedges nothing (seed PR 002's two bugs,
a chunked prefill on a hybrid Qwen3.5). Real SimPy, the real state machine and the bundled policies."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from simkit import KNOWN, cost_model, req

from schedlab import SchedlabError, simulate, traces
from schedlab.policies import POLICIES, make_policy
from schedlab.sim import metrics
from schedlab.sim.cost import LinearCostModel
from schedlab.sim import run_replica
from schedlab.traces.schema import Trace

# A Qwen3.5-like hybrid (seed 002's model): 8 full-attention layers of 4 KV heads x 256 at 16 bits
# (32 KiB of KV per token), 24 Gated DeltaNet layers each holding, per request, 3 convolution inputs
# of 8192 channels at 16 bits and a 32 x 128 x 128 float32 recurrent state: 1572 tokens of capacity
QWEN35_LAYOUT = {
    "kv_bytes_per_token": 8 * 2 * 4 * 256 * 2,
    "sliding": [],
    "state_bytes": 24 * (3 * 8192 * 2 + 32 * 128 * 128 * 4),
}


def layout_cost(layout):
    """The known cost model, told the model's cache layout (a profile's ``cache_layout``)."""
    return LinearCostModel(KNOWN, meta={"cache_layout": layout}) if layout else cost_model()


def _steps_with(res, rid):
    """The steps whose passes prefill or decode ``rid``: their start times."""
    out = []
    for step, _, start, _, p in res.passes:
        if rid in p.decode or any(x == rid for x, _ in p.prefill):
            out.append(start)
    return out


@pytest.mark.parametrize("layout", [None, QWEN35_LAYOUT], ids=["plain", "hybrid"])
def test_a_partial_prefill_stops_taking_budget_and_frees_its_kv_at_once(layout):
    # a 3000-token prompt in 256-token chunks (~12 steps) next to a short request decoding; on the
    # hybrid each also holds its recurrent state's blocks from its admission to its end
    reqs = [req("long", 3000, 20), req("short", 10, 400)]
    base = run_replica(reqs, make_policy("chunked-prefill", {"budget": 256}), layout_cost(layout), kv_capacity=100_000)
    long_steps = _steps_with(base, "long")
    at = long_steps[4]  # the long prompt is mid-prefill
    assert base.requests[0].first_token_s > at
    reqs[0] = replace(reqs[0], cancel_after_s=at)
    kv_after = []
    held = []

    def watch(state):
        if state.by_id["long"].cancelled_s is not None:
            kv_after.append((state.kv_used, state.by_id["short"].kv_tokens, state.kv_reserved, state.blocks_used))
        elif state.by_id["long"].prefilled:
            held.append((state.kv_used, state.by_id["long"].kv_tokens, state.by_id["short"].kv_tokens))

    policy = make_policy("chunked-prefill", {"budget": 256})
    res = run_replica(reqs, policy, layout_cost(layout), kv_capacity=100_000, on_step=watch)
    assert res.error is None
    long, short = res.requests
    fixed = 1572 if layout else 0  # the recurrent state, in tokens of capacity
    assert long.fixed_tokens == short.fixed_tokens == fixed
    # mid-prefill, until its cancellation, it held its chunks' KV and its state beside the short one's
    used, long_kv, short_kv = held[-1]
    assert used == long_kv + short_kv + 2 * fixed and long_kv >= 4 * 256
    assert long.cancelled_s is not None and long.cancelled_s >= at
    assert long.first_token_s is None and long.output_tokens == 0 and long.token_times == []
    # no pass computes it once its cancellation is due, and it was computing until then
    # (the step that started before it ran its chunk; the cancellation is due at the next one)
    assert all(t <= at for t in _steps_with(res, "long")) and len(_steps_with(res, "long")) == 5
    # from the first step after it, the only KV held is the short request's own (its KV and state)
    used, short_kv, reserved, blocks = kv_after[0]
    assert used == blocks == short_kv + fixed and reserved == short.prompt_tokens + short.output_tokens - 1 + fixed
    # the other request is untouched in what it produces, and finishes sooner without the long one
    assert short.cancelled_s is None and len(short.token_times) == 400
    assert short.finish_s < base.requests[1].finish_s
    table = {row[0]: row for row in metrics.request_table(res)}
    assert table["long"][10] == "cancelled" and table["short"][10] == "finished"
    summary = metrics.summarize(res)
    assert summary["cancelled"] == 1 and summary["finished"] == 1


def test_cancelled_while_waiting_and_mid_decode_under_every_bundled_policy():
    reqs = [req(i, 300, 60, arrival=0.01 * i) for i in range(6)]
    for name in ("mlx-default", "prefer-prefill", "static", "slots", "chunked-prefill", "unified", "vllm"):
        opts = {"batch_size": 2} if name == "static" else {"n_slots": 2} if name == "slots" else {}
        base = run_replica(reqs, make_policy(name, opts), cost_model(), kv_capacity=100_000)
        one = base.requests[1]
        mid = (one.first_token_s + one.finish_s) / 2 - one.arrival_s  # request 1 is decoding then
        cut = list(reqs)
        cut[1] = replace(reqs[1], cancel_after_s=mid)
        cut[5] = replace(reqs[5], cancel_after_s=0.0)  # gone before any step could serve it
        res = run_replica(cut, make_policy(name, opts), cost_model(), kv_capacity=100_000)
        assert res.error is None, (name, res.error)
        by = {r.id: r for r in res.requests}
        assert by["5"].cancelled_s is not None and by["5"].token_times == [], name
        one = by["1"]
        assert one.cancelled_s is not None and one.cancelled_s >= one.arrival_s + mid, name
        assert 0 < len(one.token_times) == one.output_tokens < 60 and max(one.token_times) <= one.cancelled_s, name
        for rid in ("0", "2", "3", "4"):
            assert by[rid].cancelled_s is None and len(by[rid].token_times) == 60, (name, rid)
        assert metrics.summarize(res)["cancelled"] == 2


def test_a_cancellation_after_the_end_changes_nothing():
    reqs = [req(i, 100, 30, arrival=0.02 * i) for i in range(4)]
    base = run_replica(reqs, make_policy("vllm"), cost_model(), kv_capacity=100_000)
    late = [replace(r, cancel_after_s=100.0) for r in reqs]
    res = run_replica(late, make_policy("vllm"), cost_model(), kv_capacity=100_000)
    assert [r.token_times for r in res.requests] == [r.token_times for r in base.requests]
    assert list(res.steps) == list(base.steps)


def test_a_trace_carries_its_cancellations_and_bad_values_are_one_line(tmp_path):
    t = Trace("t", requests=[replace(req("a", 5, 5), cancel_after_s=1.5), req("b", 5, 5, arrival=1.0)])
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t.to_json()))
    back = traces.load(str(path))
    assert [r.cancel_after_s for r in back.requests] == [1.5, None]
    for bad in (-1, "soon", True, float("inf")):
        row = {"id": "a", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5, "cancel_after_s": bad}
        path.write_text(json.dumps({"name": "t", "requests": [row]}).replace("Infinity", "1e999"))
        try:
            traces.load(str(path))
        except traces.TraceError as exc:
            msg = str(exc)
            assert "cancel_after_s" in msg and "\n" not in msg
        else:
            raise AssertionError(f"cancel_after_s {bad!r} was accepted")


def test_an_empty_prompt_is_refused_in_one_line_and_wedges_nothing(tmp_path):
    """A request of 0 prompt tokens (seed PR 002's first bug: admitted into a chunked prefill with
    nothing to prefill, it stayed at the head of the queue and wedged the scheduler). A trace or the
    API refuses it before any step; the replica itself, handed one (what a server or a router hands
    it), refuses it on arrival in one line and serves the others, under every bundled policy."""
    rows = [{"id": "z", "arrival_s": 0, "prompt_tokens": 0, "output_tokens": 5}]
    rows.append({"id": "b", "arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"name": "t", "requests": rows}))
    want = "t.json: request z: empty prompt: prompt_tokens must be >= 1, got 0"
    with pytest.raises(traces.TraceError) as err:
        traces.load(str(path))
    assert str(err.value) == want
    with pytest.raises(SchedlabError) as err:
        simulate("chunked-prefill", str(path), kv_tokens=100_000)
    assert str(err.value) == want
    with pytest.raises(SchedlabError) as err:
        simulate("chunked-prefill", [req("z", 0, 5), req("b", 10, 5)], kv_tokens=100_000)
    assert str(err.value) == "requests: request z: empty prompt: prompt_tokens must be >= 1, got 0"
    # the replica, on the hybrid: z arrives while b is mid-prefill in small chunks, c after it
    reqs = [req("b", 300, 20), req("z", 0, 5, arrival=0.001), req("c", 50, 10, arrival=0.002)]
    for name in sorted(POLICIES):
        opts = {"budget": 32} if name == "chunked-prefill" else {"max_num_batched_tokens": 32} if name == "vllm" else {}
        res = run_replica(reqs, make_policy(name, opts), layout_cost(QWEN35_LAYOUT), kv_capacity=100_000, block_size=16)
        assert res.error is None, (name, res.error)
        ((z, why),) = res.rejected
        assert z.id == "z" and why == "request z has an empty prompt (0 tokens)", name
        by = {r.id: r for r in res.requests}
        assert z.prefilled == 0 and z.token_times == [] and z.kv_tokens == 0, name
        for rid in ("b", "c"):
            assert by[rid].finish_s is not None and len(by[rid].token_times) == by[rid].output_tokens, (name, rid)
        assert metrics.summarize(res)["rejected"] == 1
