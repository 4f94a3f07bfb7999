"""Several replicas behind a router (``sim.cluster``): one replica is the single-replica run byte
for byte; routers spread, keep prefixes together and see stale signals as asked; an illegal
route is one line; the signals a router reads are what the replicas held at that time; and, over
random traces, routers and cluster sizes, every request is answered exactly once."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import schedlab
from schedlab.policies import make_policy
from schedlab.routers import ROUTERS, make_router
from schedlab.sim import Deployment, Group, run, run_replica
from schedlab.sim.sources import ClientSource
from schedlab.traces.schema import Request
from simkit import command, cost_model, read_table
from test_properties import POLICY_OPTIONS, traces_


def run_cluster(arrivals, policies, cost, router, *, kv_capacity, router_delay=0.0, fail=(), block_size=1, **kw):
    """``sim.run`` of one group of replicas (one policy object each) behind ``router``."""
    group = Group(tuple(policies), cost, kv_capacity)
    deployment = Deployment((group,), router, router_delay, fail, block_size=block_size, **kw)
    return run(deployment, arrivals)


def cluster(reqs, router, n, policy="unified", **kw):
    router = make_router(router) if isinstance(router, str) else router
    kw.setdefault("kv_capacity", 100_000)
    return run_cluster(reqs, [make_policy(policy) for _ in range(n)], cost_model(), router, **kw)


class Recorder:
    """least-requests, keeping every view it was shown."""

    name = "recorder"

    def __init__(self):
        self.views = []
        self.inner = make_router("least-requests")

    def route(self, view):
        self.views.append(view)
        return self.inner.route(view)


# ---------------------------------------------------------------- one replica is one replica

SAME_AS_ONE = [
    ("vllm", "least-requests", {}),
    ("unified", "weighted", {"prefix_caching": True}),  # Plan.repeat's bulk steps, prefix cache
    ("static", "random", {}),  # a million repeated steps on the hour: Plan.repeat all along
    ("vllm", "power-of-two", {"max_concurrency": 8, "kv_tokens": 20000}),  # clients, preemption
]


@pytest.mark.parametrize("policy,router,kw", SAME_AS_ONE, ids=[f"{p}-{r}" for p, r, _ in SAME_AS_ONE])
def test_one_replica_through_the_cluster_gives_the_single_replica_files_byte_for_byte(tmp_path, policy, router, kw):
    one = schedlab.simulate(policy, "mixed", **kw)
    via = schedlab.simulate(policy, "mixed", router=router, replicas=1, **kw)
    assert via.meta["cluster"] == {**via.meta["cluster"], "replicas": 1, "router": router}  # (the cluster ran)
    assert "cluster" not in one.meta
    a, b = one.save(tmp_path / "one"), via.save(tmp_path / "via")
    for name in ("summary.json", "requests.csv", "tokens.parquet", "steps.parquet", "passes.parquet"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert one.summary["finished"] >= 300  # (a real run, not an empty one)


# ---------------------------------------------------------------- routers at work


def test_round_robin_spreads_evenly_and_the_files_say_which_replica(tmp_path):
    reqs = [Request(f"r{i}", i * 0.05, 40 + i, 10 + i % 7) for i in range(31)]
    res = cluster(reqs, "round-robin", 3)
    assert res.error is None
    assert res.replica == [i % 3 for i in range(31)]
    assert [len(p.requests) for p in res.replicas] == [11, 10, 10]
    assert [r.id for r in res.replicas[1].requests] == [f"r{i}" for i in range(1, 31, 3)]
    # the same run through the API: summary per replica, replica columns
    run_ = schedlab.simulate("unified", reqs, replicas=3, router="round-robin", passes=True)
    out = run_.save(tmp_path / "rr")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cluster"]["replicas"] == 3 and summary["cluster"]["router"] == "round-robin"
    assert [p["replica"] for p in summary["replicas"]] == [0, 1, 2]
    assert [p["finished"] for p in summary["replicas"]] == [11, 10, 10]
    assert sum(p["total_output_tokens"] for p in summary["replicas"]) == summary["total_output_tokens"]
    rows = read_table(out / "requests.csv")
    assert [int(r["replica"]) for r in rows] == [i % 3 for i in range(31)]
    steps = read_table(out / "steps.parquet")
    assert {s["replica"] for s in steps} == {0, 1, 2} and len(steps) == summary["steps"]
    passes = read_table(out / "passes.parquet")
    where = {r["id"]: int(r["replica"]) for r in rows}
    assert all(p["replica"] == where[p["request_id"]] for p in passes)
    assert "Replica 2 successful requests:" in run_.report()
    # the same inputs, the same run
    again = cluster(reqs, "round-robin", 3)
    assert [r.token_times for r in again.requests] == [r.token_times for r in res.requests]


def test_prefix_affinity_keeps_a_prefix_on_one_replica_until_its_bound():
    # r0 computes the shared 512-token block on replica 0; r1..r5 arrive while it decodes
    times = [0.0, 0.5, 0.6, 0.7, 0.8, 0.9]
    reqs = [Request(f"r{i}", t, 600, 400, (7,)) for i, t in enumerate(times)]
    kw = {"block_size": 16, "prefix_caching": True}
    res = cluster(reqs, make_router("prefix-affinity", {"max_requests": 3}), 3, **kw)
    assert res.error is None
    # four on replica 0 (up to 3 unfinished there, it takes one more); then replica 1, which
    # holds the prefix from r4 on
    assert res.replica == [0, 0, 0, 0, 1, 1]
    assert [r.cached_tokens for r in res.requests] == [0, 512, 512, 512, 0, 512]
    spread = cluster(reqs, "least-requests", 3, **kw)
    assert spread.replica == [0, 1, 2, 0, 1, 2]
    assert sum(r.cached_tokens for r in spread.requests) < sum(r.cached_tokens for r in res.requests)


def test_router_delay_changes_least_requests_choices():
    burst = [Request(f"b{i}", 1.0, 50, 20) for i in range(4)]
    assert cluster(burst, "least-requests", 2).replica == [0, 1, 0, 1]
    # half a second late, the router sees an empty cluster at every one of them
    assert cluster(burst, "least-requests", 2, router_delay=0.5).replica == [0, 0, 0, 0]
    # a long request still running at 1.0 s: seen with a delay under 1 s, not with 2 s
    pair = [Request("long", 0.0, 50, 2000), Request("next", 1.0, 50, 5)]
    assert cluster(pair, "least-requests", 2, router_delay=0.9).replica == [0, 1]
    assert cluster(pair, "least-requests", 2, router_delay=2.0).replica == [0, 0]


class Pin(Recorder):
    """Request "a" to replica 0, every other one to replica 1; keeps the views."""

    def route(self, view):
        self.views.append(view)
        return 0 if view.request.id == "a" else 1


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_the_signals_are_what_the_replica_held_at_that_time(delay):
    """The router shown a replica at time x (the arrival less the delay) sees what the run's
    own times say it held at x: through bulk decode steps, and not the step in progress."""
    reqs = [Request("a", 0.0, 300, 900)] + [Request(f"q{i}", 0.2 + 0.37 * i, 40 + 9 * i, 3 + i) for i in range(8)]
    pin = Pin()
    res = cluster(reqs, pin, 2, router_delay=delay)
    assert res.error is None and all(r.finish_s is not None for r in res.requests)
    a = res.requests[0]
    others = res.requests[1:]
    checked = 0
    for v in pin.views[1:]:
        x = v.now - delay
        s0, s1 = v.replicas
        if x < 0:
            assert s0 == (0, 0, 0, 0, 0, 0, 100_000, 0, True)
            continue
        assert x >= a.first_token_s  # (a decodes from 0.02 s on)
        done = sum(1 for t in a.token_times if t <= x)  # a's tokens out by x
        assert (s0.waiting, s0.running, s0.prompt_tokens) == (0, 1, 0)
        assert (s0.output_tokens, s0.kv_used) == (900 - done, 300 + done - 1)
        # replica 1: the requests sent by x (before this one) and not finished by x
        live = [r for r in others if r.arrival_s <= x and r.finish_s > x and r.id != v.request.id]
        assert s1.requests == len(live)
        assert s1.output_tokens == sum(r.output_tokens - sum(1 for t in r.token_times if t <= x) for r in live)
        checked += 1
    assert checked >= 6
    # the first arrival saw an empty cluster
    assert pin.views[0].replicas == tuple(type(s)(s.index, kv_capacity=s.kv_capacity) for s in pin.views[0].replicas)


class Bad:
    def __init__(self, answer):
        self.answer = answer
        self.name = "bad"

    def route(self, view):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize(
    "answer,fragment",
    [
        (5, "returned replica 5, but the cluster has replicas 0 to 1"),
        (-1, "returned replica -1"),
        ("1", "returned '1', not a replica index (0 to 1)"),
        (True, "returned True, not a replica index"),
        (1.0, "returned 1.0, not a replica index"),
        (ValueError("no idea"), "route() raised ValueError: no idea"),
    ],
)
def test_an_illegal_route_stops_the_run_with_one_line(answer, fragment):
    reqs = [Request("r0", 0.0, 10, 3), Request("r1", 0.1, 10, 3)]
    res = cluster(reqs, Bad(answer), 2)
    assert res.error is not None and "\n" not in res.error
    assert res.error.startswith("router 'bad' request r0: ") and fragment in res.error
    run_ = schedlab.simulate("unified", reqs, replicas=2, router=Bad(answer))
    assert run_.error == res.error and run_.problems == [res.error]


def test_a_policy_error_names_its_replica():
    class Broken:
        name = "broken"

        def plan(self, view):
            raise RuntimeError("oops")

    reqs = [Request("r0", 0.0, 10, 3), Request("r1", 0.1, 10, 3)]
    res = run_cluster(
        reqs, [make_policy("unified"), Broken()], cost_model(), make_router("round-robin"), kv_capacity=99
    )
    assert res.error == "replica 1: policy 'broken' step 0 raised RuntimeError: oops"


def test_a_policy_object_is_copied_for_each_replica():
    class Counting:
        """unified, counting the steps it planned (its own state)."""

        name = "counting"

        def __init__(self):
            self.inner = make_policy("unified")
            self.planned = 0

        def plan(self, view):
            self.planned += 1
            return self.inner.plan(view)

    reqs = [Request(f"r{i}", i * 0.01, 30, 20) for i in range(8)]
    pol = Counting()
    one = schedlab.simulate(pol, reqs, replicas=2, router="round-robin")
    assert one.error is None and one.summary["finished"] == 8
    # replica 0 ran the object given, replica 1 a copy of it: the object saw replica 0's steps only
    assert 0 < pol.planned < one.summary["steps"] + 8
    assert pol.planned <= one.summary["replicas"][0]["steps"] + 4


def test_bad_cluster_options_are_one_line_errors():
    reqs = [Request("r0", 0.0, 10, 3)]
    for kw, msg in [
        ({"replicas": 0}, "replicas must be >= 1, got 0"),
        ({"replicas": 2.5}, "replicas must be an integer"),
        ({"router_delay": -1.0}, "router_delay must be a finite number of seconds >= 0"),
        ({"router": "nope"}, "unknown router 'nope'"),
        ({"router": "random", "router_options": {"speed": 1}}, "router 'random' has no option 'speed'"),
        ({"router_options": {"seed": 1}}, "router_option goes with router"),
    ]:
        with pytest.raises(schedlab.SchedlabError, match=msg) as exc:
            schedlab.simulate("unified", reqs, **kw)
        assert exc.value.code == 2, kw
    with pytest.raises(schedlab.SchedlabError, match="give either cluster= or replicas, not both"):
        schedlab.simulate("unified", reqs, cluster=schedlab.ClusterOptions(replicas=2), replicas=3)


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*command("simulate"), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_the_command(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("class Far:\n    name = 'far'\n    def route(self, view):\n        return 7\n")
    trace = tmp_path / "t.json"
    trace.write_text(
        json.dumps(
            {
                "requests": [
                    {"id": f"q{i}", "arrival_s": i * 0.1, "prompt_tokens": 20, "output_tokens": 4} for i in range(6)
                ]
            }
        )
    )
    ok = cli("--policy", "unified", "--trace", str(trace), "--replicas", "2", "--router", "round-robin",
             "--router-delay", "0.05", "--out", str(tmp_path / "o"))  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "Replicas:                                2" in ok.stdout and "Router:   " in ok.stdout
    assert [r["replica"] for r in read_table(tmp_path / "o" / "requests.csv")] == ["0", "1"] * 3
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["cluster"] == {"replicas": 2, "router": "round-robin", "router_options": {}, "router_delay": 0.05}
    for args, code, frag in [
        (["--replicas", "0"], 2, "--replicas must be >= 1"),
        (["--router", "nope"], 2, "unknown router 'nope'"),
        (["--router", "random", "--router-option", "nope=1"], 2, "router 'random' has no option 'nope'"),
        (["--router-delay", "-1"], 2, "--router-delay must be a finite number of seconds >= 0"),
        (["--replicas", "2", "--router", f"{f}:Far"], 1, "router 'far' request q0: returned replica 7"),
        (["--replicas", "2", "--fail", "2@1"], 2, "--fail '2@1': the cluster has replicas 0 to 1"),
        (["--replicas", "2", "--fail", "1"], 2, "--fail is REPLICA@SECONDS such as 1@30, got '1'"),
        (["--replicas", "2", "--fail", "1@1", "--fail", "1@2"], 2, "replica 1 fails twice"),
    ]:
        proc = cli("--policy", "unified", "--trace", str(trace), *args)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == code and len(lines) == 1 and frag in lines[0], (args, proc.stderr)


def test_closed_loop_clients_across_replicas_send_at_the_finishes_and_start_at_once():
    """Two replicas, three clients, all issued at once: request k >= 3 is sent at the (k-2)-th
    finish among those before it, whichever replica that was on; and the replica it goes to
    admits it at its first step after it arrived (no replica ran ahead past a send it could not
    foresee; a step that starts at the very instant it is sent plans without it, as on one
    replica)."""
    reqs = [Request(f"c{i}", 0.0, 30 + 17 * (i % 4), 5 + 11 * (i % 5)) for i in range(14)]
    res = cluster(ClientSource(reqs, 3), "least-tokens", 2)
    assert res.error is None and all(r.finish_s is not None for r in res.requests)
    by = {r.id: r for r in res.requests}
    for k in range(3, 14):
        earlier = sorted(by[f"c{j}"].finish_s for j in range(k))
        assert by[f"c{k}"].arrival_s == pytest.approx(earlier[k - 3], abs=1e-12)
    assert set(res.replica) == {0, 1}
    for r, j in zip(res.requests, res.replica):
        starts = res.replicas[j].steps.columns[1]
        first = min(t for t in starts if t >= r.arrival_s)
        assert r.admitted_s in (first, min(t for t in starts if t > first)), r.id


# ---------------------------------------------------------------- properties


@st.composite
def cluster_setups(draw):
    reqs, _ = draw(traces_())
    name = draw(st.sampled_from(sorted(POLICY_OPTIONS)))
    opts = {k: draw(s) for k, s in POLICY_OPTIONS[name].items() if draw(st.booleans())}
    bs = draw(st.sampled_from([1, 16]))
    biggest = max(r.prompt_tokens + r.output_tokens - 1 for r in reqs)
    kv = draw(st.integers(max(1, biggest - 40), biggest * 3 + 64))
    n = draw(st.integers(1, 4))
    end = max(r.arrival_s for r in reqs) + 2.0
    dead = draw(st.sets(st.integers(0, n - 1), max_size=n))
    return {
        "reqs": reqs,
        "policy": (name, opts),
        "router": draw(st.sampled_from(sorted(ROUTERS))),
        "n": n,
        "fail": [(i, draw(st.floats(0.0, end, allow_nan=False))) for i in sorted(dead)],
        "delay": draw(st.sampled_from([0.0, 0.01, 0.5])),
        "kv": kv,
        "bs": bs,
        "prefix": draw(st.booleans()),
        "clients": draw(st.one_of(st.none(), st.integers(1, 4))),
    }


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster_setups())
def test_every_request_is_answered_once_by_one_replica(d):
    reqs = d["reqs"]
    name, opts = d["policy"]
    arrivals = ClientSource(reqs, d["clients"]) if d["clients"] else reqs
    res = run_cluster(
        arrivals,
        [make_policy(name, opts) for _ in range(d["n"])],
        cost_model(),
        make_router(d["router"]),
        kv_capacity=d["kv"],
        block_size=d["bs"],
        prefix_caching=d["prefix"],
        router_delay=d["delay"],
        fail=d["fail"],
    )
    assert res.error is None, res.error
    assert sorted(r.id for r in res.requests) == sorted(r.id for r in reqs)  # each exactly once
    assert len(res.replica) == len(res.requests) and set(res.replica) <= set(range(d["n"])) | {-1}
    parts = [{id(r) for r in p.requests} for p in res.replicas]
    nowhere = res.replica.count(-1)  # arrived when no replica was up: refused by the cluster itself
    retried = (res.cluster.get("retried") or {}) if d["fail"] else {}
    # on one replica only (the one the router chose), and on a second one when retried after a failure
    assert sum(map(len, parts)) == len(reqs) + len(retried) - nowhere
    dies = dict(d["fail"])
    refused = {r.id: why for r, why in res.rejected}
    assert len(refused) == len(res.rejected)  # refused once
    want = {r.id: r.output_tokens for r in reqs}
    for r, j in zip(res.requests, res.replica):
        if j == -1:
            assert refused[r.id] == "no replica is up" and len(dies) == d["n"]
            continue
        assert id(r) in parts[j]
        if r.id in refused:
            assert r.finish_s is None
            why = refused[r.id]
            if "KV capacity" not in why:  # refused because its replica failed
                assert j in dies and f"replica {j} failed at" in why, why
                had = sum(t <= dies[j] for t in r.token_times)
                assert ("after" in why) == (had > 0) and (had > 0 or r.id in retried or "no replica is up" in why)
        elif r.cancelled_s is not None:  # its client went away: ended early, on its replica
            assert r.finish_s == r.cancelled_s and len(r.token_times) == r.output_tokens < want[r.id]
            assert j not in dies or r.finish_s <= dies[j]
        else:
            assert r.finish_s is not None and len(r.token_times) == want[r.id] == r.output_tokens
            assert r.first_token_s >= r.arrival_s
            assert j not in dies or r.finish_s <= dies[j]  # nothing ends on a replica after it died
        if r.id in retried:
            assert retried[r.id] in dies and retried[r.id] != j
    too_big = {r.id for r in reqs if r.prompt_tokens + r.output_tokens - 1 > res.kv_capacity}  # (whole blocks)
    assert too_big <= set(refused) and (bool(d["fail"]) or set(refused) == too_big)


class Counted:
    """``inner``, counting its plans; ``keep``: "all" its plans as they are, "repeat" without
    ``past_arrivals`` (bulk runs stop at every arrival), "none" without ``repeat`` (every step
    planned on its own)."""

    def __init__(self, inner, keep: str = "all"):
        self.inner, self.name, self.keep, self.plans = inner, inner.name, keep, 0

    def plan(self, view):
        from schedlab.policies.base import Plan

        self.plans += 1
        p = self.inner.plan(view)
        if self.keep == "all" or not p.repeat:
            return p
        return Plan(p.admit, p.preempt, p.passes, p.repeat if self.keep == "repeat" else 0)


def fingerprint(res):
    return (
        [(r.id, r.arrival_s, tuple(r.token_times), r.finish_s, r.preemptions) for r in res.requests],
        list(res.replica),
        list(res.steps),
        [(r.id, why) for r, why in res.rejected],
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster_setups())
def test_bulk_steps_past_arrivals_equal_planning_every_step(d):
    """Replicas run their bulk decode steps past arrivals where the plan holds ``past_arrivals``
    (the router seeing them as they were at each arrival, undoing the steps run ahead): the run is
    the one that plans every step, request for request, route for route, step for step."""
    name, opts = d["policy"]
    arrivals = (lambda: ClientSource(d["reqs"], d["clients"])) if d["clients"] else (lambda: d["reqs"])
    kw = dict(
        kv_capacity=d["kv"], block_size=d["bs"], prefix_caching=d["prefix"], router_delay=d["delay"], fail=d["fail"]
    )
    runs = [
        run_cluster(
            arrivals(),
            [wrap(make_policy(name, opts)) for _ in range(d["n"])],
            cost_model(),
            make_router(d["router"]),
            **kw,
        )
        for wrap in (lambda p: p, lambda p: Counted(p, "none"))
    ]
    assert runs[0].error == runs[1].error
    assert fingerprint(runs[0]) == fingerprint(runs[1])


def test_an_overloaded_cluster_runs_past_arrivals_and_plans_less():
    """Four overloaded replicas (requests queue on each): a plan whose waiting head was refused
    runs on past arrivals, with fewer plans asked than when every arrival stops the run, and the
    same run as planning every step."""
    from schedlab import traces

    reqs = [dataclasses.replace(r, arrival_s=r.arrival_s / 8) for r in traces.load("azure2023_conv").requests[:800]]
    got = {}
    for keep in ("all", "repeat", "none"):
        pols = [Counted(make_policy("unified", {"max_batch": 8}), keep) for _ in range(4)]
        res = run_cluster(reqs, pols, cost_model(), make_router("least-kv"), kv_capacity=40_000, router_delay=0.05)
        assert res.error is None and all(r.finish_s is not None for r in res.requests)
        got[keep] = (fingerprint(res), sum(p.plans for p in pols))
    assert got["all"][0] == got["repeat"][0] == got["none"][0]
    plans = {k: v[1] for k, v in got.items()}
    # (bulk steps that an arrival to another replica stopped go on without asking, either way)
    assert plans["all"] < 0.9 * plans["repeat"] < 0.2 * plans["none"], plans


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster_setups())
def test_the_work_counters_are_what_is_outstanding_at_every_step(d):
    """``prompt_done`` and ``output_done`` (what the signals subtract from what was sent) always
    leave exactly the prompt tokens still to compute and the output tokens still to produce,
    preemptions and prefix hits included."""
    name, opts = d["policy"]

    def check(state):
        live = [r for r in state.accepted if r.finish_s is None]
        sent = state.accepted
        # (not remaining_prompt: a waiting request's cached prefix is not in its KV cache yet)
        left = sum(r.prefill_target - r.prefilled for r in live)
        assert sum(r.prompt_tokens for r in sent) - state.prompt_done == left
        # (as sent: a cancelled request's output_tokens are what it produced before its end)
        assert sum(r.request.output_tokens for r in sent) - state.output_done == sum(r.tokens_left for r in live)

    res = run_replica(
        d["reqs"],
        make_policy(name, opts),
        cost_model(),
        kv_capacity=d["kv"],
        block_size=d["bs"],
        prefix_caching=d["prefix"],
        on_step=check,
    )
    assert res.error is None, res.error


def test_the_cluster_module_is_documented_where_users_look():
    text = (Path(__file__).resolve().parent.parent / "docs" / "cluster.md").read_text()
    for name in ROUTERS:
        assert f"`{name}`" in text, name


# ---------------------------------------------------------------- faults


def test_a_failed_replica_retries_what_had_no_token_and_refuses_what_had():
    """Two replicas, round-robin; replica 1 dies mid-run: its request that was decoding is refused
    with the tokens it had, the one still waiting is served by replica 0 with its own arrival
    time, nothing ends on replica 1 after its death, and the router never sees it up again."""
    reqs = [
        Request("a", 0.0, 64, 400),  # -> 0
        Request("b", 0.0, 64, 400),  # -> 1, decoding when replica 1 dies
        Request("c", 0.01, 64, 8),  # -> 0
        Request("d", 0.01, 4000, 8),  # -> 1, behind b (static batches of one): no token yet
        Request("e", 5.0, 16, 4),  # after the death: round-robin skips replica 1
    ]
    rec = Recorder()
    rec.inner = make_router("round-robin")

    def go(router, **kw):
        pols = [make_policy("static", {"batch_size": 1}) for _ in range(2)]
        return run_cluster(reqs, pols, cost_model(), router, kv_capacity=10_000, **kw)

    res, res_ok = go(rec, fail=[(1, 1.0)]), go(make_router("round-robin"))
    assert res.error is None and res_ok.error is None
    assert res_ok.replica == [0, 1, 0, 1, 0]
    by = {r.id: (r, j) for r, j in zip(res.requests, res.replica)}
    refused = dict((r.id, why) for r, why in res.rejected)
    b, _ = by["b"]
    had = sum(t <= 1.0 for t in b.token_times)
    assert had > 0 and refused == {"b": f"replica 1 failed at 1 s after {had} token(s)"}
    d, j = by["d"]
    assert j == 0 and d.finish_s is not None and d.arrival_s == 0.01 and d.first_token_s > 1.0
    assert len(d.token_times) == 8
    assert res.cluster["retried"] == {"d": 1}
    assert res.cluster["failures"] == [{"replica": 1, "at_s": 1.0, "retried": 1, "refused": 1}]
    assert all(r.finish_s is None or r.finish_s <= 1.0 for r in res.replicas[1].requests)
    assert by["e"][1] == 0
    late = [v for v in rec.views if v.now >= 1.0]
    assert late and all(not v.replicas[1].up for v in late) and all(v.replicas[1].up for v in rec.views if v.now < 1.0)


def test_the_command_fails_a_replica_and_says_what_became_of_its_requests(tmp_path):
    trace = tmp_path / "t.json"
    reqs = [{"id": f"q{i}", "arrival_s": i * 0.01, "prompt_tokens": 30, "output_tokens": 300} for i in range(6)]
    trace.write_text(json.dumps({"requests": reqs}))
    args = ["--policy", "static", "-o", "batch_size=1", "--trace", str(trace), "--replicas", "2"]
    proc = subprocess.run([*command("simulate"), *args, "--fail", "1@0.5", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr  # a refusal the experiment asked for is not an error
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    (f,) = s["cluster"]["failures"]
    # replica 1 held q1 (decoding at 0.5 s: refused), q3 and q5 (no token yet: to replica 0)
    assert f == {"replica": 1, "at_s": 0.5, "retried": 2, "refused": 1}
    rows = {r["id"]: r for r in read_table(tmp_path / "o" / "requests.csv")}
    assert [rows[f"q{i}"]["replica"] for i in range(6)] == ["0", "1", "0", "0", "0", "0"]
    assert rows["q1"]["status"] == "rejected" and all(rows[f"q{i}"]["status"] == "finished" for i in (0, 2, 3, 4, 5))
    assert "Replica 1 failed at (s):" in proc.stdout and "2 / 1" in proc.stdout


def test_bad_failures_are_one_line_errors():
    for fail, fragment in [
        ([(2, 1.0)], "replicas 0 to 1"),
        ([(0, -1.0)], "finite number of seconds >= 0"),
        ([(0, 1.0), (0, 2.0)], "fails twice"),
        ([(0,)], "(replica, seconds)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            cluster([Request("a", 0.0, 4, 4)], "round-robin", 2, fail=fail)
