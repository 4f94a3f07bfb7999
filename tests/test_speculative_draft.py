"""Speculative decoding with a draft model (``--speculative draft:model=M,k=3``): the real MLX
engine's draft proposals, greedy tokens exactly those of decoding one at a time, the draft's
caches rolled back with the target's; the simulator's price of the draft's passes.

Real parts: the SimPy loop in real-time mode with ``MLXBackend``, real MLX on CPU, the ``micro``
preset as target and as draft (itself: every draft accepted; another seed's weights of the same
shape: few accepted), every bundled policy; references are each prompt alone through mlx-lm's
plain KVCache (``reference_tokens``). The simulations use the bundled policies and measured
profiles.
"""

from __future__ import annotations


import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402

import schedlab  # noqa: E402
from schedlab.api.deployments import parse_speculative, speculative_policy, speculative_text  # noqa: E402
from schedlab.engine.backend import DRAFT_LAG, MLXBackend, reference_tokens  # noqa: E402
from schedlab.engine.errors import EngineError  # noqa: E402
from schedlab.engine.models import load_model, make_caches  # noqa: E402
from schedlab.engine.sampling import parse_sampling, prompt_ids  # noqa: E402
from schedlab.policies import POLICIES, make_policy  # noqa: E402
from schedlab.policies.base import PassShape, draft_seconds  # noqa: E402
from schedlab.policies.speculative import Speculative  # noqa: E402
from schedlab.sim import run_replica  # noqa: E402
from schedlab.sim.cost import LinearCostModel, ScaledCostModel  # noqa: E402
from schedlab.sim.sources import TraceSource  # noqa: E402
from schedlab.sim.speculation import Acceptance, SpeculationError  # noqa: E402
from schedlab.traces.schema import Request  # noqa: E402
from test_speculative import test_bad_speculative_settings_are_one_line as one_line  # noqa: E402
from test_speculative_real import TRACE, CacheWatch  # noqa: E402

NO_COST = LinearCostModel({})


@pytest.fixture(scope="module")
def micro():
    return load_model("micro")


@pytest.fixture(scope="module")
def other():
    return load_model("micro", seed=1)  # the same shape, other weights: its drafts are mostly rejected


@pytest.fixture(scope="module")
def references(micro):
    return {
        r.id: reference_tokens(micro, prompt_ids(0, r.id, r.prompt_tokens, micro.vocab_size), r.output_tokens)
        for r in TRACE
    }


class DraftWatch(CacheWatch):
    """After every step, as ``CacheWatch`` for the target: each draft cache holds the tokens of
    the target's KV (its mlx-lm offset), all but the last accepted draft after a verify that
    accepted every one (``lag``: or as many fewer, the tokens made in passes that drafted none);
    only requests decoding now hold one. ``content``: a draft batch row's keys are also those of
    the draft model run afresh over those tokens (a rejected draft's KV kept, or a kept token's
    rolled back, shows here)."""

    def __init__(self, backend, content=False, lag=1):
        super().__init__(backend)
        self.content, self.lag, self.draft_rows, self.behind, self.held = content, lag, 0, 0, set()

    def __call__(self, state):
        super().__call__(state)
        b = self.backend
        held = set(b._drows) | set(b._dcache)
        assert held == set(b._dkv) and held <= set(state.decoding), (held, set(state.decoding))
        self.held |= held
        offsets = b._dbatch[0].offset.tolist() if b._dbatch else []
        assert len(offsets) == len(b._drows)
        for rid, have in zip(b._drows, offsets):
            kv = state.by_id[rid].kv_tokens
            assert have == b._dkv[rid] and kv - self.lag <= have <= kv, (rid, have, b._dkv[rid], kv)
            self.draft_rows += 1
            self.behind = max(self.behind, kv - have)
        for rid, caches in b._dcache.items():
            assert all(c.offset == b._dkv[rid] <= state.by_id[rid].kv_tokens for c in caches)
        if self.content:
            for i, rid in enumerate(b._drows):
                n = b._dkv[rid]
                mine = b._dbatch[0].extract(i).keys[..., :n, :]
                fresh = make_caches(b.draft.model, b.draft.n_layers)
                b.draft.hidden(mx.array([b._seq[rid][:n]], dtype=mx.uint32), fresh)
                assert mx.allclose(mine, fresh[0].keys[..., :n, :], atol=1e-4).item(), rid


def drafting(policy, draft, k=3):
    return Speculative(make_policy(*policy) if isinstance(policy, tuple) else make_policy(policy), k, "draft",
                       draft_model=draft)  # fmt: skip


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_tokens_with_a_draft_model_equal_the_references_under_every_policy(micro, other, references, policy):
    for draft in (micro, other):
        backend = MLXBackend(micro, warmup=False)  # (run_real's warms the draft up)
        watch = DraftWatch(backend, content=policy == "unified")
        res = run_replica(TRACE, drafting(policy, draft), NO_COST, kv_capacity=4096, backend=backend, on_step=watch)
        assert res.error is None, res.error
        for r in TRACE:
            assert backend.tokens[r.id] == references[r.id], (policy, draft.seed, r.id)
        spec, stats = res.speculative, backend.stats
        assert spec["accepted_tokens"] == stats["accepted_tokens"] and spec["draft_tokens"] == stats["draft_tokens"]
        assert watch.draft_rows > 0 and stats["draft_forwards"] > 0
        if draft is micro:  # greedy drafts of the target itself: every one accepted
            assert spec["acceptance_rate"] == 1.0 and watch.behind > 0
        else:
            assert 0 < spec["accepted_tokens"] < spec["draft_tokens"]
        # every request finished: no draft cache left
        assert not (backend._drows or backend._dcache or backend._dkv) and backend._dbatch is None


class Cancelling(TraceSource):
    """A trace whose client of request ``a`` goes away once ``a`` holds a draft cache."""

    replica_cancel = None  # (set by run_replica: the loop's cancel)


def test_preemption_and_cancellation_leave_no_draft_cache(micro, other, references):
    # a KV too small for everyone at once: vllm preempts and recomputes, rows draft and verify
    backend = MLXBackend(micro, warmup=False)
    watch = DraftWatch(backend)
    pol = Speculative(make_policy("vllm", {"max_num_batched_tokens": 64}), 4, "draft", draft_model=other)
    res = run_replica(TRACE, pol, NO_COST, kv_capacity=160, block_size=16, backend=backend, on_step=watch)
    assert res.error is None, res.error
    preempted = {r.id for r in res.requests if r.preemptions}
    assert preempted & watch.held and res.speculative["draft_tokens"] > 0  # (the watch: none kept its draft cache)
    for r in TRACE:
        assert backend.tokens[r.id] == references[r.id], r.id
    # a client goes away while its request drafts: its draft cache goes at the next step
    backend = MLXBackend(micro, warmup=False)
    src = Cancelling(TRACE[:2])
    watch = DraftWatch(backend)

    def step(state):
        watch(state)
        if "a" in backend._drows and src.replica_cancel is not None:
            src.replica_cancel("a")
            src.replica_cancel = None

    res = run_replica(src, drafting("unified", micro), NO_COST, kv_capacity=4096, backend=backend, on_step=step)
    a = next(r for r in res.requests if r.id == "a")
    assert res.error is None and src.replica_cancel is None and a.output_tokens < 48
    assert "a" not in backend._dkv and backend.tokens["b"] == references["b"]


class AfterSteps(TraceSource):
    """``first`` at their times, then ``late`` once the step hook opens ``gate`` (after so many
    steps, not seconds: on a wall clock the same run on any machine)."""

    def __init__(self, first, late):
        super().__init__(first)
        self.late, self.gate = late, None

    def process(self, env, deliver):
        self.gate = env.event()
        yield from super().process(env, deliver)
        yield self.gate
        deliver(self.late)


def test_rows_that_decode_without_drafts_catch_up_after(micro, references):
    # a sampled row joins the batch once the others draft: no row drafts while it runs, the
    # others' draft caches fall behind, then catch up (more than a few tokens behind: in caches of
    # their own) and draft again
    backend = MLXBackend(micro, warmup=False)
    backend.request_sampling["s"] = parse_sampling("temperature=0.8,seed=1")
    watch = DraftWatch(backend, content=True, lag=1 + 12)
    src = AfterSteps(TRACE[:2], Request("s", 0.0, 6, 12))

    def step(state):
        watch(state)
        if state.step_index >= 3 and not src.gate.triggered:
            src.gate.succeed()

    res = run_replica(src, drafting("unified", micro), NO_COST, kv_capacity=4096, backend=backend, on_step=step)
    assert res.error is None and res.speculative["acceptance_rate"] == 1.0 and watch.behind > DRAFT_LAG
    assert [backend.tokens[r.id] for r in TRACE[:2]] == [references["a"], references["b"]]


def test_the_simulator_charges_the_draft_passes_and_the_adaptive_k_weighs_them():
    tiny = LinearCostModel.from_profile(schedlab.load_profile("tiny-cpu").path)
    shape = PassShape((10, 20, 30), decode_drafts=(3, 1, 0))
    # three draft steps over the two drafting rows (the one of a single draft runs them all)
    passes = [tiny.pass_seconds(PassShape((10 + j, 20 + j))) for j in range(3)]
    assert draft_seconds(tiny, shape) == pytest.approx(sum(passes))
    prefill = tiny.pass_seconds(PassShape((), ((19, 0),)))  # a row's first drafts: its context prefilled first
    assert draft_seconds(tiny, shape, (False, True, True)) == pytest.approx(sum(passes) + prefill)
    assert draft_seconds(None, shape) == 0.0 == draft_seconds(tiny, PassShape((10,)))
    reqs = [Request(f"r{i}", 0.0, 64, 40) for i in range(4)]
    acc = Acceptance((0.8, 0.6, 0.5), seed=1)

    def makespan(cost, method="draft", **kw):
        pol = Speculative(make_policy("unified"), 3, method, draft_model="tiny" if cost else None, draft_cost=cost,
                          **kw)  # fmt: skip
        res = run_replica(reqs, pol, tiny, kv_capacity=100_000, acceptance=acc)
        assert res.error is None and (pol.adaptive or res.speculative["drafts"] > 0)
        return max(r.finish_s for r in res.requests), pol

    fifth = ScaledCostModel(tiny, 0.2)  # a draft model 5x as fast as the target (tiny itself)
    ngram, _ = makespan(None, "ngram")
    cheap, _ = makespan(fifth)
    dear, _ = makespan(tiny)
    assert ngram < cheap < dear  # (the same draws, the same schedule: only the draft's seconds differ)
    # the adaptive k: fewer drafts the more they cost, none from a draft as slow as the target
    ks = {}
    for name, cost in (("free", None), ("cheap", fifth), ("dear", tiny)):
        _, pol = makespan(cost, "draft" if cost else "ngram", adaptive=True, accept=acc.accept)
        ks[name] = sum(pol.k_chosen) / len(pol.k_chosen)
    assert ks["free"] > ks["cheap"] > ks["dear"] == 0


def test_simulate_and_run_real_take_a_draft_model_and_its_text_round_trips(micro):
    keys = ("method", "model", "draft_profile", "k", "adaptive")
    for spec in (
        parse_speculative("draft:model=tiny,k=3,accept=0.7/0.5/0.3"),
        parse_speculative({"method": "draft", "model": "micro", "draft_profile": "tiny-cpu", "k": 2}),
    ):  # (what a replica process is given)
        again = parse_speculative(speculative_text(spec))
        assert [again[k] for k in keys] == [spec[k] for k in keys] and speculative_text(again) == speculative_text(spec)
    assert speculative_text(spec).startswith("draft:model=micro,draft_profile=tiny-cpu,k=2")
    run = schedlab.simulate("unified", TRACE, speculative="draft:model=tiny,k=3,accept=0.7/0.5/0.3")
    assert run.summary["policy"] == "unified+draft-k3" and run.summary["speculative"]["drafts"] > 0
    assert run.meta["policy_options"]["speculative"]["draft_model"] == "tiny"
    real = schedlab.run_real("unified", schedlab.load_trace("real-smoke", head=3), model="micro", profile="tiny-cpu",
                             log=lambda k, m: None, speculative="draft:model=micro,k=2")  # fmt: skip
    assert real.error is None and real.meta["engine"]["draft_model"] == "micro"
    assert real.summary["speculative"]["acceptance_rate"] == 1.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("draft:k=3,accept=0.5", "the draft method needs its model: draft:model=M"),
        ("ngram:model=tiny,accept=0.5", "model= goes with the draft method"),
        ("ngram:draft_profile=tiny-cpu,accept=0.5", "draft_profile= goes with the draft method"),
        ("draft:model=nosuch,accept=0.5", "no cost profile of draft model nosuch is bundled"),
        ("draft:model=tiny,draft_profile=nosuch.json,accept=0.5", "draft_profile: profile not found: nosuch.json"),
    ],
)
def test_bad_draft_settings_are_one_line(spec, message):
    one_line(spec, message)  # (simulate's: one line, exit status 2)


def test_an_unknown_or_mismatched_draft_model_is_one_line(micro):
    with pytest.raises(schedlab.SchedlabError, match="draft model: unknown model preset 'nosuch'") as err:
        speculative_policy(make_policy("vllm"), parse_speculative("draft:model=nosuch"))
    assert "\n" not in str(err.value)
    with pytest.raises(EngineError, match="draft model tiny .8192 tokens. does not share model micro's vocabulary"):
        MLXBackend(micro, warmup=False).use_draft("tiny")
    with pytest.raises(EngineError, match="rolled back, which those caches cannot do") as err:
        MLXBackend(load_model("micro-qwen3_5"), warmup=False).use_draft(load_model("micro-qwen3_5"))
    assert "\n" not in str(err.value)
    # a simulation that is not told what the draft's passes cost refuses
    pol = Speculative(make_policy("vllm"), 2, "draft", draft_model="micro")
    with pytest.raises(SpeculationError, match="draft model micro's drafts needs its cost model: give draft_profile"):
        run_replica(TRACE, pol, NO_COST, kv_capacity=4096, acceptance=Acceptance((0.5,)))
