"""Invariants of whole simulations: every policy over every bundled trace."""

from __future__ import annotations

import numpy as np
import pytest

from schedlab import traces
from schedlab.policies import POLICIES, make_policy
from schedlab.sim import run_replica, summarize
from schedlab.sim.backend import SimBackend
from simkit import cost_model

CAPACITY = 262_144


def bundled_cases():
    names = ["mixed", "long-context", "sonnet", "real-smoke", "real-mixed"]
    cases = [(n, traces.load(n)) for n in names]
    # the real production traces, windowed so the suite stays fast
    cases.append(("azure2023_conv[0:300s]", traces.window(traces.load("azure2023_conv"), 0, 300)))
    cases.append(("azure2023_code[0:600s]", traces.window(traces.load("azure2023_code"), 0, 600)))
    moon = traces.load("mooncake_conv_10min", seed=0)
    cases.append(("mooncake[0:120s]", traces.window(moon, 0, 120)))
    return cases


CASES = bundled_cases()


class KvWatch:
    def __init__(self, capacity):
        self.capacity = capacity
        self.max_used = 0
        self.steps = 0

    def __call__(self, state):
        self.steps += 1
        assert 0 <= state.kv_used <= self.capacity
        self.max_used = max(self.max_used, state.kv_used)
        if self.steps % 97 == 0:  # the running total equals the sum over requests
            held = sum(r.kv_tokens for r in state.prefilling.values()) + sum(
                r.kv_tokens for r in state.decoding.values()
            )
            assert held == state.kv_used


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_request_finishes_once_with_its_tokens(policy, case):
    name, tr = case
    watch = KvWatch(CAPACITY)
    res = run_replica(
        tr.requests, make_policy(policy), cost_model(), kv_capacity=CAPACITY, trace_name=name, on_step=watch
    )
    assert res.error is None
    assert not res.rejected
    assert len(res.requests) == len(tr.requests)
    by_id = {r.id: r for r in tr.requests}
    for r in res.requests:
        src = by_id[r.id]
        assert r.phase.value == "finished"
        assert r.generated == src.output_tokens == len(r.token_times)
        t = np.asarray(r.token_times)
        assert np.all(np.diff(t) >= 0), f"token times go back in time for {r.id}"
        assert t[0] == r.first_token_s and t[-1] == r.finish_s
        assert r.first_token_s > r.arrival_s  # a pass takes time
        assert r.admitted_s >= r.arrival_s
    assert watch.max_used > 0
    starts = np.array([s.start_s for s in res.steps])
    ends = np.array([s.end_s for s in res.steps])
    assert np.all(ends > starts) and np.all(starts[1:] >= ends[:-1] - 1e-9)
    assert max(s.kv_tokens for s in res.steps) <= CAPACITY
    s = summarize(res)
    assert s["finished"] == len(tr.requests)
    assert s["total_output_tokens"] == sum(r.output_tokens for r in tr.requests)


def test_schedules_differ_on_mixed():
    """The six bundled policies are not one policy under six names. ``vllm`` without KV pressure
    (nothing preempted) schedules what ``unified`` does: decode rows, then prefill chunks in
    admission order, filling the same 2048-token budget."""
    tr = traces.load("mixed")
    results = {
        p: summarize(run_replica(tr.requests, make_policy(p), cost_model(), kv_capacity=CAPACITY, block_size=16))
        for p in POLICIES
    }
    fingerprints = {
        p: (round(s["ttft_ms"]["p50"], 3), round(s["itl_ms"]["p99"], 3), s["steps"]) for p, s in results.items()
    }
    six = {p: f for p, f in fingerprints.items() if p != "vllm"}
    assert len(set(six.values())) == len(six) == 6, fingerprints
    assert "preemptions" not in results["vllm"] and fingerprints["vllm"] == fingerprints["unified"]


def test_kv_capacity_limits_concurrency_without_losing_requests():
    tr = traces.load("real-mixed")
    small = max(r.prompt_tokens + r.output_tokens - 1 for r in tr.requests)
    for policy in POLICIES:
        watch = KvWatch(small)
        res = run_replica(tr.requests, make_policy(policy), cost_model(), kv_capacity=small, on_step=watch)
        assert res.error is None and all(r.finish_s is not None for r in res.requests)
        assert watch.max_used <= small


def test_sim_backend_is_the_default_and_sim_never_imports_mlx():
    import subprocess
    import sys

    code = (
        "import sys, sim, sim.loop, sim.cost, sim.metrics, sim.output, policies, traces;"
        "import schedlab.sim.profiles;"
        "assert 'mlx' not in sys.modules and 'engine' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert SimBackend.mode == "sim"


def test_itl_pools_finished_requests_only_and_survives_more_tokens():
    """ITL: every gap inside each finished request, none across two requests, none of a request
    still running (a run stopped early); asked again after more tokens came, the answer follows."""
    from types import SimpleNamespace

    from schedlab.sim.metrics import summarize as summ

    def req(rid, times, done):
        return SimpleNamespace(
            id=rid,
            arrival_s=0.0,
            prompt_tokens=4,
            output_tokens=len(times),
            first_token_s=times[0] if times else None,
            finish_s=times[-1] if done else None,
            token_times=list(times),
            preemptions=0,
            recomputed_tokens=0,
            cached_tokens=0,
        )

    reqs = [
        req("a", [1.0, 1.5, 3.5], True),
        req("b", [2.0, 2.25], False),
        req("c", [], False),
        req("d", [4.0, 4.125, 5.0], True),
    ]
    res = SimpleNamespace(
        requests=reqs, rejected=[], steps=[], policy="p", mode="sim", trace="t", wall_s=0.0, error=None, meta={}
    )
    expected = np.array([0.5, 2.0, 0.125, 0.875]) * 1e3
    assert summ(res)["itl_ms"]["p50"] == pytest.approx(np.percentile(expected, 50))
    assert summ(res)["itl_ms"]["mean"] == pytest.approx(expected.mean())
    reqs[1].token_times.append(2.75)  # b goes on and finishes: its gaps count now
    reqs[1].finish_s = 2.75
    expected = np.array([0.5, 2.0, 0.25, 0.5, 0.125, 0.875]) * 1e3
    s = summ(res)
    assert s["itl_ms"]["p99"] == pytest.approx(np.percentile(expected, 99))
    assert s["itl_ms"]["mean"] == pytest.approx(expected.mean())
