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
from schedlab.engine.backend import MLXBackend
from schedlab.engine.errors import EngineError
from schedlab.engine.models import load_model
from schedlab.engine.sampling import prompt_ids

import mlx.core as mx
from mlx_lm.generate import generate_step

from schedlab.policies import make_policy
from schedlab.sim.cost import LinearCostModel
from schedlab.sim.layout import CacheLayout
from schedlab.sim.loop import run
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


def run_real(model, policy, requests=None, source=None, **kw):
    backend = MLXBackend(model)
    kv = kw.pop("kv_capacity", 100_000)
    result = run(source or requests or trace(), policy, NO_COST, kv_capacity=kv, backend=backend, **kw)
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
    sim = run(at_once, make_policy("vllm", {}), profile, kv_capacity=kv)
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
    """A trace whose request ``rid`` is cancelled (its client gone) once it is mid-prefill."""

    replica_cancel = None

    def __init__(self, requests, rid):
        super().__init__(requests)
        self.rid = rid
        self.done = False

    def watch(self, state):
        r = state.by_id[self.rid]
        if not self.done and 0 < r.prefilled < r.prompt_tokens - 1:
            self.done = True
            self.replica_cancel(self.rid)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["micro-qwen3_5", "micro-gemma3", "micro-lfm2"])
def test_a_request_cancelled_mid_prefill_leaves_the_others_exact(name):
    m, refs = family(name)
    source = CancellingSource(trace(), "a")
    result, backend = run_real(m, make_policy("chunked-prefill", {"budget": "8"}), source=source, on_step=source.watch)
    a = next(r for r in result.requests if r.id == "a")
    assert source.done and a.cancelled_s is not None and a.first_token_s is None
    assert backend.tokens.get("a", []) == [] and not backend.holds("a")
    assert_references(backend, refs, skip=("a",))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["micro-qwen3_5", "micro-gemma3"])
def test_prefix_caching_is_refused_in_one_line(name):
    m, _ = family(name)
    with pytest.raises(EngineError) as err:
        run(trace(), make_policy("vllm", {}), NO_COST, kv_capacity=10_000, backend=MLXBackend(m), prefix_caching=True)
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
    first = run(pre, make_policy("chunked-prefill", {"budget": "24"}), NO_COST, kv_capacity=100_000, backend=prefill)
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
    result = run(moved, make_policy("mlx-default", {}), NO_COST, kv_capacity=100_000, backend=decode)
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
