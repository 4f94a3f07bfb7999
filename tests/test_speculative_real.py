"""Speculative decoding on the real MLX engine: batched verification, rows accepting different
numbers of drafts in one pass, greedy tokens exactly those of decoding one at a time.

Real parts: the SimPy loop in real-time mode with ``MLXBackend``, real MLX on CPU, the ``micro``
preset (seeded random weights, whose greedy outputs repeat themselves: n-gram drafts get
accepted) and SmolLM2-135M, the engine's n-gram prompt lookup; references are each prompt alone
through mlx-lm's plain KVCache (``reference_tokens``).
"""

from __future__ import annotations

import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab.engine.backend import MLXBackend, ngram_drafts, reference_tokens
from schedlab.engine.errors import EngineError
from schedlab.engine.models import load_model
from schedlab.engine.sampling import parse_sampling, prompt_ids
from schedlab.engine.windowcache import WindowBatchKVCache
from schedlab.policies import POLICIES, make_policy
from schedlab.policies.speculative import Speculative
from schedlab.sim import run_replica
from schedlab.sim.cost import LinearCostModel
from schedlab.traces.schema import Request

NO_COST = LinearCostModel({})
TRACE = [  # id, arrival_s, prompt, output: rows join and leave the batch while others verify
    Request("a", 0.0, 40, 48),
    Request("b", 0.0, 9, 30),
    Request("c", 0.0, 70, 1),
    Request("d", 0.01, 25, 40),
    Request("e", 0.02, 3, 22),
    Request("f", 0.03, 55, 35),
]


@pytest.fixture(scope="module")
def micro():
    return load_model("micro")


@pytest.fixture(scope="module")
def references(micro):
    return {
        r.id: reference_tokens(micro, prompt_ids(0, r.id, r.prompt_tokens, micro.vocab_size), r.output_tokens)
        for r in TRACE
    }


def test_ngram_lookup_proposes_what_followed_the_latest_earlier_match():
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # the latest "1 2 3" before the end
    assert ngram_drafts([5, 6, 7, 8, 5], 3) == [6, 7, 8]  # a 1-gram at the least
    assert ngram_drafts([1, 2, 3, 4], 3) == []  # nothing recurs
    assert ngram_drafts([4, 4, 4, 4], 5) == [4]  # what follows, as far as it goes


class CacheWatch:
    """After every step: each batch row's real tokens in the engine's caches (mlx-lm's per-row
    ``offset``) are the KV the state machine says it holds: a rejected draft kept, or a kept
    token rolled back, shows here."""

    def __init__(self, backend):
        self.backend, self.rows = backend, 0

    def __call__(self, state):
        b = self.backend
        if not b._batch:
            return
        offsets = b._batch[0].offset.tolist()
        for rid, have in zip(b._rows, offsets):
            r = state.by_id[rid]
            assert have == b._kv[rid] == r.kv_tokens, (rid, have, b._kv[rid], r.kv_tokens)
            self.rows += 1


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_tokens_with_speculation_equal_the_references_under_every_policy(micro, references, policy):
    backend = MLXBackend(micro)
    watch = CacheWatch(backend)
    pol = Speculative(make_policy(policy), k=3)
    res = run_replica(TRACE, pol, NO_COST, kv_capacity=4096, backend=backend, on_step=watch)
    assert res.error is None, res.error
    for r in TRACE:
        assert backend.tokens[r.id] == references[r.id], (policy, r.id)
    spec = res.speculative
    # drafts were verified and some accepted, not all: rows of one pass accepted different numbers
    assert spec is not None and 0 < spec["accepted_tokens"] < spec["draft_tokens"] and watch.rows > 0
    assert backend.stats["accepted_tokens"] == spec["accepted_tokens"]


def test_preemption_and_eos_keep_the_tokens_exact(micro, references):
    # a KV too small for everyone at once: vllm preempts and recomputes, rows verify drafts
    backend = MLXBackend(micro)
    pol = Speculative(make_policy("vllm", {"max_num_batched_tokens": 64}), k=4)
    res = run_replica(TRACE, pol, NO_COST, kv_capacity=160, block_size=16, backend=backend, on_step=CacheWatch(backend))
    assert res.error is None, res.error
    assert sum(r.preemptions for r in res.requests) > 0 and res.speculative["accepted_tokens"] > 0
    for r in TRACE:
        assert backend.tokens[r.id] == references[r.id], r.id
    # a stop among the tokens one verify accepts (a client's stop string, as an EOS is): the
    # output ends at that token, the rest of the chunk is never handed out
    first = run_replica(
        TRACE[:2], Speculative(make_policy("unified"), k=4), NO_COST, kv_capacity=4096, backend=MLXBackend(micro)
    )
    times, toks = first.requests[0].token_times, references["a"]
    j = next(j for j in range(1, len(toks) - 1) if times[j - 1] < times[j] == times[j + 1])  # a chunk's first
    backend = MLXBackend(micro)
    backend.on_token = lambda rid, token: rid == "a" and len(backend.tokens["a"]) == j + 1
    res = run_replica(TRACE[:2], Speculative(make_policy("unified"), k=4), NO_COST, kv_capacity=4096, backend=backend)
    assert res.error is None and backend.tokens["a"] == toks[: j + 1] and res.requests[0].output_tokens == j + 1
    assert backend.tokens["b"] == references["b"]


# contexts far past micro-gemma3's 16-token window, and past 256 slots: the sliding layers'
# batch cuts the positions no row can see again while rows verify drafts
LONG = [
    Request("a", 0.0, 300, 40),
    Request("b", 0.0, 9, 300),
    Request("c", 0.0, 270, 1),
    Request("d", 0.01, 25, 40),
    Request("e", 0.3, 290, 30),
]


@pytest.fixture(scope="module")
def micro_gemma3():
    info = load_model("micro-gemma3")
    refs = {
        r.id: reference_tokens(info, prompt_ids(0, r.id, r.prompt_tokens, info.vocab_size), r.output_tokens)
        for r in LONG
    }
    return info, refs


class WindowWatch(CacheWatch):
    """CacheWatch, and what the first sliding layer keeps: the slots of its batch (``_idx``) and
    the rows whose context is longer than that (their first positions cut)."""

    def __init__(self, backend):
        super().__init__(backend)
        self.kinds, self.slots, self.cut_rows = set(), 0, 0

    def __call__(self, state):
        super().__call__(state)
        b = self.backend
        if b._batch:
            c = b._batch[0]
            self.kinds.add(type(c).__name__)
            if type(c) is WindowBatchKVCache:
                self.slots = max(self.slots, c._idx)
                self.cut_rows += sum(b._kv[rid] > c._idx for rid in b._rows)


@pytest.mark.parametrize("policy", ["mlx-default", "unified", "vllm"])
def test_a_sliding_window_model_verifies_drafts_with_the_references_tokens(micro_gemma3, policy):
    info, refs = micro_gemma3
    backend = MLXBackend(info)
    watch = WindowWatch(backend)
    res = run_replica(
        LONG, Speculative(make_policy(policy), k=3), NO_COST, kv_capacity=4096, backend=backend, on_step=watch
    )
    assert res.error is None, res.error
    for r in LONG:
        assert backend.tokens[r.id] == refs[r.id], (policy, r.id)
    assert 0 < res.speculative["accepted_tokens"] < res.speculative["draft_tokens"]
    # the sliding layers roll back as plain slots, cut to the window: rows past 256 + 16 tokens
    # lost their first positions, and no layer held more than the window, a step and k (not the
    # 340 positions of the longest row)
    assert "WindowBatchKVCache" in watch.kinds and watch.cut_rows > 0 and watch.slots <= 16 + 256 + 3


def test_a_rotating_batch_turns_into_a_window_batch_when_drafts_start(micro_gemma3):
    """A sampled row verifies nothing, so the batch decodes as mlx-lm's rotating one until it
    leaves; then the greedy row's drafts turn the batch (rotated past its window) into a
    ``WindowBatchKVCache`` mid-run, and its tokens stay the model's alone."""
    info, refs = micro_gemma3
    backend = MLXBackend(info)
    backend.request_sampling["s"] = parse_sampling("temperature=0.8,seed=1")
    watch = WindowWatch(backend)
    trace = [Request("d", 0.0, 25, 40), Request("s", 0.0, 30, 12)]
    res = run_replica(
        trace, Speculative(make_policy("unified"), k=3), NO_COST, kv_capacity=4096, backend=backend, on_step=watch
    )
    assert res.error is None, res.error
    assert watch.kinds == {"BatchRotatingKVCache", "WindowBatchKVCache"}
    assert backend.tokens["d"] == refs["d"] and res.speculative["draft_tokens"] > 0


def test_a_model_whose_cache_cannot_roll_back_refuses_in_one_line():
    info = load_model("micro-qwen3_5")
    with pytest.raises(EngineError, match="cannot do: run it without --speculative") as err:
        run_replica(
            [Request("q", 0.0, 8, 12)], Speculative(make_policy("unified"), k=2), NO_COST, kv_capacity=4096,
            backend=MLXBackend(info),
        )  # fmt: skip
    assert "\n" not in str(err.value)


def test_the_copy_workload_asks_for_its_prompts_lines_and_counts_them():
    from schedlab import traces
    from schedlab.engine.tokenizer import preset_tokenizer

    tok = preset_tokenizer()
    tr = traces.load("copy:n=3,lines=2,rate=2", tokenizer=tok)
    lines = traces.sonnet_lines()
    for r in tr.requests:
        text = r.messages[0][1]
        quote = text.split("\n\n", 1)[1]
        assert quote in "".join(lines) and quote.count("\n") == 2  # two consecutive lines of the file
        assert r.output_tokens == len(tok.encode(quote.rstrip("\n")))
    assert len({r.messages for r in tr.requests}) == 3 and tr.requests[1].arrival_s > 0
    with pytest.raises(traces.TraceError, match="copy: lines must be an integer >= 1"):
        traces.load("copy:lines=0", tokenizer=tok)


def test_serve_speculates_the_model_alones_answer_and_counts_it_on_metrics(tmp_path):
    """``serve --speculative`` on SmolLM2, driven by the openai SDK: a copy-heavy chat's answer is
    the text the model gives alone without speculation (greedy: the engine in this process, no
    drafts), and /metrics counts the drafts as vLLM's spec-decode counters do."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from test_server import MODEL, Served, needs_wheel

    needs_wheel()
    ask = (
        "Repeat the following lines exactly:\n\n"
        "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate."
    )
    served = Served(["--policy", "unified", "--max-tokens", "32", "--speculative", "ngram:k=3"], tmp_path / "spec")
    try:
        out = served.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=32, temperature=0
        )
        text = httpx.get(served.url + "/metrics", timeout=30).text
    finally:
        served.stop()
    counts = {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("vllm:spec_decode") and "position" not in s.labels
    }
    assert 0 < counts["vllm:spec_decode_num_accepted_tokens_total"] <= counts["vllm:spec_decode_num_draft_tokens_total"]
    info = load_model(MODEL)
    alone = MLXBackend(info)
    from schedlab.engine.tokenizer import preset_tokenizer
    from schedlab.traces.datasets import _Counter

    req = Request("alone", 0.0, _Counter(preset_tokenizer())(ask), 32, messages=(("user", ask),))
    res = run_replica([req], make_policy("unified"), NO_COST, kv_capacity=4096, backend=alone)
    assert res.error is None and res.speculative is None
    said = [t for t in alone.tokens["alone"] if t not in set(info.eos_token_ids or ())]  # (the EOS is not text)
    assert out.choices[0].message.content == info.tokenizer.decode(said).strip()
