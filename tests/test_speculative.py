"""Speculative decoding as a schedule, simulated: every bundled policy drafting tokens.

Real parts: SimPy, the state machine, the bundled policies and the bundled measured profile, the
real bundled traces, the ``simulate`` command in a subprocess.
"""

from __future__ import annotations

import math
import re
import subprocess

import pytest

import schedlab
from schedlab import traces
from schedlab.policies import POLICIES, Pass, make_policy
from schedlab.policies.speculative import Speculative
from schedlab.routers import make_router
from schedlab.sim import Deployment, DeploymentError, Group, PlanError, run, run_replica
from schedlab.sim.speculation import Acceptance
from schedlab.traces.schema import Request
from simkit import Bench, command, cost_model

ACCEPT = (0.8, 0.6, 0.5, 0.4)
TRACE = traces.window(traces.load("azure2023_conv"), 0, 120)


class BlockWatch:
    """After every step: the blocks the replica holds are exactly its requests' KV in whole
    blocks (a rejected draft's KV kept would show as a block too many), within the capacity."""

    def __init__(self):
        self.steps = 0

    def __call__(self, state):
        self.steps += 1
        bs = state.block_size
        held = sum(-(-r.kv_tokens // bs) for q in (state.prefilling, state.decoding) for r in q.values())
        assert held == state.blocks_used <= state.kv_blocks
        assert state.kv_used == sum(r.kv_tokens for q in (state.prefilling, state.decoding) for r in q.values())


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_drafts_and_every_request_gets_exactly_its_tokens(policy):
    watch = BlockWatch()
    pol = Speculative(make_policy(policy), k=4)
    res = run_replica(
        TRACE.requests, pol, cost_model(), kv_capacity=65_536, block_size=16, on_step=watch,
        acceptance=Acceptance(ACCEPT, seed=1),
    )  # fmt: skip
    assert res.error is None and not res.rejected and watch.steps > 0
    for r in res.requests:
        assert r.finish_s is not None and len(r.token_times) == r.output_tokens
        assert all(a <= b for a, b in zip(r.token_times, r.token_times[1:]))
    spec = res.speculative
    assert spec["drafts"] > 0 and 0 < spec["accepted_tokens"] < spec["draft_tokens"]
    per_pos = spec["accepted_per_position"]
    assert sum(per_pos) == spec["accepted_tokens"] and list(per_pos) == sorted(per_pos, reverse=True)
    # a decode row makes one token, an accepted draft one more; the rest are the tokens that end
    # a prefill (at most one per request and per preemption)
    rows = sum(len(p.decode) for *_, p in res.passes)
    out = sum(r.output_tokens for r in res.requests)
    ends = len(res.requests) + sum(r.preemptions for r in res.requests)
    assert rows + spec["accepted_tokens"] <= out <= rows + spec["accepted_tokens"] + ends


def test_rows_accept_what_the_profile_draws_and_all_or_nothing_profiles_are_exact():
    reqs = [Request(f"r{i}", 0.0, 32, 41) for i in range(4)]

    def go(accept, k):
        return run_replica(
            reqs, Speculative(make_policy("unified"), k=k), cost_model(), kv_capacity=100_000,
            acceptance=Acceptance(accept),
        )  # fmt: skip

    none = go((0.0,) * 4, 4)
    plain = run_replica(reqs, make_policy("unified"), cost_model(), kv_capacity=100_000)
    # nothing accepted: one token per row and pass, as without drafts (the passes cost more)
    assert [len(r.token_times) for r in none.requests] == [len(r.token_times) for r in plain.requests]
    assert none.speculative["accepted_tokens"] == 0 and len(none.steps) == len(plain.steps)
    assert none.requests[0].finish_s > plain.requests[0].finish_s
    every = go((1.0,) * 4, 4)
    # everything accepted: 5 tokens a verify while 4 drafts fit (tokens left - 1), then fewer
    assert every.speculative["acceptance_rate"] == 1.0
    first = every.requests[0].token_times
    chunks = [first.count(t) for t in sorted(set(first))]
    assert chunks[0] == 1 and chunks[1:9] == [5] * 8 and sum(chunks) == 41
    assert len(every.steps) < len(plain.steps) / 3


def test_a_profile_with_verify_terms_prices_verify_passes_itself_and_one_without_is_charged_the_approximation():
    from schedlab.policies.base import PassShape, verify_seconds
    from schedlab.sim.cost import LinearCostModel

    base = dict(cost_model().coefficients)
    plain_model = LinearCostModel(base)
    timed = LinearCostModel({**base, "v_pass": 0.004, "v_tokens": 0.002, "v_attn": 1e-6})
    verify = PassShape((100, 300), decode_drafts=(2, 4))
    assert not plain_model.prices_drafts and verify_seconds(plain_model, verify) > 0
    extra = timed.pass_seconds(verify) - timed.pass_seconds(PassShape((100, 300)))
    assert timed.prices_drafts and verify_seconds(timed, verify) == 0
    assert extra == pytest.approx(0.004 + 0.002 * 2 * 4 + 1e-6 * 2 * 4 * 300)
    from schedlab.sim.backend import SimBackend

    charged = []
    for model in (plain_model, timed):  # the simulator charges each its own price of the same verify pass
        b = Bench([Request(f"{i}", 0.0, 32, 41) for i in range(2)])
        for i in range(2):
            b.decoding(i)
        p = Pass(decode=("0", "1"), draft=(2, 4))
        shape = b.state.shape(p)
        charged.append(SimBackend(model, acceptance=Acceptance((0.0,) * 4)).execute(p, shape, b.state))
        assert charged[-1] == pytest.approx(model.pass_seconds(shape) + verify_seconds(model, shape))
    assert charged[0] != pytest.approx(charged[1])


def test_rows_whose_drafter_finds_nothing_decode_plainly_at_the_share_the_counters_measured():
    from schedlab.sim.speculation import counters

    measured = counters(60, 150, 70, [40, 20, 10], empty=40)  # 60 of 100 rows proposed
    acc = Acceptance.from_counters(measured)
    assert acc.propose == pytest.approx(0.6) and acc.accept == pytest.approx((40 / 60, 20 / 40, 10 / 20))
    reqs = [Request(f"r{i}", 0.0, 32, 200) for i in range(6)]
    res = run_replica(reqs, Speculative(make_policy("unified"), k=3), cost_model(), kv_capacity=100_000, acceptance=acc)
    got = res.speculative
    rows = got["drafts"] + got["empty_drafts"]
    share, sd = got["drafts"] / rows, math.sqrt(0.6 * 0.4 / rows)
    assert abs(share - 0.6) < 4 * sd  # (binomial: 4 standard deviations)
    assert Acceptance.from_counters(got).propose == pytest.approx(share)
    # a pass none of whose rows proposed costs a plain pass: nothing accepted, nothing priced on top
    from schedlab.sim.backend import SimBackend

    b = Bench([Request("0", 0.0, 32, 41)])
    b.decoding(0)
    p = Pass(decode=("0",), draft=(3,))
    never = SimBackend(cost_model(), acceptance=Acceptance((1.0,), propose=1e-9))
    assert never.execute(p, b.state.shape(p), b.state) == pytest.approx(
        cost_model().pass_seconds(b.state.shape(Pass(decode=("0",))))
    )


def test_each_request_can_draw_from_its_own_measured_acceptance():
    reqs = [Request(f"r{i}", 0.0, 32, 41) for i in range(3)]
    pol = Speculative(make_policy("unified"), k=4)
    pooled = Acceptance((0.5,) * 4)
    mine = Acceptance((0.5,) * 4, per_request={"r0": ((1.0,) * 4, 1.0), "r1": ((0.0,), 0.0)})
    res = run_replica(reqs, pol, cost_model(), kv_capacity=100_000, acceptance=mine)
    by = res.speculative_requests
    assert by["r0"]["accepted_per_position"] == [by["r0"]["drafts"]] * 4  # every draft accepted
    assert by["r1"]["drafts"] == 0 < by["r1"]["empty_drafts"]  # its drafter never proposes
    chunks = {r.id: len(set(r.token_times)) for r in res.requests}
    assert chunks["r0"] < chunks["r2"] < chunks["r1"] == 41
    # the counters a run leaves give back each request's profile
    again = Acceptance.from_requests(res.speculative, by)
    assert again.per_request["r0"] == ((1.0,) * 4, 1.0) and again.per_request["r1"] == ((0.0,), 0.0)
    assert again.describe()["per_request"] == 3
    same = run_replica(reqs, pol, cost_model(), kv_capacity=100_000, acceptance=pooled).speculative_requests
    assert same["r2"] == by["r2"]  # (a request without a profile of its own draws from the pooled one)


def test_the_same_request_meets_the_same_draws_under_every_policy():
    acc = Acceptance(ACCEPT, seed=7)
    a, b = {}, {}
    seq_a = [acc.accepted("q", 4, a) for _ in range(20)]
    seq_b = [acc.accepted("q", k, b) for k in [4, 2, 4, 1] * 5]
    # a smaller k cuts the same draws short: never more accepted than with k = 4
    assert all(y <= x for x, y in zip(seq_a, seq_b)) and any(y < x for x, y in zip(seq_a, seq_b))
    assert seq_a == [acc.accepted("q", 4, {}) for _ in range(1)] + seq_a[1:]
    assert Acceptance(ACCEPT).expected_tokens(2) == pytest.approx(1 + 0.8 + 0.8 * 0.6)


def test_the_token_budget_counts_verify_positions():
    budget = 64
    pol = Speculative(make_policy("unified", {"token_budget": budget}), k=4)
    res = run_replica(TRACE.requests, pol, cost_model(), kv_capacity=65_536, acceptance=Acceptance(ACCEPT))
    assert res.error is None and res.speculative["drafts"] > 0
    for *_, p in res.passes:
        positions = len(p.decode) + sum(p.draft) + sum(n for _, n in p.prefill)
        assert positions <= budget
    assert pol.inner.token_budget == budget  # (given back after every step)


def test_adaptive_k_shrinks_as_the_batch_grows():
    cost = cost_model()

    def chosen(rate):
        tr = traces.to_rate(TRACE, rate)
        pol = Speculative(make_policy("vllm"), k=4, adaptive=True, accept=ACCEPT)
        res = run_replica(tr.requests, pol, cost, kv_capacity=262_144, acceptance=Acceptance(ACCEPT))
        assert res.error is None
        return sum(pol.k_chosen) / len(pol.k_chosen)

    light, heavy = chosen(0.05), chosen(20.0)
    assert light > heavy and light >= 2


@pytest.mark.parametrize(
    "plan, message",
    [
        (lambda: Pass(decode=("d",), draft=(5,)), "drafts 5 tokens with 5 to produce (at most 4)"),
        (lambda: Pass(decode=("d",), draft=(1, 1)), "has 2 draft counts for 1 decode rows"),
        (lambda: Pass(decode=("d",), draft=(-1,)), "draft is -1 tokens"),
        (lambda: Pass(decode=("h",), draft=(1,)), "on its hand-off"),
    ],
)
def test_bad_drafts_are_plan_errors(plan, message):
    bench = Bench([Request("d", 0.0, 4, 6), Request("h", 0.0, 4, 6)])
    bench.decoding("d")  # decoding, 5 tokens left
    bench.prefilling("h", 3)  # one prompt token left: its next decode is the hand-off
    with pytest.raises(PlanError, match=re.escape(message)):
        bench.state.shape(plan())


def test_drafts_need_room_for_every_position_and_give_back_the_rejected_ones():
    bench = Bench([Request("d", 0.0, 4, 8), Request("e", 0.0, 4, 2)], kv_capacity=12)
    state, r = bench.state, bench.decoding("d")  # KV 4, one token out, 7 left
    bench.decoding("e")  # KV 8 of 12 in all
    with pytest.raises(PlanError, match="with its drafts"):
        state.shape(Pass(decode=("d",), draft=(4,)))  # its token and 4 drafts: 13 > 12
    p = Pass(decode=("d",), draft=(3,))
    state.shape(p)
    state.accept("d", 1)
    state.apply_pass(p, 0.2)
    assert r.kv_tokens == 6 and state.kv_used == 10 and state.blocks_used == 10
    assert r.token_times == [0.01, 0.2, 0.2] and r.tokens_left == 5
    p = Pass(decode=("d",), draft=(1,))  # (12 of 12 blocks while it runs)
    state.shape(p)
    state.accept("d", 3)
    with pytest.raises(PlanError, match="3 of its 1 drafts accepted"):
        state.apply_pass(p, 0.3)


def test_a_cluster_and_the_api_run_speculation_and_count_it():
    deployment = Deployment(
        (Group(tuple(Speculative(make_policy("vllm")) for _ in range(2)), cost_model(), 65_536),),
        router=make_router("least-requests"),
        acceptance=Acceptance(ACCEPT),
    )
    res = run(deployment, TRACE.requests)
    assert res.error is None and res.speculative["drafts"] == sum(p.speculative["drafts"] for p in res.replicas)
    api = schedlab.simulate("vllm", TRACE, speculative={"method": "ngram", "k": 4, "accept": ACCEPT})
    s = api.summary["speculative"]
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["accepted_tokens"] / s["drafts"])
    assert api.meta["deployment"]["acceptance"]["accept"] == list(ACCEPT)
    assert api.summary["policy"] == "vllm+ngram-k4"
    # ITL: one gap per chunk a client receives (no zero gaps), as vLLM records it
    # (with the zero gaps inside a chunk counted, the median ITL was 0; a chunk holds 1 to k + 1 tokens)
    assert api.summary["itl_ms"]["p50"] > api.summary["tpot_ms"]["p50"] > 0
    plain = schedlab.simulate("vllm", TRACE)
    assert api.summary["tpot_ms"]["p50"] < plain.summary["tpot_ms"]["p50"]
    assert math.isclose(api.summary["total_output_tokens"], plain.summary["total_output_tokens"])


def test_a_deployment_that_drafts_needs_an_acceptance_profile():
    with pytest.raises(DeploymentError, match="needs an acceptance profile"):
        Deployment.one(Speculative(make_policy("vllm")), cost_model(), kv_capacity=1000)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("medusa:k=4,accept=0.5", "the method is ngram"),
        ("ngram:k=0,accept=0.5", "k must be an integer >= 1"),
        ("ngram:k=two,accept=0.5", "k must be an integer"),
        ("ngram:adaptive=true", "adaptive k needs the acceptance"),
        ("ngram:k=4,accept=0.5/1.5", "a number in [0, 1]"),
        ("ngram:k=4,colour=red,accept=0.5", "unknown key 'colour'"),
        ("ngram:k=4,seed=-1,accept=0.5", "seed must be an integer >= 0, got -1"),
    ],
)
def test_bad_speculative_settings_are_one_line(spec, message):
    with pytest.raises(schedlab.SchedlabError, match=re.escape(message)) as err:
        schedlab.simulate("vllm", "mixed", speculative=spec)
    assert "\n" not in str(err.value) and err.value.code == 2


@pytest.mark.parametrize(
    "spec, message",
    [
        ("ngram:k=4", "needs an acceptance profile"),
        ("ngram:k=4,seed=-1", "--speculative: seed must be an integer >= 0"),
    ],
)
def test_a_bad_speculative_flag_is_one_line_and_exit_2(spec, message):
    proc = subprocess.run(
        [*command("simulate"), "--policy", "vllm", "--trace", "mixed", "--speculative", spec],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_replicas_metrics_carry_vllms_spec_decode_counters():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from schedlab.serving.metrics import _spec_decode

    bench = Bench([Request("d", 0.0, 4, 20), Request("e", 0.0, 6, 20)])
    bench.decoding("d"), bench.decoding("e")
    p = Pass(decode=("d", "e"), draft=(3, 2))
    bench.state.shape(p)
    bench.state.accept("d", 2)  # e: none accepted
    bench.state.apply_pass(p, 0.5)

    class Live:
        def collect(self):
            return _spec_decode("m", bench.state)

    reg = CollectorRegistry()
    reg.register(Live())
    got = {
        (s.name, s.labels.get("position")): s.value
        for fam in text_string_to_metric_families(generate_latest(reg).decode())
        for s in fam.samples
    }
    assert got[("vllm:spec_decode_num_drafts_total", None)] == 2
    assert got[("vllm:spec_decode_num_draft_tokens_total", None)] == 5
    assert got[("vllm:spec_decode_num_accepted_tokens_total", None)] == 2
    per_pos = {k[1]: v for k, v in got.items() if k[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 1, "1": 1, "2": 0}
