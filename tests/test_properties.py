"""Property-based tests (hypothesis): random traces (arrivals, lengths, shared prefixes), a
random policy among the bundled ones with random options, random KV capacities and block
sizes, prefix caching on or off, with or without closed-loop clients. Whatever the draw:

- every request finishes exactly once with exactly its output tokens, or was refused on
  arrival because it can never fit;
- the KV cache never holds more than its capacity (tokens and blocks), and the block count
  is always exactly what the requests hold (nothing leaked: all free at the end);
- preemption never loses a request: a preempted request still finishes with all its tokens;
- the same inputs give the same run, and the loop's bulk repeats equal planning every step.

Sizes are kept small so that the examples run in well under a minute in CI.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from schedlab.policies import make_policy
from schedlab.sim import run_replica
from schedlab.sim.sources import ClientSource
from simkit import cost_model
from schedlab.traces.schema import Request

pytestmark = pytest.mark.slow  # hypothesis draws hundreds of runs: ~10 s

POLICY_OPTIONS = {
    "mlx-default": {
        "completion_batch_size": st.integers(1, 6),
        "prefill_batch_size": st.integers(1, 4),
        "prefill_step_size": st.integers(1, 400),
    },
    "prefer-prefill": {
        "completion_batch_size": st.integers(1, 6),
        "prefill_batch_size": st.integers(1, 4),
        "prefill_step_size": st.integers(1, 400),
    },
    "static": {"batch_size": st.integers(1, 5), "padded": st.booleans()},
    "slots": {"n_slots": st.integers(1, 5)},
    "chunked-prefill": {
        "budget": st.integers(1, 600),
        "max_batch": st.integers(1, 6),
        "long_prefill_threshold": st.integers(0, 300),
    },
    "unified": {"token_budget": st.integers(1, 600), "max_batch": st.integers(1, 6), "separate": st.booleans()},
    "vllm": {
        "max_num_seqs": st.integers(1, 6),
        "max_num_batched_tokens": st.integers(1, 600),
        "long_prefill_token_threshold": st.integers(0, 300),
    },
}


@st.composite
def policies(draw):
    # vllm (the policy that preempts) drawn as often as the six others together
    name = draw(st.sampled_from(sorted(POLICY_OPTIONS) + ["vllm"] * 5))
    opts = {k: draw(s) for k, s in POLICY_OPTIONS[name].items() if draw(st.booleans())}
    return name, opts


@st.composite
def traces_(draw, min_n=1, max_output=30):
    """Requests with random arrivals and lengths; some share 512-token prefix blocks (ids from
    a small pool, so that prompts meet each other's prefixes), some share token ids (text)."""
    n = draw(st.integers(min_n, 14))
    t = 0.0
    reqs, ids = [], {}
    for i in range(n):
        t += draw(st.sampled_from([0.0, 0.0, 0.001, 0.01, 0.05, 0.3]))
        shared = draw(st.integers(0, 2))
        if shared:
            pid = tuple(draw(st.lists(st.integers(1, 3), min_size=shared, max_size=shared)))
            prompt = draw(st.integers(1, 512 * shared + 60))
        else:
            pid = None
            prompt = draw(st.integers(1, 120))
        out = draw(st.integers(1, max_output))
        rid = f"r{i}"
        # some clients go away: before their first step, mid-prefill, mid-decode, or after the end
        cancel = draw(st.one_of(st.none(), st.none(), st.sampled_from([0.0, 0.001, 0.004, 0.02, 0.1, 0.5])))
        reqs.append(Request(rid, round(t, 6), prompt, out, pid, cancel_after_s=cancel))
        # token ids for token-key hashing: a common stem, cut at a random point, then own ids
        stem = draw(st.integers(0, prompt))
        ids[rid] = list(range(1000, 1000 + stem)) + [i * 10_000 + k for k in range(prompt - stem)]
    return reqs, ids


@dataclass
class Draw:
    reqs: list
    ids: dict
    policy: str
    options: dict
    kv: int
    block_size: int
    prefix: bool
    token_keys: bool
    clients: int | None


@st.composite
def setups(draw, pressure=False):
    """pressure: the vllm policy, several requests, a KV cache from the biggest one to twice it."""
    reqs, ids = draw(traces_(min_n=3, max_output=60) if pressure else traces_())
    if pressure:
        policy = "vllm"
        options = {k: draw(v) for k, v in POLICY_OPTIONS["vllm"].items() if draw(st.booleans())}
    else:
        policy, options = draw(policies())
    bs = draw(st.sampled_from([1, 2, 3, 16, 32]))
    biggest = max(r.prompt_tokens + r.output_tokens - 1 for r in reqs)
    if pressure:
        kv = draw(st.integers(-(-biggest // bs) * bs, 2 * biggest + bs))
    else:  # from "the biggest request barely fits" (or, sometimes, does not) to roomy
        kv = draw(st.integers(max(1, biggest - 40), biggest * 3 + 64))
    prefix = draw(st.booleans())
    token_keys = prefix and draw(st.booleans())
    clients = draw(st.one_of(st.none(), st.integers(1, 4)))
    return Draw(reqs, ids, policy, options, kv, bs, prefix, token_keys, clients)


def go(d: Draw, on_step=None):
    arrivals = ClientSource(d.reqs, d.clients) if d.clients else d.reqs
    return run_replica(
        arrivals,
        make_policy(d.policy, d.options),
        cost_model(),
        kv_capacity=d.kv,
        block_size=d.block_size,
        prefix_caching=d.prefix,
        token_keys=(lambda r: d.ids[r.id]) if d.token_keys else None,
        on_step=on_step,
    )


def check_state(state) -> None:
    """The block count is exactly what the running requests hold; nothing over capacity."""
    bs = state.block_size
    running = list(state.running.values())
    assert set(state.running) == set(state.prefilling) | set(state.decoding)
    assert state.kv_used == sum(r.kv_tokens for r in running)
    if state.prefix is None:  # (with sharing, a shared block's tokens count for every holder)
        assert state.kv_used <= state.kv_capacity
    assert state.kv_reserved == sum(r._reserved for r in running)
    pc = state.prefix
    if pc is None:
        assert state.blocks_used == sum(-(-r.kv_tokens // bs) for r in running)
    else:
        private = sum(-(-r.kv_tokens // bs) - len(r._blk.refs) for r in running)
        held = Counter(h for r in running for h in r._blk.refs)  # each block: how many references the requests hold
        assert state.blocks_used == private + len(held)
        for r in running:  # what a request references are whole blocks of its own KV, never more
            assert len(r._blk.refs) * bs <= r.kv_tokens, (r.id, len(r._blk.refs), r.kv_tokens)
        for h, c in pc.ref.items():
            assert c == held[h], f"reference count of block {h}: {c}, held {held[h]}"
        assert set(pc.free) == {h for h, c in pc.ref.items() if c == 0}
        assert state.blocks_used + len(pc.free) <= state.kv_blocks
        for r in running:  # a request's KV starts with exactly the blocks it references
            assert all(h in pc.ref for h in r._blk.refs)
    assert 0 <= state.blocks_used <= state.kv_blocks


def fingerprint(res):
    return (
        [
            (r.id, r.arrival_s, tuple(r.token_times), r.preemptions, r.recomputed_tokens, r.cached_tokens)
            for r in res.requests
        ],
        list(res.steps),
        res.prefix_cache,
        [r.id for r, _ in res.rejected],
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_every_request_finishes_once_kv_within_capacity_no_leaks(d: Draw):
    check_run(d)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups(pressure=True))
def test_preemption_under_kv_pressure_never_loses_a_request(d: Draw):
    check_run(d)


def check_run(d: Draw) -> None:
    seen = []

    def watch(state):
        check_state(state)
        seen.append(state.step_index)

    res = go(d, on_step=watch)
    assert res.error is None, res.error
    event(f"policy {d.policy}")
    event("preempted" if any(r.preemptions for r in res.requests) else "no preemption")
    if d.prefix:
        event("prefix hits" if res.prefix_cache["saved_prefill_tokens"] else "prefix cache, no hit")
    if res.rejected:
        event("some refused")
    cap = res.kv_capacity
    too_big = {r.id for r in d.reqs if r.prompt_tokens + r.output_tokens - 1 > cap}
    assert {r.id for r, _ in res.rejected} == too_big
    assert sorted(r.id for r in res.requests) == sorted(r.id for r in d.reqs)
    by_id = {r.id: r for r in d.reqs}
    for r in res.requests:
        if r.id in too_big:
            assert r.finish_s is None and not r.token_times
            continue
        if r.cancelled_s is not None:  # ended by its client, at a step's start, never early
            event("some cancelled")
            cancel = by_id[r.id].cancel_after_s
            assert cancel is not None and r.cancelled_s >= r.arrival_s + cancel
            assert r.phase.value == "finished" and r.finish_s == r.cancelled_s
            assert r.generated == len(r.token_times) == r.output_tokens < by_id[r.id].output_tokens
            assert all(t <= r.cancelled_s for t in r.token_times)
            continue
        # finished exactly once, with exactly its output tokens (preempted or not)
        assert r.phase.value == "finished" and r.finish_s == r.token_times[-1]
        assert r.generated == len(r.token_times) == by_id[r.id].output_tokens
        assert all(a <= b for a, b in zip(r.token_times, r.token_times[1:]))
        assert r.first_token_s >= r.arrival_s >= by_id[r.id].arrival_s
        if r.preemptions:  # each re-admission computes again at most the most KV it ever held ...
            assert r.recomputed_tokens <= r.preemptions * r._high, (r.id, r.recomputed_tokens, r._high)
            if not d.prefix:  # ... and the last one, with no cached block to hit, all of it
                assert r.recomputed_tokens >= r._high, (r.id, r.recomputed_tokens, r._high)
        else:  # never preempted: nothing computed twice
            assert r.recomputed_tokens == 0
    if not d.prefix:
        assert max((s.kv_tokens for s in res.steps), default=0) <= cap
    assert seen == list(range(1, len(seen) + 1))
    if d.prefix:
        assert res.prefix_cache["cached_blocks_at_end"] * d.block_size <= cap
    if d.clients:
        events = sorted(
            [(r.arrival_s, 1) for r in res.requests if r.finish_s is not None]
            + [(r.finish_s, -1) for r in res.requests if r.finish_s is not None]
        )
        cur = peak = 0
        for _, e in events:
            cur += e
            peak = max(peak, cur)
        assert peak <= d.clients


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(setups(), setups(pressure=True)))
def test_same_inputs_same_run_and_bulk_repeats_equal_step_by_step(d: Draw):
    a, b = go(d), go(d)
    assert fingerprint(a) == fingerprint(b)
    one_by_one = go(d, on_step=lambda state: None)
    assert fingerprint(one_by_one) == fingerprint(a)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(setups(), setups(pressure=True)))
def test_the_replica_ends_empty(d: Draw):
    """After the last finish every block, reservation and reference is back."""
    from schedlab.sim.state import ReplicaState

    holder = {}

    def grab(state: ReplicaState):
        holder["state"] = state

    go(d, on_step=grab)
    state = holder.get("state")
    if state is None:  # nothing ran: every request was refused
        return
    assert state.blocks_used == 0 and state.kv_used == 0 and state.kv_reserved == 0
    assert not state.running and not state.waiting
    if state.prefix is not None:
        assert all(c == 0 for c in state.prefix.ref.values())
        assert len(state.prefix.free) == len(state.prefix.ref) <= state.kv_blocks
