"""The ``vllm`` policy (vLLM v1's scheduler) on paged KV: its rules step by step on a hand-built
replica, and whole runs under KV pressure (preemptions, recomputation, every request done)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from schedlab import traces
from schedlab.policies import make_policy
from schedlab.policies.base import UNTIL_CHANGE
from schedlab.policies.vllm import Vllm
from schedlab.sim import run_replica, summarize
from schedlab.sim.cost import LinearCostModel
from schedlab.sim.output import write_run
from schedlab.sim.profiles import resolve_profile
from schedlab.sim.state import ReplicaState, ReplicaView
from schedlab.traces.schema import Request
from simkit import command, cost_model, read_table, req

BIN = Path(sys.executable).parent


class Paged:
    """A ReplicaState with blocks, driven plan by plan (shape, then apply, as the loop does)."""

    def __init__(self, requests, kv_capacity, block_size=4, prefix_caching=False):
        self.state = ReplicaState((), kv_capacity, "vllm", block_size=block_size, prefix_caching=prefix_caching)
        for r in requests:
            self.state.receive(r)
        self.view = ReplicaView(self.state, cost_model())
        self.t = 0.0

    def step(self, policy):
        plan = policy.plan(self.view)
        self.state.apply_admin(plan, self.t)
        for p in plan.passes:
            self.state.shape(p)
            self.t += 0.01
            self.state.apply_pass(p, self.t)
        self.state.step_index += 1
        return plan

    def ids(self, queue):
        return [r.id for r in getattr(self.view, queue)]


def blocks_held(st: ReplicaState) -> int:
    return sum(-(-r.kv_tokens // st.block_size) for r in st.running.values())


def test_running_first_then_waiting_and_blocks_allocated_as_tokens_are_computed():
    # blocks of 4 tokens, 10 blocks
    b = Paged([req("a", 6, 3), req("b", 9, 3)], kv_capacity=40)
    pol = Vllm(max_num_batched_tokens=8)
    plan = b.step(pol)
    # a's prompt (6) and 2 of b's (budget 8); blocks: a 2, b 1
    assert plan.admit == ("a", "b") and plan.passes[0].prefill == (("a", 6), ("b", 2))
    assert b.state.blocks_used == 3 == blocks_held(b.state)
    plan = b.step(pol)
    # running first, in admission order: a decodes (its KV 6 -> 7, same block), b's next 7 tokens
    assert plan.passes[0].decode == ("a",) and plan.passes[0].prefill == (("b", 7),)
    assert b.state.blocks_used == 2 + 3 == blocks_held(b.state)


def test_the_latest_admitted_is_preempted_and_resumes_first():
    b = Paged([req("a", 8, 20), req("b", 8, 20), req("c", 8, 20)], kv_capacity=28)
    pol = Vllm()
    b.step(pol)  # a, b, c admitted and prefilled: 2 blocks each, 6 of 7 used
    assert b.ids("decoding") == ["a", "b", "c"] and b.state.blocks_used == 6
    b.state.receive(req("w", 4, 2, arrival=1.0))
    b.step(pol)  # each KV 8 -> 9: a takes the 7th block, then b needs one: c is preempted
    assert b.state.by_id["c"].phase.value == "waiting" and b.state.by_id["c"].preemptions == 1
    assert b.ids("waiting")[0] == "c"  # back at the front, ahead of w
    assert b.ids("running") == ["a", "b"]
    assert b.state.blocks_used == 6 == blocks_held(b.state)


def test_preemption_step_admits_nobody_and_the_oldest_always_progresses():
    b = Paged([req("a", 7, 9), req("b", 5, 8)], kv_capacity=16)  # 4 blocks of 4
    pol = Vllm()
    st = b.state
    b.step(pol)  # a: 7 tokens, 2 blocks; b: 5 tokens, 2 blocks
    assert st.blocks_used == 4 and b.ids("decoding") == ["a", "b"]
    st.receive(req("w", 2, 1))
    plan = b.step(pol)  # a: KV 7 -> 8 and b: 5 -> 6 stay in their blocks; w does not fit
    assert not plan.preempt and plan.admit == ()
    plan = b.step(pol)  # a: KV 8 needs a 3rd block: none free: b (the latest admitted) goes
    assert plan.preempt == ("b",) and plan.admit == () and plan.passes[0].decode == ("a",)
    assert b.ids("waiting") == ["b", "w"]
    for _ in range(40):
        if st.finished == 3:
            break
        b.step(pol)
        assert st.blocks_used == blocks_held(st) <= st.kv_blocks
    assert st.finished == 3 and st.by_id["b"].preemptions == 1 and st.by_id["a"].preemptions == 0
    # b resumed before w (preempted requests first) and recomputed the KV it had (6 tokens)
    assert st.by_id["b"].admitted_s <= st.by_id["w"].admitted_s
    assert st.by_id["b"].recomputed_tokens == 6


def test_a_prefilling_request_that_cannot_grow_preempts_itself():
    b = Paged([req("a", 4, 9), req("b", 12, 1)], kv_capacity=16)  # 4 blocks
    pol = Vllm(max_num_batched_tokens=5)
    st = b.state
    b.step(pol)  # a prefilled (1 block), b's first token (1 block)
    assert [r.prefilled for r in st.requests] == [4, 1] and st.blocks_used == 2
    plans = []
    for _ in range(40):
        if st.finished == 2:
            break
        plans.append(b.step(pol))
        assert st.blocks_used == blocks_held(st) <= st.kv_blocks
    assert st.finished == 2
    # b (the latest running) preempted itself when its next chunk did not fit, a ran on
    assert any(
        p.preempt == ("b",) and p.passes and p.passes[0].decode == ("a",) and not p.passes[0].prefill for p in plans
    )
    assert st.by_id["b"].preemptions >= 1 and st.by_id["a"].preemptions == 0


def test_chunks_obey_the_threshold_the_budget_and_max_num_seqs():
    b = Paged([req("a", 100, 2), req("b", 100, 2), req("c", 100, 2)], kv_capacity=10_000, block_size=16)
    plan = b.step(Vllm(max_num_batched_tokens=90, long_prefill_token_threshold=40, max_num_seqs=2))
    assert plan.admit == ("a", "b") and plan.passes[0].prefill == (("a", 40), ("b", 40))
    plan = b.step(Vllm(max_num_batched_tokens=50, long_prefill_token_threshold=40, max_num_seqs=2))
    assert plan.passes[0].prefill == (("a", 40), ("b", 10)) and plan.admit == ()


def test_repeat_is_exactly_how_long_the_blocks_last():
    for bs in (1, 3, 16):
        for offsets, free in (([0], 5), ([1, 2, 3, 0, 0, 7], 11), ([5] * 40, 3), ([2, 9], 0)):
            offsets = [a % bs for a in offsets]
            got = Vllm._repeat(offsets, free, bs)

            def need(s):  # by brute force: positions written over the next s steps
                return sum(sum(1 for t in range(s) if (a + t) % bs == 0) for a in offsets)

            assert need(got) <= free and (got == UNTIL_CHANGE or need(got + 1) > free), (bs, offsets, free, got)


@pytest.mark.parametrize("block_size,prefix", [(1, False), (16, False), (16, True), (7, True)])
@pytest.mark.slow
def test_bulk_repeats_equal_planning_every_step_under_kv_pressure(block_size, prefix):
    cm = LinearCostModel.from_profile(resolve_profile(None))
    tr = traces.load("mooncake_conv_10min").requests[:80]  # 3,000+ steps, 30-300 preemptions
    kw = dict(kv_capacity=150_000, block_size=block_size, prefix_caching=prefix)
    bulk = run_replica(tr, make_policy("vllm"), cm, **kw)
    one = run_replica(tr, make_policy("vllm"), cm, on_step=lambda st: None, **kw)
    assert bulk.error is None and sum(r.preemptions for r in bulk.requests) > 0
    assert [r.token_times for r in bulk.requests] == [r.token_times for r in one.requests]
    assert list(bulk.steps) == list(one.steps) and len(bulk.steps) > 1000
    assert bulk.prefix_cache == one.prefix_cache


def test_no_bulk_repeats_while_a_head_refused_for_blocks_may_gain_from_an_eviction():
    """Found by the property test: r5 finishes and leaves its 40-token prefix cached; r6 shares
    it and is refused for blocks while r0 decodes alone. Each decode step evicts one free cached
    block; evicting one from the middle of r6's prefix cuts its hit, and the blocks it would
    take, by more than the block it costs, so r6 fits a step later. Bulk repeats must stop for
    that (step by step admits r6 there)."""
    reqs = [req(0, 1, 25), req(1, 1, 1), req(2, 1, 1), req(3, 1, 1), req(4, 1, 15)]
    reqs += [Request("5", 0.0, 40, 1, (1,)), Request("6", 0.0, 44, 2, (1,))]
    reqs += [req(7, 1, 1), req(8, 1, 1), req(9, 1, 1)]
    kw = dict(kv_capacity=66, block_size=1, prefix_caching=True)
    bulk = run_replica(reqs, make_policy("vllm", {"max_num_batched_tokens": 4}), cost_model(), **kw)
    one = run_replica(
        reqs, make_policy("vllm", {"max_num_batched_tokens": 4}), cost_model(), on_step=lambda st: None, **kw
    )
    assert [r.token_times for r in bulk.requests] == [r.token_times for r in one.requests]
    assert list(bulk.passes) == list(one.passes)
    assert (
        bulk.prefix_cache == one.prefix_cache
        and bulk.prefix_cache["prompt_tokens_hit"] > 0
        and bulk.prefix_cache["evicted_blocks"] > 0
    )


def test_kv_pressure_on_the_azure_hour_head_finishes_everything(tmp_path):
    cm = LinearCostModel.from_profile(resolve_profile(None))
    tr = traces.load("azure2023_conv").requests[:1500]
    res = run_replica(tr, make_policy("vllm"), cm, kv_capacity=16_384, block_size=16)
    assert res.error is None and not res.rejected
    assert all(r.finish_s is not None and len(r.token_times) == r.output_tokens for r in res.requests)
    s = summarize(res)
    assert s["preemptions"] > 100 and s["recomputed_tokens"] > 0
    assert s["preemptions"] == sum(r.preemptions for r in res.requests)
    # a request recomputes at most what it held before each preemption, and something when preempted
    for r in res.requests:
        assert (r.recomputed_tokens > 0) == (r.preemptions > 0) or r.recomputed_tokens == 0
    assert max(st.kv_tokens for st in res.steps) <= 16_384
    write_run(tmp_path, res, s)
    rows = read_table(tmp_path / "requests.csv")
    assert sum(int(r["preemptions"]) for r in rows) == s["preemptions"]
    assert sum(int(r["recomputed_tokens"]) for r in rows) == s["recomputed_tokens"]
    assert json.loads((tmp_path / "summary.json").read_text())["preempted_requests"] == s["preempted_requests"]


@pytest.mark.slow
def test_acceptance_simulate_vllm_on_the_azure_hour_with_a_small_kv(tmp_path):
    """simulate --policy vllm --trace azure2023_conv --kv-tokens N finishes every request and
    reports preemptions."""
    out = tmp_path / "az"
    proc = subprocess.run(
        [
            *command("simulate"),
            "--policy",
            "vllm",
            "--trace",
            "azure2023_conv",
            "--kv-tokens",
            "65536",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Successful requests:                     19366" in proc.stdout
    assert "Preemptions:" in proc.stdout and "Recomputed tokens:" in proc.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["finished"] == s["requests"] == 19366 and s["preemptions"] > 1000
    rows = read_table(out / "requests.csv")
    assert all(r["status"] == "finished" for r in rows)
    assert sum(int(r["preemptions"]) for r in rows) == s["preemptions"]
