"""Block-level prefix caching in the simulator (``sim.prefix``): block hashes, hits, reference
counts, LRU eviction, and what it does to whole runs (hit rates, saved prefill, lower TTFT)."""

from __future__ import annotations

import pytest

from schedlab import traces
from schedlab.policies import POLICIES, make_policy
from schedlab.policies.base import Pass, Plan
from schedlab.sim import run_replica, summarize
from schedlab.sim.cost import LinearCostModel
from schedlab.sim.profiles import resolve_profile
from schedlab.sim.state import ReplicaState, ReplicaView
from simkit import cost_model
from schedlab.traces.schema import Request


def R(rid, prompt, output=2, prefix=None, t=0.0):
    return Request(rid, t, prompt, output, tuple(prefix) if prefix else None)


class Cached:
    """A paged replica with a prefix cache, driven by hand."""

    def __init__(self, requests, kv_capacity=10_000, block_size=16, **kw):
        self.state = ReplicaState((), kv_capacity, "t", block_size=block_size, prefix_caching=True, **kw)
        for r in requests:
            self.state.receive(r)
        self.view = ReplicaView(self.state, cost_model())
        self.pc = self.state.prefix

    def apply(self, plan):
        self.state.apply_admin(plan, 0.0)
        done = []
        for p in plan.passes:
            self.state.shape(p)
            done += self.state.apply_pass(p, 1.0)
        self.state.step_index += 1
        return done

    def serve(self, rid):
        """Admit ``rid`` and prefill what its cache hit leaves; it decodes until done."""
        r = self.state.by_id[rid]
        self.apply(Plan(admit=(rid,), passes=(Pass(prefill=((rid, r.remaining_prompt),)),)))
        while r.phase.value == "decoding":
            self.apply(Plan(passes=(Pass(decode=(rid,)),)))
        return r

    def check(self):
        """Blocks held = private blocks + referenced cached blocks; free cached blocks have no
        reference; nothing exceeds the capacity."""
        st, pc = self.state, self.pc
        private = sum(-(-r.kv_tokens // st.block_size) - len(r._blk.refs) for r in st.running.values())
        referenced = sum(1 for c in pc.ref.values() if c > 0)
        assert st.blocks_used == private + referenced
        assert set(pc.free) == {h for h, c in pc.ref.items() if c == 0}
        assert st.blocks_used + len(pc.free) <= st.kv_blocks
        for h, c in pc.ref.items():
            assert c == sum(r._blk.refs.count(h) for r in st.running.values())


def test_shared_prefix_ids_give_equal_block_hashes():
    b = Cached([R("a", 1200, prefix=(7, 8, 9)), R("b", 1100, prefix=(7, 8, 5)), R("c", 700, prefix=(6, 8))])
    pc = b.pc
    ha, hb, hc = (pc.chain(b.state.by_id[x], 80)[:80] for x in "abc")
    assert ha[:64] == hb[:64] and ha[64] != hb[64]  # 2 shared 512-token blocks = 64 blocks of 16
    assert ha[0] != hc[0] and ha[40] != hc[40]  # a different first block changes every later hash
    assert len(set(ha) | set(hb)) == 80 + 16


def test_hits_are_whole_cached_blocks_and_never_the_last_token():
    b = Cached([R("a", 1024, 3, prefix=(1, 2)), R("b", 1024, 3, prefix=(1, 2)), R("c", 1040, 3, prefix=(1, 2))])
    a = b.serve("a")
    assert a.cached_tokens == 0
    bb = b.state.by_id["b"]
    assert bb.remaining_prompt == 16  # 63 of 64 blocks: the last token is computed for its logits
    assert b.view.prefix_hit(bb) == (1008, 63)  # all 63 are free cached blocks now (a finished)
    b.serve("b")
    assert bb.cached_tokens == 1008
    c = b.state.by_id["c"]
    assert b.view.prefix_hit(c) == (1024, 64)  # its own 17th token onwards is not shared
    b.check()
    s = b.pc.stats()
    assert s["prompt_tokens_hit"] == 1008 and s["prompt_tokens_queried"] == 2048


def test_lru_eviction_of_free_cached_blocks_tail_first():
    # 8 blocks of 4 tokens
    reqs = [
        R("a", 12, 1, prefix=(1,)),
        R("b", 12, 1, prefix=(2,)),
        R("c", 16, 1, prefix=(3,)),
        R("a2", 12, 1, prefix=(1,)),
        R("b2", 12, 1, prefix=(2,)),
    ]
    b = Cached(reqs, kv_capacity=32, block_size=4)
    b.serve("a")  # 3 blocks cached, freed tail first: LRU order a2', a1', a0'
    b.serve("b")
    assert len(b.pc.free) == 6 and b.state.blocks_used == 0
    b.check()
    b.serve("c")  # 4 blocks: 2 empty ones, then evicts the 2 least recently freed: a's tail blocks
    assert b.pc.evictions == 2
    a2, b2 = b.state.by_id["a2"], b.state.by_id["b2"]
    assert b.view.prefix_hit(a2) == (4, 1)  # a's first block survived; its tail went first
    assert b.view.prefix_hit(b2) == (8, 2)  # b (freed later) intact: max hit is 2 blocks of 11 tokens
    b.check()


def test_a_block_computed_twice_stays_private_and_references_are_counted():
    b = Cached([R("a", 64, 4, prefix=(5,)), R("b", 64, 4, prefix=(5,)), R("c", 64, 4, prefix=(5,))], block_size=16)
    st = b.state
    # a and b admitted together: neither finds the other's blocks (not computed yet)
    b.apply(Plan(admit=("a", "b"), passes=(Pass(prefill=(("a", 64), ("b", 64))),)))
    assert st.blocks_used == 8 and len(st.by_id["a"]._blk.refs) == 4 and st.by_id["b"]._blk.refs == []
    b.check()
    # c hits a's blocks (3 of them: its last token is computed); shared blocks count once
    b.apply(Plan(admit=("c",), passes=(Pass(prefill=(("c", 16),)),)))
    assert st.by_id["c"].cached_tokens == 48 and st.blocks_used == 9
    b.check()
    while st.finished < 3:
        rows = tuple(st.decoding)
        b.apply(Plan(passes=(Pass(decode=rows),)))
        b.check()
    assert st.blocks_used == 0 and len(b.pc.free) == 4  # a's 4 cached blocks (the 67-token KVs end in part blocks)


def test_preempted_requests_find_their_own_blocks_again():
    cm = LinearCostModel.from_profile(resolve_profile(None))
    tr = traces.load("azure2023_conv").requests[:600]
    plain = summarize(run_replica(tr, make_policy("vllm"), cm, kv_capacity=16_384, block_size=16))
    cached = summarize(run_replica(tr, make_policy("vllm"), cm, kv_capacity=16_384, block_size=16, prefix_caching=True))
    assert plain["preemptions"] > 50 and cached["preemptions"] > 50
    # nothing is shared between Azure requests: every hit is a resumption finding its own KV
    assert cached["prefix_cache"]["prompt_tokens_hit"] == 0
    assert cached["prefix_cache"]["saved_prefill_tokens"] > 0
    assert cached["recomputed_tokens"] / cached["preemptions"] < plain["recomputed_tokens"] / plain["preemptions"]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs_with_prefix_caching_and_shared_prefixes_lower_ttft(policy):
    cm = LinearCostModel.from_profile(resolve_profile(None))
    # 60 prompts of 1536 shared + 100-300 own tokens, 2 a second
    tr = traces.load("random:n=60,input_len=200,output_len=40,range_ratio=0.5,prefix_len=1536,rate=2", seed=1)
    off = run_replica(tr.requests, make_policy(policy), cm, kv_capacity=200_000, block_size=16)
    on = run_replica(tr.requests, make_policy(policy), cm, kv_capacity=200_000, block_size=16, prefix_caching=True)
    assert off.error is None and on.error is None
    assert all(r.finish_s is not None and len(r.token_times) == r.output_tokens for r in on.requests)
    s_off, s_on = summarize(off), summarize(on)
    assert "prefix_cache" not in s_off
    pc = s_on["prefix_cache"]
    assert pc["hit_rate"] > 0.7 and pc["saved_prefill_tokens"] >= pc["prompt_tokens_hit"] > 0
    assert sum(r.cached_tokens for r in on.requests) == pc["prompt_tokens_hit"]
    assert s_on["ttft_ms"]["p50"] < 0.7 * s_off["ttft_ms"]["p50"]
    assert (
        sum(st.prefill_tokens for st in on.steps)
        == sum(st.prefill_tokens for st in off.steps) - pc["saved_prefill_tokens"]
    )


@pytest.mark.slow
def test_mooncake_window_hit_rate_grows_with_capacity_up_to_the_trace_bound():
    """Hit rates on the bundled Mooncake window: a replay one request at a time (the paper's
    Figure 9 method: the request sequence only) reaches the infinite-cache bound computed from
    the hash ids directly; a small cache gets a fraction of it."""
    tr = traces.load("mooncake_conv_10min").requests[:500]
    seen, hit, query = set(), 0, 0
    for r in tr:  # infinite cache, whole 16-token blocks inside each request's hashed prefix
        pid = r.prefix_ids or ()
        n = 0
        for x in pid:
            if x not in seen:
                break
            n += 1
        limit = (r.prompt_tokens - 1) // 16 * 16
        shared_end = min(r.prompt_tokens, 512 * len(pid))
        hit += min(n * 512, limit, shared_end // 16 * 16)
        query += r.prompt_tokens
        seen.update(pid[: r.prompt_tokens // 512])
    bound = hit / query
    cm = LinearCostModel({"p_pass": 0.01, "d_pass": 0.001})

    def rate(kv):
        res = run_replica(
            tr, make_policy("slots", {"n_slots": "1"}), cm, kv_capacity=kv, block_size=16, prefix_caching=True
        )
        return summarize(res)["prefix_cache"]["hit_rate"]

    big = rate(10**8)
    assert 0.1 < bound and big == pytest.approx(bound, rel=0.05)
    assert rate(300_000) < rate(3_000_000) < big


def test_text_prompts_hashed_from_token_ids():
    """token_keys: blocks of real token ids (a text trace counted by a tokenizer)."""
    shared = list(range(100, 164))
    ids = {"a": shared + [1, 2, 3], "b": shared + [9, 9], "c": [5] + shared}
    reqs = [R(k, len(v), 2) for k, v in ids.items()]
    b = Cached(reqs, block_size=16, token_keys=lambda r: ids[r.id])
    b.serve("a")
    assert b.view.prefix_hit(b.state.by_id["b"])[0] == 64
    assert b.view.prefix_hit(b.state.by_id["c"])[0] == 0  # same tokens, shifted: other blocks
