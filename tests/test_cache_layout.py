"""Memory of models with sliding-window and recurrent layers in the simulator (``sim.layout``):
each request holds its windows and recurrent state whole from admission to its end, counted with
its KV, so admission, preemption and capacity count what the engine's caches hold."""

from __future__ import annotations

import json

import pytest

from schedlab import traces
from schedlab.policies import POLICIES, make_policy
from schedlab.policies.base import Pass, Plan
from schedlab.sim import ProfileError, run_replica
from schedlab.sim.cost import LinearCostModel
from schedlab.sim.layout import CacheLayout, LayoutError
from schedlab.sim.state import PlanError
from simkit import KNOWN, Bench, req

# A hybrid model: one full-attention layer in four (1000 bytes of KV per token), the rest
# recurrent (a 3500-byte state per request: 4 tokens of capacity, rounded up)
HYBRID = {"full_layers": 1, "kv_bytes_per_token": 1000, "sliding": [], "state_bytes": 3500}
# a sliding-window model: 2 full layers (1000 bytes per token together) and 10 local layers of a
# 64-token window (5000 bytes per token together: 5 tokens of capacity per token of window)
SLIDING = {"full_layers": 2, "kv_bytes_per_token": 1000, "sliding": [[64, 10]], "sliding_kv_bytes_per_token": 5000}


def test_a_layout_converts_windows_and_states_into_tokens_of_the_full_layers():
    hybrid, sliding = CacheLayout.from_dict(HYBRID), CacheLayout.from_dict(SLIDING)
    assert hybrid.fixed_tokens(1) == hybrid.fixed_tokens(10_000) == 4  # whatever its length
    assert sliding.fixed_tokens(10) == 50  # a window filled to the request's own KV
    assert sliding.fixed_tokens(64) == sliding.fixed_tokens(10_000) == 320  # at most the window
    two = CacheLayout.from_dict(  # two windows, each layer its share of the bytes
        {"kv_bytes_per_token": 100, "sliding": [[8, 1], [32, 3]], "sliding_kv_bytes_per_token": 400}
    )
    assert two.sliding == ((8, 100.0), (32, 300.0)) and two.fixed_tokens(100) == 8 + 96
    # full attention only: nothing to add (the plain accounting, unchanged)
    assert CacheLayout.from_dict({"kv_bytes_per_token": 1000, "sliding": [], "state_bytes": 0}) is None
    assert CacheLayout.from_dict(None) is None
    assert CacheLayout.from_dict(hybrid.as_dict()) == hybrid


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"kv_bytes_per_token": -1, "state_bytes": 5}, "kv_bytes_per_token must be a non-negative number"),
        ({"kv_bytes_per_token": 10, "state_bytes": "big"}, "state_bytes must be"),
        ({"kv_bytes_per_token": 10, "sliding": [[0, 2]], "sliding_kv_bytes_per_token": 5}, "windows >= 1"),
        ({"kv_bytes_per_token": 10, "sliding": "64"}, r"sliding must be \[\[window, n\]"),
        ([1, 2], "must be an object"),
    ],
)
def test_a_bad_layout_is_one_line_and_a_profile_holding_it_is_refused(bad, match, tmp_path):
    with pytest.raises(LayoutError, match=match):
        CacheLayout.from_dict(bad)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"coefficients": KNOWN, "cache_layout": bad}))
    with pytest.raises(ProfileError, match="profile: cache_layout") as info:
        LinearCostModel.from_profile(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("block_size", [1, 4])
def test_a_request_holds_its_state_from_admission_to_finish_preemption_or_cancellation(block_size):
    b = Bench([req("a", 10, 3), req("b", 6, 4), req("c", 5, 5)], block_size=block_size, layout=HYBRID)
    st = b.state
    a, bb, c = (st.by_id[x] for x in "abc")
    assert (a.fixed_tokens, a.fixed_blocks) == ((4, 1) if block_size == 4 else (4, 4))
    assert a.kv_footprint == 10 + 3 - 1 + 4
    b.prefilling("a", 0)  # admitted, nothing computed: its state is held already
    assert (st.kv_used, st.blocks_used) == (4, a.fixed_blocks)
    assert st.kv_reserved == -(-a.kv_footprint // block_size) * block_size
    b.apply(Plan(passes=(Pass(prefill=(("a", 10),)),)))
    assert st.kv_used == 10 + 4 and st.blocks_used == -(-10 // block_size) + a.fixed_blocks
    b.prefilling("b", 6)
    b.prefilling("c", 2)
    # preempted: its KV and its state go back at once
    used = st.blocks_used
    b.apply(Plan(preempt=("b",)))
    assert st.blocks_used == used - -(-6 // block_size) - bb.fixed_blocks
    st.cancel("c", b.t)  # cancelled mid-prompt: the same
    assert st.kv_used == 10 + 4 and st.kv_reserved == -(-a.kv_footprint // block_size) * block_size
    b.apply(Plan(passes=(Pass(decode=("a",)),)))
    b.apply(Plan(passes=(Pass(decode=("a",)),)))  # a's last token: finished, all given back
    assert a.phase.value == "finished"
    assert (st.kv_used, st.blocks_used, st.kv_reserved) == (0, 0, 0)


def test_a_request_too_big_with_its_state_is_refused_on_arrival_saying_why():
    b = Bench([req("a", 90, 8), req("b", 80, 8)], kv_capacity=100, layout=HYBRID)
    assert [r.id for r in b.state.accepted] == ["b"]  # 87 + 4 fits in 100, 97 + 4 does not
    ((r, why),) = b.state.rejected
    assert r.id == "a" and "needs 101 KV tokens" in why and "+ 4 for its sliding windows and recurrent state" in why


def test_a_pass_over_the_blocks_left_beside_the_states_is_a_plan_error():
    b = Bench([req("a", 50, 2), req("b", 50, 2)], kv_capacity=104, layout=HYBRID)
    b.prefilling("a", 50)
    b.apply(Plan(admit=("b",)))  # 50 + 4 + 4 held: 46 free
    with pytest.raises(PlanError, match="needs 105 KV tokens but the capacity is 104"):
        b.apply(Plan(passes=(Pass(prefill=(("b", 47),)),)))


def fifo_concurrency(layout, capacity, n=12, prompt=100, output=20):
    """Most requests running at once under a policy that reserves each one's whole footprint."""
    reqs = [req(i, prompt, output) for i in range(n)]
    most = [0]

    def watch(state):
        most[0] = max(most[0], len(state.running))

    cost = LinearCostModel(KNOWN, meta={"cache_layout": layout} if layout else {})
    res = run_replica(reqs, make_policy("static", {"batch_size": "64"}), cost, kv_capacity=capacity, on_step=watch)
    assert res.error is None and all(r.phase.value == "finished" for r in res.requests)
    return most[0]


def test_capacity_in_requests_counts_the_states_and_windows():
    capacity = 1190  # 10 requests of 119 KV tokens
    assert fifo_concurrency(None, capacity) == 10
    assert fifo_concurrency(HYBRID, capacity) == capacity // (119 + 4)  # 9
    assert fifo_concurrency(SLIDING, capacity) == capacity // (119 + 5 * 64)  # 2


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("layout, block_size", [(HYBRID, 16), (SLIDING, 1)], ids=["hybrid", "sliding"])
def test_every_policy_keeps_the_memory_of_such_a_model_within_capacity(policy, layout, block_size):
    """Every bundled policy on the mixed trace in a KV cache that holds its longest request and
    a third more (vllm must preempt): blocks never overfill, the tokens held are the requests' KV and states,
    and everything is given back at the end."""
    tr = traces.load("mixed")
    fixed = CacheLayout.from_dict(layout)
    biggest = max(r.prompt_tokens + r.output_tokens - 1 for r in tr.requests)
    capacity = int(1.3 * (biggest + fixed.fixed_tokens(biggest) + block_size))
    seen = []

    def watch(state):
        assert state.blocks_used <= state.kv_blocks
        held = sum(r.kv_tokens + r.fixed_tokens for r in state.running.values())
        assert held == state.kv_used
        seen.append(len(state.running))

    cost = LinearCostModel(KNOWN, meta={"cache_layout": layout})
    res = run_replica(
        tr.requests, make_policy(policy), cost, kv_capacity=capacity, block_size=block_size, on_step=watch
    )
    assert res.error is None and not res.rejected
    assert all(r.phase.value == "finished" and r.generated == r.output_tokens for r in res.requests)
    assert seen and max(seen) >= 2
    if policy == "vllm":
        assert sum(r.preemptions for r in res.requests) > 0
