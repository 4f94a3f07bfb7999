"""The engine on every cache kind mlx-lm batches: each family's greedy tokens equal the model alone.

The models are seeded tiny random-weight checkpoints built from mlx-lm's own classes
(``engine.families``): hybrid Gated-DeltaNet models (qwen3_5, qwen3_next with MoE: a recurrent and
a convolution state per linear layer, ``ArraysCache``, beside full-attention ``KVCache`` layers),
sliding-window models (gemma3_text, gpt_oss: ``RotatingKVCache`` with a 16-token window), lfm2
(convolution state) and a 4-bit quantized llama. A reference is mlx-lm's own single-sequence
``generate_step`` on one prompt; the engine must give exactly its tokens whatever the policy, the
chunking (boundaries inside and across the window), the padding, the joining of rows into a batch
whose windows have rotated, the parking, a preemption, a cancellation mid-prefill or the
prefill/decode hand-off.
"""

from __future__ import annotations

import dataclasses

import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab.engine.backend import MLXBackend, _cache_arrays
from schedlab.engine.errors import EngineError
from schedlab.engine.models import load_model
from schedlab.engine.sampling import prompt_ids

import mlx.core as mx
from mlx_lm.generate import generate_step

from schedlab.policies import make_policy
from schedlab.sim.cost import LinearCostModel
from schedlab.sim.layout import CacheLayout
from schedlab.sim import run_replica
from schedlab.sim.sources import TraceSource
from schedlab.traces.schema import Request

from test_engine import CASES, PreemptOnce

NO_COST = LinearCostModel({})
FAMILIES = ["micro-qwen3_5", "micro-qwen3_next", "micro-gemma3", "micro-gpt_oss", "micro-lfm2", "micro-llama-q4"]
KINDS = {
    "micro-qwen3_5": {"ArraysCache", "KVCache"},
    "micro-qwen3_next": {"ArraysCache", "KVCache"},
    "micro-gemma3": {"RotatingKVCache", "KVCache"},
    "micro-gpt_oss": {"RotatingKVCache", "KVCache"},
    "micro-lfm2": {"ArraysCache", "KVCache"},
    "micro-llama-q4": {"KVCache"},
}
# chunks of 7 (boundaries inside the 16-token window) and a 3-token budget (a prompt in many chunks)
FAMILY_CASES = CASES + [("chunked-prefill", {"budget": "7", "max_batch": "3"})]


def trace() -> list[Request]:
    """7 requests, prompts 1..90 (most longer than the 16-token windows), outputs 1..14; three
    arrive while the first ones decode (they join a batch whose windows have rotated)."""
    rows = [("a", 0.0, 90, 14), ("b", 0.0, 10, 9), ("c", 0.0, 37, 1), ("d", 0.0, 1, 6), ("e", 0.0, 45, 12)]
    rows += [("f", 0.01, 50, 10), ("g", 0.02, 23, 8)]
    return [Request(rid, t, p, o) for rid, t, p, o in rows]


def reference(model, prompt, n):
    """mlx-lm's own single-sequence greedy generation (``generate_step``, the model's own caches)."""
    out = []
    for tok, _ in generate_step(mx.array(prompt, dtype=mx.uint32), model.model, max_tokens=n):
        out.append(int(tok))
    return out


_models: dict = {}


def family(name):
    """(model, references by request id), built once per family."""
    if name not in _models:
        m = load_model(name)
        refs = {
            r.id: reference(m, prompt_ids(0, r.id, r.prompt_tokens, m.vocab_size), r.output_tokens) for r in trace()
        }
        _models[name] = (m, refs)
    return _models[name]


def run_real(model, policy, requests=None, source=None, backend=None, **kw):
    backend = backend or MLXBackend(model)
    kv = kw.pop("kv_capacity", 100_000)
    result = run_replica(source or requests or trace(), policy, NO_COST, kv_capacity=kv, backend=backend, **kw)
    assert result.error is None, result.error
    return result, backend


def assert_references(backend, refs, requests=None, skip=()):
    for r in requests or trace():
        if r.id not in skip:
            assert backend.tokens[r.id] == refs[r.id], f"request {r.id} differs from its reference"


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_has_its_cache_kinds_and_context_sensitive_references(name):
    """The equivalence tests have teeth: the caches are the family's own kinds, an early prompt
    token (outside the last window) changes the output, and requests differ from each other."""
    m, refs = family(name)
    assert set(m.cache_kinds) == KINDS[name]
    assert m.plain_kv == (name == "micro-llama-q4")
    ids = prompt_ids(0, "a", 90, m.vocab_size)
    changed = list(ids)
    changed[3] = (changed[3] + 1) % m.vocab_size
    assert reference(m, changed, 14) != refs["a"]
    assert len({tuple(t[:5]) for t in refs.values() if len(t) >= 5}) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_every_policy_yields_each_familys_reference_tokens(name):
    m, refs = family(name)
    for policy, options in FAMILY_CASES:
        result, backend = run_real(m, make_policy(policy, options))
        assert_references(backend, refs)
        assert all(r.finish_s is not None for r in result.requests), (policy, options)
        # nothing is left behind: every finished request's caches were freed
        assert backend.batch_rows == [] and not any(backend.holds(r.id) for r in result.requests)
    assert backend.stats["padded_prefill_tokens"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_preemption_under_a_small_kv_and_by_hand_recomputes_to_the_reference(name):
    m, refs = family(name)
    # vLLM's policy with room for little more than the longest request: it must preempt (all
    # arriving at once, the schedule does not depend on the machine's speed)
    at_once = [dataclasses.replace(r, arrival_s=0.0) for r in trace()]
    # (room for the longest request, 103 KV tokens, and two requests' windows and recurrent states)
    layout = CacheLayout.from_dict(m.layout) if not m.plain_kv else None
    kv = 110 + (2 * layout.fixed_tokens(103) if layout else 0)
    result, backend = run_real(m, make_policy("vllm", {}), at_once, kv_capacity=kv)
    assert not result.rejected and sum(r.preemptions for r in result.requests) > 0
    assert_references(backend, refs)
    # the simulator, told the model's cache layout by a profile, counts the engine's memory: the
    # same admissions, preemptions and tokens, request by request (the schedule is the machine's
    # speed's no more: everything arrived at once)
    profile = LinearCostModel({}, meta={"cache_layout": m.layout} if layout else {})
    sim = run_replica(at_once, make_policy("vllm", {}), profile, kv_capacity=kv)
    assert [(r.id, r.preemptions, r.generated) for r in sim.requests] == [
        (r.id, r.preemptions, r.generated) for r in result.requests
    ]
    assert [s.kv_tokens for s in sim.steps] == [s.kv_tokens for s in result.steps]
    # one decoding and one prefilling request preempted (a recurrent state mid-prompt dropped)
    policy = PreemptOnce(prefill_step_size=16, prefill_batch_size=3)
    result, backend = run_real(m, policy)
    assert policy.done_decode and policy.done_prefill and backend.stats["preemptions"] == 2
    assert_references(backend, refs)


class CancellingSource(TraceSource):
    """A trace whose request ``rid`` is cancelled (its client gone) once it is mid-prefill: after
    the step that gave it its ``chunks``-th prefill chunk, with more of its prompt still to come.
    ``watch`` (the run's ``on_step``) also records, for the test, the step and the prefilled count
    at the cancellation and what the replica and the engine hold at the first step after it."""

    replica_cancel = None

    def __init__(self, requests, rid, backend, chunks=3):
        super().__init__(requests)
        self.rid, self.backend, self.chunks = rid, backend, chunks
        self.done = False
        self.seen = self.prefilled = 0  # steps that prefilled it, its prompt tokens computed
        self.cancel_step = None  # the step after which it was cancelled
        self.after = None  # (kv used, kv of the others, engine holds it, batch rows, batch dims)

    def watch(self, state):
        r = state.by_id[self.rid]
        if self.done:
            if self.after is None:  # the first step after the cancellation (it came before it)
                others = sum(o.kv_tokens + o.fixed_tokens for o in state.running.values())
                dims = {a.shape[0] for c in self.backend._batch or () for a in _cache_arrays([c]) if a.ndim}
                self.after = (state.kv_used, others, self.backend.holds(self.rid), self.backend.batch_rows, dims)
            return
        if r.prefilled > self.prefilled:
            self.seen += 1
            self.prefilled = r.prefilled
        if self.seen >= self.chunks and r.prefilled < r.prompt_tokens - 1:
            self.done = True
            self.cancel_step = state.step_index - 1  # (the state counts the step it just ran)
            self.replica_cancel(self.rid)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,policy,options,rid",
    [
        ("micro-qwen3_5", "chunked-prefill", {"budget": "8"}, "a"),
        ("micro-qwen3_5", "vllm", {"max_num_batched_tokens": "8"}, "a"),
        ("micro-qwen3_5", "vllm", {"max_num_batched_tokens": "8"}, "e"),
        ("micro-gemma3", "chunked-prefill", {"budget": "8"}, "a"),
        ("micro-lfm2", "chunked-prefill", {"budget": "8"}, "a"),
    ],
)
def test_a_request_cancelled_mid_prefill_leaves_the_others_exact(name, policy, options, rid):
    """A request (a: a 90-token prompt; e: 45 tokens, prefilled beside the decoding batch) in
    chunks of at most 8, cancelled after its third chunk: no pass computes it again, its caches (KV,
    and a hybrid's recurrent and convolution states) are freed at once, in the replica's count and
    in the engine, and every other request's greedy tokens are those of the model alone and of the
    same run without it (seed PR 002's second bug: a cancelled request kept being prefilled)."""
    m, refs = family(name)
    backend = MLXBackend(m)
    source = CancellingSource(trace(), rid, backend)
    result, backend = run_real(m, make_policy(policy, options), source=source, on_step=source.watch, backend=backend)
    r = next(r for r in result.requests if r.id == rid)
    assert source.done and r.cancelled_s is not None and r.first_token_s is None
    assert 0 < source.prefilled < r.prompt_tokens - 1
    # its chunks: three or more, the last in the step after which it was cancelled; none after that
    chunks = [(step, n) for step, _, _, _, p in result.passes for x, n in p.prefill if x == rid]
    assert len(chunks) >= 3 and max(step for step, _ in chunks) == source.cancel_step, chunks
    assert sum(n for _, n in chunks) == source.prefilled and not any(rid in p.decode for *_, p in result.passes)
    # from the first step after it: the KV in use is exactly what the others hold (their KV and
    # fixed blocks), the engine holds no cache of it, and every batch cache has one row per request
    used, others, held, rows, dims = source.after
    assert used == others and not held and rid not in rows and dims <= {len(rows)}, source.after
    assert backend.tokens.get(rid, []) == [] and not backend.holds(rid)
    assert_references(backend, refs, skip=(rid,))
    # the others' tokens are those of the same run without it
    without = [x for x in trace() if x.id != rid]
    _, alone = run_real(m, make_policy(policy, options), without)
    assert {r.id: backend.tokens[r.id] for r in without} == {r.id: alone.tokens[r.id] for r in without}


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy,options", [("chunked-prefill", {"budget": "8"}), ("vllm", {"max_num_batched_tokens": "8"})]
)
def test_an_empty_prompt_is_refused_on_arrival_and_the_others_stay_exact(policy, options):
    """A request of 0 prompt tokens handed to the replica on micro-qwen3_5, arriving while the
    others prefill in chunks (seed PR 002's first bug: admitted with nothing to prefill, it wedged
    the chunked prefill): refused on arrival in one line, never seen by the engine, and every other
    request gives its reference tokens."""
    m, refs = family("micro-qwen3_5")
    result, backend = run_real(m, make_policy(policy, options), trace() + [Request("z", 0.005, 0, 5)])
    ((z, why),) = result.rejected
    assert z.id == "z" and why == "request z has an empty prompt (0 tokens)"
    assert "z" not in backend.tokens and not backend.holds("z") and z.prefilled == 0
    assert all(r.finish_s is not None for r in result.requests if r.id != "z")
    assert_references(backend, refs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["micro-qwen3_5", "micro-gemma3"])
def test_prefix_caching_is_refused_in_one_line(name):
    m, _ = family(name)
    with pytest.raises(EngineError) as err:
        run_replica(
            trace(), make_policy("vllm", {}), NO_COST, kv_capacity=10_000, backend=MLXBackend(m), prefix_caching=True
        )
    msg = str(err.value)
    assert "\n" not in msg and "prefix caching" in msg and ("ArraysCache" in msg or "RotatingKVCache" in msg)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["micro-qwen3_5", "micro-gemma3"])
def test_caches_handed_from_a_prefill_engine_to_a_decode_engine_give_the_reference(name, tmp_path):
    """Prefill and decode apart on a hybrid and a sliding family: the recurrent state and the
    rotated window travel with the KV, and the decode engine computes no prompt token again."""
    from schedlab.engine import kvfile
    from schedlab.sim.disagg import TransferredRequest

    m, refs = family(name)
    requests = trace()
    pre = [dataclasses.replace(r, output_tokens=1) for r in requests]
    prefill = MLXBackend(m)
    prefill.export_kv = {r.id: str(tmp_path / f"{r.id}.kv") for r in requests}
    first = run_replica(
        pre, make_policy("chunked-prefill", {"budget": "24"}), NO_COST, kv_capacity=100_000, backend=prefill
    )
    assert first.error is None, first.error
    onward = [r for r in requests if r.output_tokens > 1]
    decode = MLXBackend(m)
    moved = []
    for r in onward:
        head, kv = kvfile.read(prefill.exported[r.id]["path"])
        assert head["version"] == kvfile.CACHES_VERSION and kvfile.prompt_tokens(head) == r.prompt_tokens
        decode.expect_kv(r.id, head, kv)
        moved.append(
            TransferredRequest(
                r.id, r.arrival_s, r.prompt_tokens + 1, r.output_tokens - 1, kv_transferred=r.prompt_tokens
            )
        )
    result = run_replica(moved, make_policy("mlx-default", {}), NO_COST, kv_capacity=100_000, backend=decode)
    assert result.error is None, result.error
    for r in onward:
        assert prefill.tokens[r.id] + decode.tokens[r.id] == refs[r.id], r.id
    assert decode.stats["prefill_tokens"] == 0 and decode.stats["kv_imported_tokens"] == sum(
        r.prompt_tokens for r in onward
    )
    # a file of another model's caches is refused in one line
    other = load_model("micro")
    head, kv = kvfile.read(prefill.exported["a"]["path"])
    with pytest.raises(EngineError, match="caches"):
        MLXBackend(other).expect_kv("a", head, kv)


@pytest.mark.slow
def test_a_cache_kind_mlx_lm_cannot_batch_is_refused_in_one_line(monkeypatch):
    """A model whose cache has no batch form (mlx-lm's ``ChunkedKVCache``, llama 4's local
    attention) gets one line naming the kind, as mlx-lm's batch generator refuses it."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import ChunkedKVCache

    from schedlab.engine import models

    monkeypatch.setattr(llama.Model, "make_cache", lambda self: [ChunkedKVCache(8) for _ in self.layers], raising=False)
    with pytest.raises(EngineError) as err:
        models.load_model("micro")
    assert "ChunkedKVCache" in str(err.value) and "\n" not in str(err.value)
