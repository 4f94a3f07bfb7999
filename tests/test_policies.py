"""Policies on exact scheduler states: what each plans, step by step."""

from __future__ import annotations

import random

import pytest

from schedlab.policies import POLICIES, OptionError, PolicyNotFound, make_policy
from schedlab.policies.base import Pass, Plan
from schedlab.sim import run_replica
from simkit import Bench, cost_model, req


def decode_ids(plan: Plan) -> list[str]:
    return [rid for p in plan.passes for rid in p.decode]


def prefill_chunks(plan: Plan) -> list[tuple[str, int]]:
    return [c for p in plan.passes for c in p.prefill]


# ------------------------------------------------------------------ mlx-default / prefer-prefill


def test_one_decoding_one_queued_prefer_prefill_skips_decode_mlx_default_does_not():
    b = Bench([req("a", 50, 20), req("b", 300, 10)])
    b.decoding("a")
    mlx = b.plan(make_policy("mlx-default"))
    pp = b.plan(make_policy("prefer-prefill"))
    # mlx-default: decode a, admit b, one padded prefill pass that stops one token short
    assert decode_ids(mlx) == ["a"]
    assert mlx.admit == ("b",)
    assert prefill_chunks(mlx) == [("b", 299)]
    assert mlx.passes[-1].padded
    # prefer-prefill: the same admission and prefill, no decode this step
    assert decode_ids(pp) == []
    assert pp.admit == ("b",)
    assert prefill_chunks(pp) == [("b", 299)]


def test_mlx_default_hands_off_last_prompt_token_to_decode():
    b = Bench([req("a", 50, 20), req("b", 300, 10)])
    b.decoding("a")
    b.apply(b.plan(make_policy("mlx-default")))  # b prefilled to 299 of 300
    assert b.state.by_id["b"].remaining_prompt == 1
    plan = b.plan(make_policy("mlx-default"))
    assert decode_ids(plan) == ["a", "b"]  # b's last prompt token is its first decode input
    assert prefill_chunks(plan) == []
    b.apply(plan)
    rb = b.state.by_id["b"]
    assert rb.phase.value == "decoding" and rb.generated == 1 and rb.first_token_s == b.t


def _admitted(time_budget: float, name: str = "mlx-default"):
    """A real SimPy run: ``a`` decodes a long answer from 0 s, ``b`` and ``c`` arrive at 0.05 and
    0.3 s while it runs, ``d`` once everything has finished. (admission times, step starts)"""
    reqs = [req("a", 64, 200), req("b", 32, 4, arrival=0.05), req("c", 32, 4, arrival=0.3), req("d", 32, 4, 60.0)]
    res = run_replica(reqs, make_policy(name, {"time_budget": time_budget}), cost_model(), kv_capacity=10_000)
    assert res.error is None and all(r.finish_s is not None for r in res.requests)
    return {r.id: r.admitted_s for r in res.requests}, [s.start_s for s in res.steps]


@pytest.mark.parametrize("name", ["mlx-default", "prefer-prefill"])
def test_a_time_budget_admits_arrivals_when_a_window_opens_as_mlx_lm_server_does(name):
    budget = 0.5
    at, starts = _admitted(budget, name)
    first_at = lambda t: min(s for s in starts if s >= t)  # noqa: E731
    # the first request opens a window at once (nothing was running); b and c arrived inside it and
    # wait for the next, which opens 0.5 s later, while a decodes; they join together
    assert at["a"] == 0.0
    assert at["b"] == at["c"] == first_at(budget), (at, starts[:12])
    # d comes to an idle replica: admitted at once, as mlx_lm.server hands it over
    assert at["d"] == 60.0
    # without a budget each is admitted at the first step after its arrival
    at0, starts0 = _admitted(0.0, name)
    assert at0["b"] == min(s for s in starts0 if s >= 0.05) < budget
    assert at0["c"] == min(s for s in starts0 if s >= 0.3) < budget


def test_a_time_budget_must_be_a_number_of_seconds():
    with pytest.raises(OptionError, match="time_budget"):
        make_policy("mlx-default", {"time_budget": -1})


def test_prefer_prefill_equals_mlx_default_without_pending_prefill():
    rng = random.Random(7)
    for trial in range(30):
        n = rng.randint(1, 40)
        b = Bench([req(i, rng.randint(1, 400), rng.randint(1, 60)) for i in range(n)])
        mlx, pp = make_policy("mlx-default"), make_policy("prefer-prefill")
        for _ in range(rng.randint(0, 12)):
            if b.state.done:
                break
            b.apply(b.plan(mlx))
        # a prefill is pending when a prompt has more than its hand-off token left, or a
        # waiting prompt can be admitted (the prompt batch and decode batch have room)
        st = b.state
        admissible = bool(st.waiting) and len(st.prefilling) < 8 and len(st.decoding) < 32
        pending = admissible or any(r.remaining_prompt > 1 for r in st.prefilling.values())
        if not pending:
            assert b.plan(pp) == b.plan(mlx)
        else:
            assert decode_ids(b.plan(pp)) == [] or len(b.state.decoding) >= pp.completion_batch_size


def test_prefer_prefill_decodes_when_batch_is_saturated():
    reqs = [req(i, 10, 50) for i in range(5)] + [req("late", 100, 5)]
    b = Bench(reqs)
    for i in range(5):
        b.decoding(i)
    pol = make_policy("prefer-prefill", {"completion_batch_size": "5", "prefill_batch_size": "2"})
    plan = b.plan(pol)
    assert decode_ids(plan) == ["0", "1", "2", "3", "4"]
    assert plan.admit == ()  # batch full: no admission, as in mlx-lm


def test_mlx_default_admission_limits():
    reqs = [req(i, 100, 10) for i in range(12)]
    b = Bench(reqs)
    plan = b.plan(make_policy("mlx-default"))
    assert len(plan.admit) == 8  # prefill_batch_size
    b.apply(plan)
    plan2 = b.plan(make_policy("mlx-default"))
    assert plan2.admit == ()  # prompt batch (incl. hand-offs) is full
    assert decode_ids(plan2) == [str(i) for i in range(8)]


def test_mlx_default_long_prompt_advances_by_step_size():
    b = Bench([req("x", 5000, 4)])
    pol = make_policy("mlx-default")
    steps = []
    while b.state.by_id["x"].phase.value != "finished":
        plan = b.plan(pol)
        steps.append(prefill_chunks(plan))
        b.apply(plan)
    assert steps[:3] == [[("x", 2048)], [("x", 2048)], [("x", 903)]]
    assert b.state.by_id["x"].generated == 4


# ------------------------------------------------------------------ static / slots


def test_static_admits_nothing_while_batch_runs():
    b = Bench([req(i, 20 + i, 3 + i) for i in range(5)])
    pol = make_policy("static", {"batch_size": "3"})
    first = b.plan(pol)
    assert first.admit == ("0", "1", "2")
    assert first.passes[0].padded and prefill_chunks(first) == [("0", 20), ("1", 21), ("2", 22)]
    b.apply(first)
    admitted_while_running = []
    while b.state.decoding:
        plan = b.plan(pol)
        admitted_while_running += list(plan.admit)
        b.apply(plan)
    assert admitted_while_running == []
    assert b.plan(pol).admit == ("3", "4")


def test_slots_refill_a_freed_slot_at_once():
    b = Bench([req("a", 10, 2), req("b", 10, 9), req("c", 30, 4)])
    pol = make_policy("slots", {"n_slots": "2"})
    b.apply(b.plan(pol))  # a, b prefilled whole: first tokens out
    plan = b.plan(pol)
    assert plan.admit == ()  # both slots busy
    done = b.apply(plan)  # a's second (last) token
    assert [r.id for r in done] == ["a"]
    plan = b.plan(pol)
    assert plan.admit == ("c",)
    assert prefill_chunks(plan) == [("c", 30)]  # prefilled whole
    assert decode_ids(plan) == ["b"]


# ------------------------------------------------------------------ chunked prefill


def test_chunked_prefill_budget_partial_chunk_and_short_prompts_behind():
    b = Bench([req("long", 3000, 5), req("s1", 100, 5), req("s2", 200, 5)])
    pol = make_policy("chunked-prefill", {"budget": "1024"})
    plan = b.plan(pol)
    chunks = prefill_chunks(plan)
    assert sum(n for _, n in chunks) <= 1024
    assert chunks[0][0] == "long" and chunks[0][1] < 3000  # partial chunk, front of queue
    assert ("s1", 100) in chunks and ("s2", 200) in chunks  # short prompts served too
    b.apply(plan)
    nxt = prefill_chunks(b.plan(pol))
    assert nxt[0][0] == "long"  # the partial request stays at the front
    assert sum(n for _, n in nxt) <= 1024


def test_chunked_prefill_strict_fifo_when_threshold_is_budget():
    b = Bench([req("long", 3000, 5), req("s1", 100, 5)])
    pol = make_policy("chunked-prefill", {"budget": "1024", "long_prefill_threshold": "1024"})
    assert prefill_chunks(b.plan(pol)) == [("long", 1024)]


def test_chunked_prefill_decodes_after_prefill_and_respects_max_batch():
    b = Bench([req(i, 40, 10) for i in range(6)])
    b.decoding(0)
    pol = make_policy("chunked-prefill", {"max_batch": "3"})
    plan = b.plan(pol)
    assert len(plan.admit) == 2  # 1 active + 2 admitted = max_batch
    assert [bool(p.prefill) for p in plan.passes] == [True, False]
    assert decode_ids(plan) == ["0"]


# ------------------------------------------------------------------ unified


def test_unified_one_pass_decode_rows_first_within_budget():
    b = Bench([req("d1", 10, 50), req("d2", 10, 50), req("p", 5000, 3), req("q", 100, 3)])
    b.decoding("d1")
    b.decoding("d2")
    pol = make_policy("unified", {"token_budget": "512"})
    plan = b.plan(pol)
    assert len(plan.passes) == 1
    p = plan.passes[0]
    assert p.decode == ("d1", "d2")
    assert p.prefill == (("p", 510),)  # budget minus the two decode tokens
    assert plan.admit == ("p",)  # q is not admitted: the budget is spent
    # separate: the same schedule as two forwards, the chunks and then the decode rows
    sep = b.plan(make_policy("unified", {"token_budget": "512", "separate": "true"}))
    assert sep.admit == plan.admit
    assert [(q.decode, q.prefill) for q in sep.passes] == [((), (("p", 510),)), (("d1", "d2"), ())]


# ------------------------------------------------------------------ registry and options


def test_every_policy_is_registered_and_has_options():
    assert set(POLICIES) == {"mlx-default", "prefer-prefill", "static", "slots", "chunked-prefill", "unified", "vllm"}
    for name, cls in POLICIES.items():
        pol = make_policy(name)
        assert pol.name == name
        assert set(pol.options()) == set(cls.option_names())


@pytest.mark.parametrize(
    "name,opts,msg",
    [
        ("static", {"nope": "1"}, "has no option 'nope'"),
        ("static", {"batch_size": "x"}, "not a valid int"),
        ("static", {"batch_size": "0"}, "must be >= 1"),
        ("static", {"padded": "maybe"}, "not a valid bool"),
        ("chunked-prefill", {"long_prefill_threshold": "-1"}, "long_prefill_threshold"),
    ],
)
def test_bad_options(name, opts, msg):
    with pytest.raises(OptionError, match=msg):
        make_policy(name, opts)


def test_policies_and_routers_are_loaded_and_read_their_options_by_one_rule(tmp_path):
    """One loader (``policies.plugins``) and one rule for options, whichever kind of plugin."""
    from dataclasses import dataclass

    from schedlab.policies import PolicyBase
    from schedlab.routers import RouterBase, RouterNotFound, RouterOptionError, make_router
    from schedlab.routers.weighted import Weighted

    # names: '-' read as '_', for policies too (routers always did)
    assert make_policy("unified", {"token-budget": "512"}).token_budget == 512
    assert make_router("weighted", {"kv-weight": "2"}).kv_weight == 2.0
    # strings parsed as the option's type; Python values must have it (an int for a float: a float)
    assert make_policy("static", {"padded": "off"}).padded is False
    for bad in (2.5, True, "2.5", None):
        with pytest.raises(OptionError, match="batch_size=.* is not a valid int"):
            make_policy("static", {"batch_size": bad})
        with pytest.raises(RouterOptionError, match="seed=.* is not a valid int"):
            make_router("random", {"seed": bad})
    weighted = make_router("weighted", {"kv_weight": 2})
    assert weighted.kv_weight == 2.0 and isinstance(weighted.kv_weight, float)
    with pytest.raises(RouterOptionError, match="kv_weight=inf is not a valid float"):
        make_router("weighted", {"kv_weight": float("inf")})

    # an option with no usable default takes its annotation's type (None allowed when it says so)
    @dataclass
    class Capped(PolicyBase):
        name = "capped"
        cap: int | None = None
        rate: float | None = None

        def plan(self, view):
            return Plan()

    assert Capped.from_options({"cap": "3", "rate": "0.5"}) == Capped(3, 0.5)
    assert Capped.from_options({"cap": None}).cap is None
    with pytest.raises(OptionError, match="policy 'capped': option cap='x' is not a valid int"):
        Capped.from_options({"cap": "x"})

    @dataclass
    class Sticky(RouterBase):
        name = "sticky"
        to: int | None = None

        def route(self, view):
            return self.to or 0

    assert Sticky.from_options({"to": "1"}).to == 1
    with pytest.raises(RouterOptionError, match=r"router 'sticky' has no option 'from' \(options: to\)"):
        Sticky.from_options({"from": "1"})

    # the same forms for both kinds: a class (built with its options), an object (as it is)
    assert make_router(Weighted, {"queue_weight": "0.5"}).queue_weight == 0.5
    assert make_policy(Capped, {"cap": "2"}).cap == 2
    router = make_router("round-robin")
    assert make_router(router) is router
    with pytest.raises(RouterOptionError, match="options go with a router's name or class"):
        make_router(router, {"x": 1})
    with pytest.raises(OptionError, match="options go with a policy's name or class"):
        make_policy(make_policy("static"), {"batch_size": 2})
    for make, word, error in ((make_policy, "policy", PolicyNotFound), (make_router, "router", RouterNotFound)):
        with pytest.raises(error, match=f"^{word} is empty$"):
            make(" ")
        with pytest.raises(error, match=f"unknown {word} 'nope' \\(bundled: "):
            make("nope")
        with pytest.raises(error, match=f"^a {word} is a bundled name .* got int$"):
            make(3)
        with pytest.raises(OptionError if word == "policy" else RouterOptionError, match=f"{word} option names"):
            make("round-robin" if word == "router" else "static", {3: "x"})
    # every bad plugin or option is a usage error: exit status 2
    assert PolicyNotFound.code == OptionError.code == RouterNotFound.code == RouterOptionError.code == 2


def test_unknown_policy_and_user_policy_files(tmp_path):
    with pytest.raises(PolicyNotFound, match="unknown policy"):
        make_policy("fifo-magic")
    f = tmp_path / "mine.py"
    f.write_text(
        "from schedlab.policies.base import Plan, Pass\n"
        "class Greedy:\n"
        "    name = 'greedy'\n"
        "    def __init__(self, k=1):\n"
        "        self.k = int(k)\n"
        "    def plan(self, view):\n"
        "        return Plan()\n"
    )
    pol = make_policy(f"{f}:Greedy", {"k": "3"})
    assert pol.name == "greedy" and pol.k == 3
    with pytest.raises(PolicyNotFound, match="not a class"):
        make_policy(f"{f}:Missing")
    with pytest.raises(PolicyNotFound, match="not found"):
        make_policy(f"{tmp_path}/absent.py:X")
    # a dataclass under postponed annotations looks its module up while the file runs
    dc = tmp_path / "dc.py"
    dc.write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass\n"
        "from schedlab.policies.base import Plan\n"
        "@dataclass\n"
        "class Cap:\n"
        "    k: int = 1\n"
        "    name: str = 'cap'\n"
        "    def plan(self, view) -> Plan:\n"
        "        return Plan()\n"
    )
    assert make_policy(f"{dc}:Cap").k == 1
    bad = tmp_path / "broken.py"
    bad.write_text("def oops(:\n")
    with pytest.raises(PolicyNotFound, match="SyntaxError"):
        make_policy(f"{bad}:X")


def test_plan_repeat_is_an_integer_of_at_least_zero(tmp_path):
    import numpy as np

    import schedlab

    for bad in (-5, 2.5, "3", True, np.int64(-1)):
        with pytest.raises(ValueError) as ei:
            Plan(passes=(Pass(decode=("a",)),), repeat=bad)
        assert str(ei.value) == f"Plan.repeat must be an integer >= 0, got {bad!r}"
    assert Plan().repeat == 0 and Plan(repeat=None).repeat is None  # (None: no repeats, as 0)
    got = Plan(repeat=np.int64(4)).repeat
    assert got == 4 and type(got) is int
    # a policy that plans a negative repeat stops its run with one line naming it
    f = tmp_path / "neg.py"
    f.write_text(
        "from schedlab.policies.base import Plan\n"
        "from schedlab.policies.vllm import Vllm\n"
        "class Neg(Vllm):\n"
        "    name = 'neg'\n"
        "    def plan(self, view):\n"
        "        p = super().plan(view)\n"
        "        return Plan(p.admit, p.preempt, p.passes, repeat=-1)\n"
    )
    run = schedlab.simulate(f"{f}:Neg", "real-smoke")
    assert "policy 'neg' step 0 raised ValueError: Plan.repeat must be an integer >= 0, got -1" in run.error


def test_policy_options_must_be_a_mapping():
    with pytest.raises(OptionError, match=r"^policy options are a mapping of names to values, got list \[1, 2\]$"):
        make_policy("vllm", [1, 2])
    with pytest.raises(OptionError, match="got str 'budget=8'"):
        make_policy("chunked-prefill", "budget=8")
    assert make_policy("vllm", {}).name == make_policy("vllm", None).name == "vllm"


def test_plans_do_not_mutate_the_state():
    """A policy reads a view; planning twice gives the same plan and leaves state untouched."""
    b = Bench([req(i, 100 + 37 * i, 5 + i) for i in range(10)])
    b.decoding(0)
    b.prefilling(1, 40)
    for name in POLICIES:
        pol = make_policy(name)
        before = [(r.id, r.phase, r.prefilled, r.generated) for r in b.state.requests]
        kv = (b.state.kv_used, b.state.kv_reserved)
        assert b.plan(pol) == b.plan(pol)
        assert before == [(r.id, r.phase, r.prefilled, r.generated) for r in b.state.requests]
        assert kv == (b.state.kv_used, b.state.kv_reserved)


def test_view_is_read_only():
    b = Bench([req("a", 10, 5)])
    r = b.view.waiting[0]
    for attr in ("phase", "prefilled", "generated", "remaining_prompt", "kv_tokens"):
        with pytest.raises(AttributeError):
            setattr(r, attr, 3)
    assert isinstance(Pass(decode=["a"]).decode, tuple)  # lists from policies become tuples
