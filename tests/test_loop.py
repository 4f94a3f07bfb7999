"""The loop itself: a backend that owns time, a clock, arrival sources.

A fake backend returning fixed seconds drives ``run_replica()`` with the bundled ``unified`` policy,
and every timestamp is checked against a hand-worked schedule: whatever the loop does with
the seconds a backend returns (overhead, pass order, idle waiting, arrivals during a step)
shows up here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from schedlab.policies import make_policy
from schedlab.sim import SimClock, run_replica
from schedlab.sim.cost import LinearCostModel
from schedlab import traces
from schedlab.traces.schema import Request

DECODE_S, PREFILL_S = 0.25, 1.0  # exact in binary: the expected times are exact too


class FixedBackend:
    """Every pass with a prefill chunk takes 1 s, a decode-only pass 0.25 s; no step overhead."""

    mode = "fake"

    def __init__(self, stop_at=None):
        self.stop_at = stop_at or {}  # request id -> output count after which it hits EOS
        self.calls = []

    def make_clock(self):
        return SimClock()

    def start(self, state, requests):
        self.known = None if requests is None else [r.id for r in requests]

    def step_overhead(self, predicted_s):
        return 0.0

    def execute(self, p, shape, state):
        self.calls.append(p)
        for rid in p.decode:
            r = state.by_id[rid]
            if self.stop_at.get(rid) == r.generated + 1:
                state.stop(rid)
        return PREFILL_S if p.prefill else DECODE_S

    def release(self, r):
        pass

    def finish(self):
        return {"fake": True}


def cost():
    return LinearCostModel({"d_pass": 0.001, "p_pass": 0.002, "s_step": 0.0005})


def test_fixed_seconds_give_every_timestamp():
    reqs = [Request("A", 0.0, 10, 3), Request("B", 0.5, 5, 2), Request("C", 10.0, 4, 1)]
    backend = FixedBackend()
    res = run_replica(reqs, make_policy("unified"), cost(), kv_capacity=1000, backend=backend)
    assert res.error is None and res.mode == "fake" and res.meta == {"fake": True}
    assert backend.known == ["A", "B", "C"]
    by = {r.id: r for r in res.requests}
    # step 0 [0, 1]: prefill A -> A's first token. B arrives at 0.5, during it.
    # step 1 [1, 2]: decode A + prefill B (one unified pass) -> A's 2nd, B's 1st.
    # step 2 [2, 2.25]: decode A, B -> both finish. Idle until C arrives at 10.
    # step 3 [10, 11]: prefill C -> its only token.
    assert by["A"].token_times == [1.0, 2.0, 2.25]
    assert by["B"].token_times == [2.0, 2.25]
    assert by["C"].token_times == [11.0]
    assert [(r.admitted_s, r.first_token_s, r.finish_s) for r in res.requests] == [
        (0.0, 1.0, 2.25),
        (1.0, 2.0, 2.25),
        (10.0, 11.0, 11.0),
    ]
    assert [(s.index, s.start_s, s.end_s, s.measured_s) for s in res.steps] == [
        (0, 0.0, 1.0, 1.0),
        (1, 1.0, 2.0, 1.0),
        (2, 2.0, 2.25, 0.25),
        (3, 10.0, 11.0, 1.0),
    ]
    # the cost model's prediction is logged beside every measured step
    cm = cost()
    assert [round(s.predicted_s, 9) for s in res.steps] == [
        round(0.0005 + 0.002, 9),
        round(0.0005 + 0.001 + 0.002, 9),
        round(0.0005 + 0.001, 9),
        round(0.0005 + 0.002, 9),
    ]
    assert cm.step_overhead_seconds(1, 1) == 0.0005
    assert [(st, k, t0, t1) for st, k, t0, t1, _ in res.passes] == [
        (0, 0, 0.0, 1.0),
        (1, 0, 1.0, 2.0),
        (2, 0, 2.0, 2.25),
        (3, 0, 10.0, 11.0),
    ]


def test_the_sim_backend_is_the_same_loop_with_predicted_seconds():
    reqs = [Request("A", 0.0, 10, 3), Request("B", 0.5, 5, 2)]
    res = run_replica(reqs, make_policy("unified"), cost(), kv_capacity=1000)
    assert res.mode == "sim" and all(s.measured_s is None for s in res.steps)
    # overhead, then the pass: 0.0005 + 0.002 for a prefill-only step
    assert res.requests[0].token_times[0] == 0.0005 + 0.002
    for s in res.steps:  # back to back, each as long as predicted
        assert abs((s.end_s - s.start_s) - s.predicted_s) < 1e-12


class OneAtATime:
    """A closed-loop client with concurrency 1: the next request is sent when one finishes."""

    requests = None  # nothing is known up front

    def __init__(self, reqs):
        self.reqs = list(reqs)
        self.sent = 0
        self.finish_t = None
        self.done = None

    def process(self, env, deliver):
        for r in self.reqs:
            if self.finish_t is not None and self.finish_t > env.now:
                yield env.timeout(self.finish_t - env.now)
            self.finish_t = None
            self.done = env.event()
            self.sent += 1
            deliver(replace(r, arrival_s=env.now))
            yield self.done

    def next_arrival_s(self):
        return self.finish_t if self.sent < len(self.reqs) else None

    def finished(self, r, t):
        self.finish_t = t
        self.done.succeed()


def test_an_arrival_source_feeds_the_same_loop():
    reqs = [Request("A", 0.0, 10, 3), Request("B", 0.0, 5, 2)]
    backend = FixedBackend()
    res = run_replica(OneAtATime(reqs), make_policy("unified"), cost(), kv_capacity=1000, backend=backend)
    assert backend.known is None and res.error is None
    by = {r.id: r for r in res.requests}
    assert by["A"].token_times == [1.0, 1.25, 1.5]
    assert by["B"].arrival_s == 1.5 and by["B"].token_times == [2.5, 2.75]


def test_a_backend_can_end_a_request_at_eos_and_the_kv_is_returned():
    reqs = [Request("A", 0.0, 10, 5), Request("B", 0.0, 6, 4)]
    seen = []
    res = run_replica(
        reqs,
        make_policy("unified"),
        cost(),
        kv_capacity=1000,
        backend=FixedBackend({"A": 2}),
        on_step=lambda st: seen.append((st.kv_used, st.kv_reserved)),
    )
    by = {r.id: r for r in res.requests}
    assert by["A"].output_tokens == 2 and len(by["A"].token_times) == 2
    assert by["B"].output_tokens == 4 and len(by["B"].token_times) == 4
    assert seen[-1] == (0, 0) and all(used <= reserved for used, reserved in seen)


def test_requests_too_big_are_refused_on_arrival_and_the_rest_run():
    reqs = [Request("ok", 0.0, 10, 3), Request("huge", 0.1, 900, 200), Request("ok2", 0.2, 5, 2)]
    res = run_replica(reqs, make_policy("unified"), cost(), kv_capacity=100, backend=FixedBackend())
    assert [r.id for r, _ in res.rejected] == ["huge"] and res.kv_capacity == 100
    assert "capacity is 100" in res.rejected[0][1]
    assert {r.id for r in res.requests if r.finish_s is not None} == {"ok", "ok2"}


def test_repeated_decode_steps_in_bulk_equal_planning_every_step():
    """Plan.repeat lets the loop run a policy's repeated decode steps in bulk; the bundled
    profile's model and a real trace give the very same times as asking the policy every
    step (an on_step callback turns the bulk path off)."""
    from schedlab import traces
    from schedlab.policies import POLICIES
    from schedlab.sim.profiles import resolve_profile

    cm = LinearCostModel.from_profile(resolve_profile(None))
    tr = traces.load("mooncake_conv_10min").requests[:150]
    for name in POLICIES:
        pol = make_policy(name)
        calls = []
        counted = type("Counted", (), {"name": name, "plan": lambda self, v: calls.append(1) or pol.plan(v)})()
        bulk = run_replica(tr, counted, cm, kv_capacity=200_000)
        # most steps ran without asking (vllm under this KV pressure: its repeats end where the
        # free blocks would run out, so it is asked more often)
        assert len(calls) < len(bulk.steps) / (1.2 if name == "vllm" else 2), name
        steps_seen = []
        one_by_one = run_replica(
            tr, make_policy(name), cm, kv_capacity=200_000, on_step=lambda st: steps_seen.append(1)
        )
        assert [r.token_times for r in bulk.requests] == [r.token_times for r in one_by_one.requests], name
        assert list(bulk.steps) == list(one_by_one.steps), name
        assert list(bulk.passes) == list(one_by_one.passes), name
        assert len(steps_seen) == len(one_by_one.steps)


def test_decode_run_seconds_is_pass_seconds_of_each_following_step():
    from schedlab.policies.base import CostModel, PassShape
    from schedlab.sim.profiles import resolve_profile

    from schedlab.sim.cost import KV_KNEE

    bundled = LinearCostModel.from_profile(resolve_profile(None))
    # the decode shape terms planted too: a run crossing KV_KNEE, batches below and above FEW_ROWS
    shaped = LinearCostModel({**bundled.coefficients, "d_few": 4e-4, "d_kv_long": 6e-7})
    for cm in (bundled, shaped):
        for ctx in [(5,), (100, 37, 2048), (1, 1), (KV_KNEE - 10, 3, 7), (KV_KNEE,) * 6]:
            shape = PassShape(ctx, (), False, len(ctx), 0, 0)
            want = [cm.pass_seconds(PassShape(tuple(c + j for c in ctx), (), False, len(ctx))) for j in range(1, 40)]
            assert list(cm.decode_run_seconds(shape, 39)) == want
            # the base class's default (pass by pass) gives the same seconds
            assert list(CostModel.decode_run_seconds(cm, shape, 39)) == want


def test_the_serving_models_decode_run_is_pass_seconds_of_each_following_step():
    """The analytic GPU model's run formula (the capacity search's hot path) gives float for float
    what asking pass_seconds pass by pass gives, at batch sizes across its efficiency knots, on a
    dense and a mixture-of-experts model."""
    from schedlab.analysis.analytic import ServingCostModel, make_analytic_cost_model
    from schedlab.policies.base import CostModel, PassShape

    for hw, model in (("h100-sxm", "llama-3.1-8b"), ("a100-80gb-sxm", "qwen3-30b-a3b")):
        cm = make_analytic_cost_model(hw, model, None)[0]
        assert isinstance(cm, ServingCostModel) and cm.has_run_formula
        for ctx in [(5,), (100, 37, 2048), (1, 1), tuple(range(1, 4000, 37)), (8191,) * 300]:
            shape = PassShape(ctx, (), False, len(ctx), 0, 0)
            want = list(CostModel.decode_run_seconds(cm, shape, 57))
            assert want == [
                cm.pass_seconds(PassShape(tuple(c + j for c in ctx), (), False, len(ctx))) for j in range(1, 58)
            ]
            assert list(cm.decode_run_seconds(shape, 57)) == want


def test_a_real_backends_warm_up_is_not_part_of_the_run(monkeypatch):
    """A wall-clock run starts its clock after the backend's start() (the engine's warm-up):
    a request arriving at 0 is served at once, not after the warm-up's seconds. The wall is a
    fake one that moves only when the backend works (and SimPy's real-time sleep), so the
    figures are exact on any machine, however loaded."""
    from types import SimpleNamespace

    import simpy.rt

    from schedlab.sim import WallClock
    from schedlab.sim import clock as clock_module

    wall = [1000.0]

    def sleep(seconds):
        wall[0] += max(seconds, 0.0)

    monkeypatch.setattr(clock_module, "time", SimpleNamespace(monotonic=lambda: wall[0]))
    monkeypatch.setattr(simpy.rt, "monotonic", lambda: wall[0])
    monkeypatch.setattr(simpy.rt, "sleep", sleep)

    class WarmBackend(FixedBackend):
        mode = "real"

        def make_clock(self):
            return WallClock()

        def start(self, state, requests):
            sleep(0.5)  # a warm-up

        def execute(self, p, shape, state):
            sleep(PREFILL_S if p.prefill else DECODE_S)
            return PREFILL_S if p.prefill else DECODE_S

    res = run_replica([Request("A", 0.0, 4, 2)], make_policy("unified"), cost(), kv_capacity=100, backend=WarmBackend())
    assert [(s.start_s, s.end_s) for s in res.steps] == [(0.0, PREFILL_S), (PREFILL_S, PREFILL_S + DECODE_S)]
    assert res.requests[0].first_token_s == PREFILL_S


def test_a_cost_model_without_a_run_formula_is_asked_once_per_pass_in_bulk_runs():
    """Bulk repeats may evaluate a cost model's own decode_run_seconds ahead (a pure formula);
    any other cost model (a CostModel with the default, or any object with the two methods) is
    asked exactly once per pass run, as when planning every step."""
    from schedlab.policies import CostModel
    from simkit import cost_model

    class Recording:
        def __init__(self, inner):
            self.inner, self.shapes = inner, []

        def pass_seconds(self, shape):
            self.shapes.append(shape)
            return self.inner.pass_seconds(shape)

        def step_overhead_seconds(self, n_passes, n_rows):
            return self.inner.step_overhead_seconds(n_passes, n_rows)

    class RecordingModel(Recording, CostModel):
        pass

    tr = traces.load("mixed.json").requests
    for name in ("mlx-default", "static", "vllm"):
        plain = run_replica(tr, make_policy(name), cost_model(), kv_capacity=200_000)
        for kind in (Recording, RecordingModel):
            rec = kind(cost_model())
            res = run_replica(tr, make_policy(name), rec, kv_capacity=200_000)
            assert len(rec.shapes) == len(res.passes), (name, kind)
            assert [r.token_times for r in res.requests] == [r.token_times for r in plain.requests], (name, kind)


def test_the_loop_charges_the_terms_a_cost_model_declares_and_a_plain_object_has_none():
    """The loop calls a CostModel's idle_seconds on every wake and its after_wake_seconds on the
    steps after one when it has_after_wake; an object with only pass_seconds and
    step_overhead_seconds runs as a model without such terms (and a policy still reads its own
    attributes through the view)."""
    from schedlab.policies import CostModel, as_cost_model

    reqs = [Request("A", 0.0, 10, 3), Request("B", 10.0, 4, 3)]
    base = cost()

    class Plain:
        meta = {"kv_tokens": 7}

        def pass_seconds(self, shape):
            return base.pass_seconds(shape)

        def step_overhead_seconds(self, n_passes, n_rows):
            return base.step_overhead_seconds(n_passes, n_rows)

    class Terms(Plain, CostModel):
        def __init__(self, after: bool):
            self.has_after_wake = after

        def idle_seconds(self, idle_s):
            return 0.25, 0.5

        def after_wake_seconds(self, k):
            return 0.125 if k == 1 else 0.0

    seen = []

    class Reading:
        name = "reading"

        def __init__(self):
            self.inner = make_policy("unified")

        def plan(self, view):
            seen.append(view.cost_model.meta["kv_tokens"])
            return self.inner.plan(view)

    plain = run_replica(reqs, Reading(), Plain(), kv_capacity=1000)
    assert seen and set(seen) == {7}
    same = run_replica(reqs, make_policy("unified"), base, kv_capacity=1000)
    assert [(s.start_s, s.end_s) for s in plain.steps] == [(s.start_s, s.end_s) for s in same.steps]
    with_after, without = (run_replica(reqs, make_policy("unified"), Terms(a), kv_capacity=1000) for a in (True, False))
    woke = [i for i, s in enumerate(plain.steps) if s.index in plain.wakes and s.start_s > 0]
    assert len(woke) == 1
    w = woke[0]
    for res, after in ((with_after, 0.125), (without, 0.0)):
        took = [s.end_s - s.start_s for s in res.steps]
        plain_took = [s.end_s - s.start_s for s in plain.steps]
        assert res.steps[w].start_s == 10.25  # the wake's own seconds come before its step
        assert took[w] == pytest.approx(plain_took[w] + 0.5)  # and its step pays the extra
        assert took[w + 1] == pytest.approx(plain_took[w + 1] + after)
        assert took[w + 2 :] == pytest.approx(plain_took[w + 2 :]) and took[:w] == plain_took[:w]
    with pytest.raises(TypeError, match="pass_seconds"):
        as_cost_model(object())


def test_a_profile_with_an_old_step_jitter_entry_simulates_as_without_it(tmp_path):
    """Calibrations once stored the steps' spread (``step_jitter``) in the profile; the
    simulator never used it, and such a profile still loads: its entry is ignored."""
    import json

    from schedlab.sim.profiles import resolve_profile

    data = json.loads(resolve_profile(None).read_text())
    assert "step_jitter" not in data
    plain, old = tmp_path / "plain.json", tmp_path / "old.json"
    plain.write_text(json.dumps(data))
    old.write_text(json.dumps({**data, "step_jitter": {"quantiles": [0.5, 1.0, 1.5], "steps": 300}}))
    a, b = LinearCostModel.from_profile(plain), LinearCostModel.from_profile(old)
    assert a.coefficients == b.coefficients
    tr = traces.load("real-smoke").requests
    ra, rb = (run_replica(tr, make_policy("unified"), m, kv_capacity=a.meta["kv_tokens"]) for m in (a, b))
    assert list(ra.steps) == list(rb.steps) and len(ra.steps) > 10
    assert [r.token_times for r in ra.requests] == [r.token_times for r in rb.requests]
    assert ra.meta == rb.meta == {}  # nothing of it reaches the run's metadata
