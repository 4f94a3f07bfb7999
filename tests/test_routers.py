"""Routers on hand-built cluster views: each bundled router's choice, its options, loading a
user's router, and the registry's errors."""

from __future__ import annotations

import pytest

from schedlab.routers import (
    ROUTERS,
    ClusterView,
    ReplicaSignals,
    RouterNotFound,
    RouterOptionError,
    make_router,
)
from schedlab.traces.schema import Request

REQ = Request("q", 1.0, 1000, 50)


def view(*replicas: dict, request: Request = REQ, arrival: int = 0) -> ClusterView:
    """A cluster view from one dict of signals per replica (defaults: idle, 1000 KV tokens)."""
    sig = tuple(ReplicaSignals(i, **{"kv_capacity": 1000, **r}) for i, r in enumerate(replicas))
    return ClusterView(1.0, request, arrival, sig)


def test_signals_derived_values():
    s = ReplicaSignals(0, waiting=2, running=3, prompt_tokens=100, output_tokens=40, kv_used=250, kv_capacity=1000)
    assert (s.requests, s.tokens, s.kv_utilisation) == (5, 140, 0.25)
    v = view({}, {"up": False}, {})
    assert [r.index for r in v.up()] == [0, 2]


def test_round_robin_cycles_and_skips_a_replica_that_is_down():
    rr = make_router("round-robin")
    three = view({}, {}, {})
    assert [rr.route(three) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    rr = make_router("round-robin")
    down1 = view({}, {"up": False}, {})
    assert [rr.route(down1) for _ in range(4)] == [0, 2, 0, 2]


def test_random_is_seeded_uniform_and_never_picks_a_replica_that_is_down():
    v = view({}, {}, {"up": False}, {})
    r1, r2, r3 = (make_router("random", {"seed": s}) for s in (7, 7, 8))
    s1 = [r1.route(v) for _ in range(200)]
    s2 = [r2.route(v) for _ in range(200)]
    s3 = [r3.route(v) for _ in range(200)]
    assert s1 == s2 and s1 != s3
    assert set(s1) == {0, 1, 3}  # every replica up, none that is down
    assert all(40 < s1.count(i) < 95 for i in (0, 1, 3))


def test_least_requests_counts_waiting_and_running_lowest_index_on_a_tie():
    r = make_router("least-requests")
    assert r.route(view({"waiting": 2}, {"running": 1}, {"waiting": 1, "running": 1})) == 1
    assert r.route(view({"running": 1}, {"waiting": 1}, {"running": 2})) == 0
    # the least loaded replica is down: the next least loaded one
    assert r.route(view({"running": 3}, {"up": False}, {"running": 2})) == 2


def test_least_tokens_weighs_outstanding_tokens_not_requests():
    r = make_router("least-tokens")
    # replica 0 has one request with a long prompt still to compute; replica 1 three short ones
    v = view({"waiting": 1, "prompt_tokens": 8000, "output_tokens": 100}, {"running": 3, "output_tokens": 300})
    assert r.route(v) == 1
    assert make_router("least-requests").route(v) == 0


def test_least_kv_compares_utilisation_not_tokens():
    r = make_router("least-kv")
    # 600 of 2000 (30%) beats 400 of 1000 (40%)
    assert r.route(view({"kv_used": 400, "kv_capacity": 1000}, {"kv_used": 600, "kv_capacity": 2000})) == 1
    # equal utilisation: fewer requests, then the lowest index
    assert r.route(view({"kv_used": 100, "running": 3}, {"kv_used": 100, "running": 1})) == 1
    assert r.route(view({"kv_used": 100}, {"kv_used": 100})) == 0


def test_power_of_two_takes_the_less_loaded_of_two_distinct_draws():
    loads = [5, 0, 9, 2]
    v = view(*({"running": n} for n in loads))
    r = make_router("power-of-two", {"seed": 1})
    picks = [r.route(v) for _ in range(300)]
    # the most loaded replica can only lose a comparison; every other one wins some
    assert 2 not in picks and {0, 1, 3} <= set(picks)
    # the least loaded replica wins every draw it is in (half of the pairs): the most picked
    assert max(set(picks), key=picks.count) == 1
    # two replicas: both are always drawn, so it is least-requests
    two = make_router("power-of-two")
    assert {two.route(view({"running": 4}, {"running": 1})) for _ in range(20)} == {1}
    assert make_router("power-of-two", {"seed": 1}).route(v) == picks[0]


def test_prefix_affinity_longest_prefix_until_its_bound_then_least_loaded():
    r = make_router("prefix-affinity", {"max_requests": 4})
    # the longest cached prefix wins over a lighter replica
    assert r.route(view({"running": 1}, {"running": 3, "prefix_hit": 512}, {"prefix_hit": 256})) == 1
    # at the bound it still takes it; beyond the bound the least loaded replica does
    assert r.route(view({"running": 1}, {"running": 4, "prefix_hit": 512})) == 1
    assert r.route(view({"running": 1}, {"running": 5, "prefix_hit": 512}, {"running": 2})) == 0
    # the same prefix on two replicas: the lighter one
    assert r.route(view({"running": 3, "prefix_hit": 512}, {"running": 2, "prefix_hit": 512}, {})) == 1
    # no replica holds any of it: least loaded
    assert r.route(view({"running": 2}, {"running": 1}, {"running": 1})) == 1
    # a hit shorter than min_hit does not count
    short = make_router("prefix-affinity", {"min_hit": 100})
    assert short.route(view({"running": 1}, {"running": 2, "prefix_hit": 64})) == 0
    assert short.route(view({"running": 1}, {"running": 2, "prefix_hit": 128})) == 1


def test_weighted_scores_queue_kv_and_prefix():
    v = view(
        {"waiting": 4, "kv_used": 100},  # long queue, empty KV
        {"waiting": 0, "kv_used": 900},  # no queue, full KV
        {"waiting": 2, "kv_used": 500, "prefix_hit": 500},  # half the prompt cached
    )
    only = {
        "queue": {"queue_weight": 1, "kv_weight": 0, "prefix_weight": 0},
        "kv": {"queue_weight": 0, "kv_weight": 1, "prefix_weight": 0},
        "prefix": {"queue_weight": 0, "kv_weight": 0, "prefix_weight": 1},
    }
    assert make_router("weighted", only["queue"]).route(v) == 1
    assert make_router("weighted", only["kv"]).route(v) == 0
    assert make_router("weighted", only["prefix"]).route(v) == 2
    w = make_router("weighted")  # 1, 1, 1: queue 0 + kv 0.9; 1 + 0.1; 0.5 + 0.5 + 0.5
    assert w.scores(v) == pytest.approx({0: 0.9, 1: 1.1, 2: 1.5})
    assert w.route(v) == 2
    # equal queues all score 1 (no division by zero)
    assert make_router("weighted", only["queue"]).scores(view({}, {})) == {0: 1.0, 1: 1.0}


def test_registry_options_and_errors(tmp_path):
    assert set(ROUTERS) == {
        "round-robin",
        "random",
        "least-requests",
        "least-tokens",
        "least-kv",
        "power-of-two",
        "prefix-affinity",
        "weighted",
    }
    for name, cls in ROUTERS.items():
        r = make_router(name)
        assert r.name == name and isinstance(r, cls)
    # strings from the command line take the option's type
    assert make_router("random", {"seed": "3"}).seed == 3
    assert make_router("weighted", {"kv-weight": "2.5"}).kv_weight == 2.5
    assert make_router("random", {"seed": "3"}).options() == {"seed": 3}
    assert make_router("round-robin").options() == {}
    with pytest.raises(RouterNotFound, match="unknown router 'nope'.*least-requests"):
        make_router("nope")
    with pytest.raises(RouterOptionError, match="router 'random' has no option 'speed' \\(options: seed\\)"):
        make_router("random", {"speed": "1"})
    with pytest.raises(RouterOptionError, match="_next"):  # (state is no option)
        make_router("round-robin", {"_next": 2})
    with pytest.raises(RouterOptionError, match="seed='x' is not a valid int"):
        make_router("random", {"seed": "x"})
    with pytest.raises(RouterOptionError, match="max_requests must be >= 1"):
        make_router("prefix-affinity", {"max_requests": "0"})
    with pytest.raises(RouterOptionError, match="queue_weight must be >= 0"):
        make_router("weighted", {"queue_weight": -1.0})
    with pytest.raises(RouterOptionError, match="at least one weight"):
        make_router("weighted", {"queue_weight": 0, "kv_weight": 0, "prefix_weight": 0})
    assert RouterNotFound.code == RouterOptionError.code == 2


def test_a_users_router_from_a_file(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text(
        "class Last:\n"
        "    name = 'last'\n"
        "    def __init__(self, skip=0):\n"
        "        self.skip = int(skip)\n"
        "    def route(self, view):\n"
        "        return len(view.replicas) - 1 - self.skip\n"
        "class NoRoute:\n"
        "    pass\n"
    )
    r = make_router(f"{f}:Last", {"skip": "1"})
    assert r.name == "last" and r.route(view({}, {}, {})) == 1
    with pytest.raises(RouterOptionError, match="mine.py:Last"):
        make_router(f"{f}:Last", {"nope": 1})
    with pytest.raises(RouterNotFound, match="not a class with a route"):
        make_router(f"{f}:NoRoute")
    with pytest.raises(RouterNotFound, match="router file not found"):
        make_router(f"{tmp_path / 'missing.py'}:Last")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RouterNotFound, match="cannot load router .*RuntimeError: boom"):
        make_router(f"{tmp_path / 'broken.py'}:X")
