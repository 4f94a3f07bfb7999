"""The real MLX engine: every policy's tokens equal single-sequence references, cache states.

Everything runs the real parts: the SimPy loop in real-time mode (``sim.loop.run_replica`` with
``MLXBackend``), real MLX on CPU, the ``micro`` preset (2 layers, hidden 64, seeded random
weights). A reference is the model alone on one prompt (mlx-lm's plain KVCache, whole
prompt, batch of one, full logits); the engine's greedy tokens must equal it exactly,
whatever the batching, chunking, padding, joining, parking or preemption.
"""

from __future__ import annotations

import dataclasses

import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab.engine.backend import MLXBackend, reference_tokens
from schedlab.engine.errors import EngineError
from schedlab.engine.models import load_model
from schedlab.engine.sampling import prompt_ids

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from schedlab.policies import make_policy
from schedlab.policies.base import Pass, Plan
from schedlab.policies.mlx_default import MlxDefault
from schedlab.sim.cost import LinearCostModel
from schedlab.sim import run_replica
from schedlab.sim.state import ReplicaState
from schedlab.traces.schema import Request

NO_COST = LinearCostModel({})


@pytest.fixture(scope="module")
def micro():
    return load_model("micro")


def trace() -> list[Request]:
    """10 requests, prompts 10..300, outputs 1..60; four arrive while the first ones decode."""
    rows = [  # id, arrival_s, prompt, output
        ("a", 0.0, 300, 60),
        ("b", 0.0, 10, 45),
        ("c", 0.0, 129, 1),
        ("d", 0.0, 64, 30),
        ("e", 0.0, 1, 12),
        ("f", 0.005, 257, 20),
        ("g", 0.02, 77, 25),
        ("h", 0.03, 200, 2),
        ("i", 0.05, 33, 40),
        ("j", 0.06, 150, 18),
    ]
    return [Request(rid, t, p, o) for rid, t, p, o in rows]


@pytest.fixture(scope="module")
def references(micro):
    return {
        r.id: reference_tokens(micro, prompt_ids(0, r.id, r.prompt_tokens, micro.vocab_size), r.output_tokens)
        for r in trace()
    }


def run_real(model, policy, requests=None, **backend_kw):
    backend = MLXBackend(model, **backend_kw)
    result = run_replica(requests or trace(), policy, NO_COST, kv_capacity=100_000, backend=backend)
    assert result.error is None, result.error
    assert result.mode == "real"
    return result, backend


def assert_reference_tokens(backend, references, requests=None):
    for r in requests or trace():
        assert len(backend.tokens[r.id]) == r.output_tokens, r.id
        assert backend.tokens[r.id] == references[r.id], f"request {r.id} differs from its reference"


@pytest.mark.parametrize("warmup", [True, "light", False])
def test_a_warm_up_leaves_the_engine_as_it_found_it(micro, references, monkeypatch, warmup):
    """The full warm-up (measured runs), the light one (a server's, on a GPU) and none: the run
    after yields every request's reference tokens and counts only its own passes. On the CPU the
    light one is skipped (its first passes cost what later ones do); it runs where the device is
    a GPU (pretended here: its passes still run on the CPU)."""
    import schedlab.engine.backend as engine_backend

    def unified():
        return make_policy("unified", {"token_budget": "48", "max_batch": "5"})

    _, cold = run_real(micro, unified(), warmup=False)
    if warmup == "light":
        _, on_cpu = run_real(micro, unified(), warmup="light")
        assert on_cpu.stats["warmup_s"] == 0.0
        gpu = engine_backend.mx.gpu
        monkeypatch.setattr(engine_backend.mx, "default_device", lambda: gpu)
    _, backend = run_real(micro, unified(), warmup=warmup)
    assert_reference_tokens(backend, references)
    assert (backend.stats["warmup_s"] > 0) == bool(warmup)
    for key in ("forwards", "decode_rows", "prefill_tokens", "padded_prefill_tokens", "joins", "leaves"):
        assert backend.stats[key] == cold.stats[key], key
    with pytest.raises(ValueError, match="warmup is True, False or 'light'"):
        MLXBackend(micro, warmup="fast")


def test_references_are_context_sensitive(micro, references):
    """The equivalence tests have teeth: one changed early prompt token changes the output,
    and the requests do not all produce the same tokens."""
    ids = prompt_ids(0, "a", 300, micro.vocab_size)
    changed = list(ids)
    changed[3] = (changed[3] + 1) % micro.vocab_size
    assert reference_tokens(micro, changed, 60) != references["a"]
    assert len({tuple(t[:10]) for t in references.values() if len(t) >= 10}) >= 6


CASES = [
    ("mlx-default", {"prefill_step_size": "64"}),  # several padded chunks per prompt
    ("mlx-default", {"prefill_step_size": "2048", "prefill_batch_size": "3", "completion_batch_size": "4"}),
    ("prefer-prefill", {"prefill_step_size": "48", "prefill_batch_size": "3"}),
    ("static", {"batch_size": "3"}),  # padded whole-prompt prefills completing in the pass
    ("static", {"batch_size": "4", "padded": "false"}),
    ("slots", {"n_slots": "3"}),
    ("chunked-prefill", {"budget": "40", "max_batch": "4"}),
    ("unified", {"token_budget": "48", "max_batch": "5"}),  # decode + chunks in one eval
    ("unified", {"token_budget": "48", "max_batch": "5", "separate": "true"}),  # the same as two evals
]


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_every_policy_yields_the_reference_tokens(micro, references, name, options):
    result, backend = run_real(micro, make_policy(name, options))
    assert_reference_tokens(backend, references)
    assert all(r.finish_s is not None for r in result.requests)
    # a late request was admitted while an earlier one was still decoding (static batching
    # admits only between batches, by design)
    reqs = {r.id: r for r in result.requests}
    assert name == "static" or any(
        reqs[late].admitted_s < reqs[early].finish_s and reqs[late].admitted_s > reqs[early].first_token_s
        for late in "fghij"
        for early in "abd"
    )
    # nothing is left behind: every finished request's KV was freed
    assert backend.batch_rows == [] and not any(backend.holds(r.id) for r in result.requests)
    stats = backend.stats
    assert (
        stats["joins"]
        == stats["leaves"]
        == sum(1 for r in trace() if r.output_tokens > 1 or name.startswith(("mlx", "prefer")))
    )


def test_padded_chunks_really_pad(micro, references):
    """mlx-default's padded passes compute rows x longest chunk tokens."""
    _, backend = run_real(micro, make_policy("mlx-default", {"prefill_step_size": "64"}))
    assert backend.stats["padded_prefill_tokens"] > backend.stats["prefill_tokens"]


# ---------------------------------------------------------------------- driving by hand


class Driver:
    """A ReplicaState and an MLXBackend driven plan by plan (the loop's calls, no clock)."""

    def __init__(self, model, requests, **kw):
        self.state = ReplicaState(requests, 1_000_000, "test")
        for r in self.state.accepted:
            self.state.arrive(r)
        self.backend = MLXBackend(model, warmup=False, **kw)
        self.backend.start(self.state)
        self.shapes = []

    def apply(self, plan: Plan):
        for r in self.state.apply_admin(plan, 0.0):
            self.backend.release(r)
        for p in plan.passes:
            shape = self.state.shape(p)
            self.shapes.append(shape)
            self.backend.execute(p, shape, self.state)
            for r in self.state.apply_pass(p, 0.0):
                self.backend.release(r)
        self.state.step_index += 1


def whole_prompt_cache(model, ids):
    cache = [KVCache() for _ in range(model.n_layers)]
    model.model(mx.array([ids]), cache=cache)
    mx.eval([c.keys for c in cache])
    return cache


def next_logits(model, kv, token):
    """Logits for ``token`` appended to a cache made of (keys, values) per layer."""
    cache = []
    for k, v in kv:
        c = KVCache()
        c.update_and_fetch(mx.array(k), mx.array(v))
        cache.append(c)
    return model.model(mx.array([[token]]), cache=cache)[:, -1, :]


def assert_same_state(model, got_kv, ids, next_token):
    ref = whole_prompt_cache(model, ids)
    assert len(got_kv) == len(ref)
    for (k, v), c in zip(got_kv, ref):
        assert k.shape == c.keys[..., : c.offset, :].shape
        assert mx.allclose(k, c.keys[..., : c.offset, :], atol=1e-5, rtol=1e-5).item()
        assert mx.allclose(v, c.values[..., : c.offset, :], atol=1e-5, rtol=1e-5).item()
    ref_kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in ref]
    a, b = next_logits(model, got_kv, next_token), next_logits(model, ref_kv, next_token)
    assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()
    assert mx.argmax(a).item() == mx.argmax(b).item()


def test_chunked_prefill_state_equals_whole_prompt_state(micro):
    req = Request("x", 0.0, 300, 5)
    d = Driver(micro, [req])
    d.apply(Plan(admit=("x",), passes=(Pass(prefill=(("x", 64),)),)))
    d.apply(Plan(passes=(Pass(prefill=(("x", 100),)),)))
    d.apply(Plan(passes=(Pass(prefill=(("x", 135),)),)))  # 299: one left for the hand-off
    ids = prompt_ids(0, "x", 300, micro.vocab_size)
    assert_same_state(micro, d.backend.kv_arrays("x"), ids[:299], ids[299])
    # a different split gives the same state too, and a wrong one does not
    d2 = Driver(micro, [req])
    d2.apply(Plan(admit=("x",), passes=(Pass(prefill=(("x", 299),)),)))
    assert_same_state(micro, d2.backend.kv_arrays("x"), ids[:299], ids[299])
    with pytest.raises(AssertionError):
        assert_same_state(micro, d.backend.kv_arrays("x"), ids[1:300], ids[299])


def test_padded_prefill_of_rows_at_different_contexts(micro):
    """One right-padded forward over rows at different contexts leaves each row's own state."""
    reqs = [Request("p", 0.0, 200, 3), Request("q", 0.0, 90, 3), Request("s", 0.0, 50, 3)]
    d = Driver(micro, reqs)
    d.apply(Plan(admit=("p", "q", "s"), passes=(Pass(prefill=(("p", 120), ("q", 10)), padded=True),)))
    d.apply(Plan(passes=(Pass(prefill=(("p", 79), ("q", 79), ("s", 30)), padded=True),)))
    assert d.shapes[-1].padded and d.shapes[-1].padded_prefill_tokens == 3 * 79
    for rid, n in (("p", 199), ("q", 89), ("s", 30)):
        ids = prompt_ids(0, rid, {"p": 200, "q": 90, "s": 50}[rid], micro.vocab_size)
        assert_same_state(micro, d.backend.kv_arrays(rid), ids[:n], ids[n])


def test_finished_request_kv_is_freed_and_batch_shrinks(micro):
    reqs = [Request("u", 0.0, 40, 2), Request("v", 0.0, 30, 5), Request("w", 0.0, 20, 5)]
    d = Driver(micro, reqs)
    d.apply(Plan(admit=("u", "v", "w"), passes=(Pass(prefill=(("u", 40), ("v", 30), ("w", 20)), padded=True),)))
    assert all(d.backend.holds(r) for r in "uvw") and d.backend.batch_rows == []
    d.apply(Plan(passes=(Pass(decode=("u", "v", "w")),)))  # u's second token: u finishes
    assert d.shapes[-1].joins == 3 and d.shapes[-1].leaves == 1
    assert d.backend.batch_rows == ["v", "w"] and set(d.backend.batch_rows) == d.state.batch
    assert not d.backend.holds("u")
    assert d.backend._batch[0].keys.shape[0] == 2
    d.apply(Plan(passes=(Pass(decode=("v", "w")),)))
    for rid in "vw":
        assert len(d.backend.kv_arrays(rid)[0][0][0, 0]) == d.state.by_id[rid].kv_tokens
    d.apply(Plan(passes=(Pass(decode=("v", "w")),)))
    d.apply(Plan(passes=(Pass(decode=("v", "w")),)))  # both finish: filter([]) is avoided
    assert d.backend.batch_rows == [] and d.backend._batch is None
    assert not d.backend.holds("v") and not d.backend.holds("w")
    for r in reqs:
        ids = prompt_ids(0, r.id, r.prompt_tokens, micro.vocab_size)
        assert d.backend.tokens[r.id] == reference_tokens(micro, ids, r.output_tokens)


# ---------------------------------------------------------------------- odd policies


@dataclasses.dataclass
class PreemptOnce(MlxDefault):
    """mlx-default, but preempts the first decoding request with 3+ tokens out, and the
    first prefilling request with some KV, once each (recompute on re-admission)."""

    name = "preempt-once"
    done_decode: bool = False
    done_prefill: bool = False

    def plan(self, view):
        if not self.done_decode:
            for r in view.decoding:
                if r.generated >= 3 and r.generated + 1 < r.output_tokens:
                    self.done_decode = True
                    return Plan(preempt=(r.id,))
        if not self.done_prefill:
            for r in view.prefilling:
                if 0 < r.prefilled < r.prompt_tokens - 1:
                    self.done_prefill = True
                    return Plan(preempt=(r.id,))
        return super().plan(view)


def test_preemption_recomputes_to_the_reference_tokens(micro, references):
    policy = PreemptOnce(prefill_step_size=48, prefill_batch_size=3)
    result, backend = run_real(micro, policy)
    assert policy.done_decode and policy.done_prefill
    assert sum(r.preemptions for r in result.requests) == 2
    assert backend.stats["preemptions"] == 2
    assert_reference_tokens(backend, references)


@dataclasses.dataclass
class Alternate(MlxDefault):
    """Decodes only every other decoding request each step: rows park and rejoin."""

    name = "alternate"

    def plan(self, view):
        plan = super().plan(view)
        passes = []
        for p in plan.passes:
            if p.decode and len(p.decode) > 1:
                keep = tuple(rid for i, rid in enumerate(p.decode) if (i + view.step_index) % 2 == 0)
                p = Pass(decode=keep)
            passes.append(p)
        return Plan(admit=plan.admit, preempt=plan.preempt, passes=tuple(passes))


def test_rows_parked_out_of_the_batch_continue_exactly(micro, references):
    result, backend = run_real(micro, Alternate(prefill_step_size=64))
    assert backend.stats["parks"] > 0
    assert_reference_tokens(backend, references)


# ---------------------------------------------------------------------- ids and sampling


def test_prompt_ids_share_prefix_blocks():
    a = prompt_ids(0, "a", 1300, 4096, prefix_ids=(7, 8, 9))
    b = prompt_ids(0, "b", 1100, 4096, prefix_ids=(7, 8, 5))
    c = prompt_ids(1, "a", 1300, 4096, prefix_ids=(7, 8, 9))
    assert len(a) == 1300 and len(b) == 1100 and all(0 <= t < 4096 for t in a + b)
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]
    assert a != c and a == prompt_ids(0, "a", 1300, 4096, prefix_ids=(7, 8, 9))
    assert prompt_ids(0, "a", 50, 4096) != prompt_ids(0, "b", 50, 4096)


def test_temperature_sampling_is_seeded_and_batch_invariant(micro, references):
    spec = "temperature=1.5,seed=3"
    _, one = run_real(micro, make_policy("mlx-default", {"prefill_step_size": "64"}), sampling=spec)
    _, two = run_real(micro, make_policy("slots", {"n_slots": "2"}), sampling=spec)
    assert one.tokens == two.tokens
    assert sum(one.tokens[r] != references[r] for r in references) >= 5
    _, other = run_real(micro, make_policy("slots", {"n_slots": "2"}), sampling="temperature=1.5,seed=4")
    assert other.tokens != one.tokens


def test_full_logits_fallback_gives_the_same_tokens(micro, references):
    """Architectures whose head cannot be split off run model(x) (logits for every position)."""
    full = dataclasses.replace(
        micro, fast_head=False, head=lambda h: h, hidden=lambda x, cache: micro.model(x, cache=cache)
    )
    _, backend = run_real(full, make_policy("static", {"batch_size": "3"}))
    assert_reference_tokens(backend, references)


def test_a_steady_step_hands_simpy_nothing_and_checks_nothing(micro):
    """What a real step does beyond its passes, counted (not timed): a step that ends before the
    next arrival schedules no SimPy event (no hop to move SimPy's clock up), and the engine's
    state check runs only on passes where rows join, leave or prefill. Tokens stay exact."""
    from schedlab.sim.clock import WallClock

    reqs = [Request("a", 0.0, 50, 60), Request("b", 0.12, 30, 50), Request("c", 0.3, 70, 40)]
    backend = MLXBackend(micro)
    clock = WallClock()
    env = clock.env
    scheduled = []
    schedule = env.schedule

    def counting_schedule(event, priority=1, delay=0):
        scheduled.append(type(event).__name__)
        return schedule(event, priority, delay)

    env.schedule = counting_schedule
    checks = []
    check = backend._check
    backend._check = lambda p, state: (checks.append(p), check(p, state))[1]
    res = run_replica(reqs, make_policy("unified"), NO_COST, kv_capacity=100_000, backend=backend, clock=clock)
    assert res.error is None, res.error
    for r in reqs:
        ref = reference_tokens(micro, prompt_ids(0, r.id, r.prompt_tokens, micro.vocab_size), r.output_tokens)
        assert backend.tokens[r.id] == ref, r.id
    steps = len(res.steps)
    assert steps >= 100
    # per arrival: its timeout and the replica's wake (and the processes' own start and end);
    # a hop per step would be >= 100 more
    assert len(scheduled) <= 4 * len(reqs) + 2 * len(res.wakes) + 6, (steps, scheduled)
    changing = [s for s in res.shapes if s.prefill or s.joins or s.leaves]
    assert len(checks) == len(changing) and len(changing) < steps // 4


HANDED = [CASES[i] for i in (0, 3, 6, 7)]  # mlx-lm's hand-off; padded whole prompts; chunks; decode + chunks


@pytest.mark.parametrize("name,options", HANDED, ids=[n for n, _ in HANDED])
def test_kv_handed_from_a_prefill_engine_to_a_decode_engine_gives_the_reference_tokens(
    micro, references, name, options, tmp_path
):
    """Prefill and decode apart: one engine makes each request's first token and writes its
    prompt's KV to a file; a second engine reads it and makes the rest without computing any
    prompt token again (a one-token chunk or mlx-lm's hand-off: only the first token's KV)."""
    from schedlab.engine import kvfile
    from schedlab.sim.disagg import TransferredRequest

    requests = trace()
    pre = [dataclasses.replace(r, output_tokens=1) for r in requests]
    prefill = MLXBackend(micro)
    prefill.export_kv = {r.id: str(tmp_path / f"{r.id}.kv") for r in requests}
    first = run_replica(pre, make_policy(name, options), NO_COST, kv_capacity=100_000, backend=prefill)
    assert first.error is None, first.error
    for r in pre:
        assert prefill.tokens[r.id] == references[r.id][:1]
    onward = [r for r in requests if r.output_tokens > 1]
    decode = MLXBackend(micro)
    moved = []
    for r in onward:
        assert r.id in prefill.exported and prefill.exported[r.id]["tokens"] == r.prompt_tokens
        head, kv = kvfile.read(prefill.exported[r.id]["path"])
        assert head["ids"][-1] == references[r.id][0]
        decode.expect_kv(r.id, head, kv)
        moved.append(
            TransferredRequest(
                r.id, r.arrival_s, r.prompt_tokens + 1, r.output_tokens - 1, kv_transferred=r.prompt_tokens
            )
        )
    # (exports were asked for every request: the one-token request too)
    assert set(prefill.exported) == {r.id for r in requests}
    result = run_replica(moved, make_policy(name, options), NO_COST, kv_capacity=100_000, backend=decode)
    assert result.error is None, result.error
    for r in onward:
        assert prefill.tokens[r.id] + decode.tokens[r.id] == references[r.id], r.id
    s = decode.stats
    assert s["kv_imported_tokens"] == sum(r.prompt_tokens for r in onward)
    assert s["prefill_tokens"] <= len(onward)  # at most each request's first token, never its prompt
    if name == "mlx-default":
        assert s["prefill_tokens"] == 0  # mlx-lm's hand-off: the first token is a decode row's input
    assert decode.batch_rows == [] and not any(decode.holds(r.id) for r in moved)


def test_a_bfloat16_kv_goes_through_its_file_bit_for_bit(tmp_path):
    """numpy has no bfloat16: the file carries the bits, and the decode engine's cache gets them back."""
    from schedlab.engine import kvfile
    from schedlab.sim.disagg import TransferredRequest

    model = load_model("micro", dtype="bfloat16")
    requests = [Request("a", 0.0, 50, 8), Request("b", 0.0, 20, 6)]
    prefill = MLXBackend(model)
    prefill.export_kv = {r.id: str(tmp_path / f"{r.id}.kv") for r in requests}
    policy = make_policy("unified", {})
    first = [dataclasses.replace(r, output_tokens=1) for r in requests]
    assert run_replica(first, policy, NO_COST, kv_capacity=10_000, backend=prefill).error is None
    decode = MLXBackend(model)
    for r in requests:
        head, kv = kvfile.read(prefill.exported[r.id]["path"])
        assert head["dtype"] == "bfloat16" and kv.dtype.name == "uint16" and kv.shape[3] == r.prompt_tokens
        decode.expect_kv(r.id, head, kv)
    moved = [
        TransferredRequest(r.id, 0.0, r.prompt_tokens + 1, r.output_tokens - 1, kv_transferred=r.prompt_tokens)
        for r in requests
    ]
    assert run_replica(moved, make_policy("unified", {}), NO_COST, kv_capacity=10_000, backend=decode).error is None
    for r in requests:
        ref = reference_tokens(model, prompt_ids(0, r.id, r.prompt_tokens, model.vocab_size), r.output_tokens)
        assert prefill.tokens[r.id] + decode.tokens[r.id] == ref
    wrong = MLXBackend(load_model("micro"))  # (float32: the file does not fit it)
    with pytest.raises(
        EngineError,
        match=r"the KV given is bfloat16 of shape \(.*\), but this model's is float32 of shape "
        r".*must run the same model and dtype",
    ):
        wrong.expect_kv("a", *kvfile.read(prefill.exported["a"]["path"]))
