"""The real engine under the serving features: the ``vllm`` policy preempting under a small KV
budget, prefix caching (a cached prefix's keys/values copied into a new request's cache),
closed-loop clients on the wall clock -- greedy tokens still equal each request's
single-sequence reference (``micro`` preset, real MLX on CPU)."""

from __future__ import annotations
from simkit import command

import json
import subprocess
import sys
from pathlib import Path

import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab.engine.backend import MLXBackend, reference_tokens
from schedlab.engine.models import load_model
from schedlab.engine.sampling import prompt_ids

from schedlab.policies import make_policy
from schedlab.sim import run_replica, summarize
from schedlab.sim.cost import LinearCostModel
from schedlab.sim.sources import ClientSource
from test_engine import trace
from schedlab.traces.schema import Request

NO_COST = LinearCostModel({})
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def micro():
    return load_model("micro")


def ref(model, r: Request) -> list[int]:
    return reference_tokens(
        model, prompt_ids(0, r.id, r.prompt_tokens, model.vocab_size, r.prefix_ids), r.output_tokens
    )


@pytest.fixture(scope="module")
def references(micro):
    return {r.id: ref(micro, r) for r in trace()}


def shared_trace() -> list[Request]:
    """Prompts sharing one or two 512-token blocks (Mooncake-style prefix ids), arriving while
    others run, some whole-block aligned (hit = prompt - 16), some one token long past it."""
    rows = [
        ("s0", 0.0, 700, 12, (11,)),
        ("s1", 0.0, 530, 6, (11,)),
        ("s2", 0.03, 1100, 9, (11, 22)),
        ("s3", 0.05, 1024, 5, (11, 22)),
        ("s4", 0.08, 513, 7, (11,)),
        ("s5", 0.1, 900, 10, (33,)),
        ("s6", 0.12, 1200, 4, (11, 22, 44)),
        ("s7", 0.14, 640, 8, (33,)),
    ]
    return [Request(rid, t, p, o, pid) for rid, t, p, o, pid in rows]


@pytest.fixture(scope="module")
def shared_references(micro):
    return {r.id: ref(micro, r) for r in shared_trace()}


def run_real(model, policy, requests, kv=100_000, **kw):
    backend = MLXBackend(model)
    result = run_replica(requests, policy, NO_COST, kv_capacity=kv, backend=backend, **kw)
    assert result.error is None, result.error
    return result, backend


def assert_exact(backend, refs, requests):
    for r in requests:
        assert backend.tokens[r.id] == refs[r.id], f"request {r.id} differs from its reference"


@pytest.mark.parametrize("kv,batch", [(640, 64), (512, 48), (400, 200)])
def test_vllm_preempts_under_a_small_kv_and_tokens_equal_references(micro, references, kv, batch):
    """Acceptance: a small trace with a KV budget that forces preemption on the real engine."""
    result, backend = run_real(
        micro, make_policy("vllm", {"max_num_batched_tokens": str(batch)}), trace(), kv=kv, block_size=16
    )
    s = summarize(result)
    assert s["preemptions"] > 0 and s["recomputed_tokens"] > 0
    assert backend.stats["preemptions"] == s["preemptions"]
    assert_exact(backend, references, trace())
    assert all(r.finish_s is not None for r in result.requests)
    assert backend.batch_rows == [] and not any(backend.holds(r.id) for r in result.requests)


def test_vllm_without_pressure_equals_its_references_too(micro, references):
    result, backend = run_real(
        micro, make_policy("vllm", {"max_num_batched_tokens": "40", "max_num_seqs": "4"}), trace(), block_size=16
    )
    assert "preemptions" not in summarize(result)
    assert_exact(backend, references, trace())


@pytest.mark.parametrize(
    "name,options",
    [
        ("vllm", {"max_num_batched_tokens": "256"}),
        ("unified", {"token_budget": "300"}),
        ("mlx-default", {"prefill_step_size": "200", "prefill_batch_size": "3"}),  # padded rows at other contexts
        ("static", {"batch_size": "3"}),
        ("slots", {"n_slots": "2"}),
    ],
)
@pytest.mark.slow
def test_prefix_caching_copies_cached_kv_and_tokens_stay_exact(micro, shared_references, name, options):
    reqs = shared_trace()
    off, b_off = run_real(micro, make_policy(name, options), reqs, block_size=16)
    on, b_on = run_real(micro, make_policy(name, options), reqs, block_size=16, prefix_caching=True)
    assert_exact(b_off, shared_references, reqs)
    assert_exact(b_on, shared_references, reqs)
    pc = summarize(on)["prefix_cache"]
    assert pc["prompt_tokens_hit"] > 2000
    # the engine computed exactly the tokens the cache did not give
    assert b_on.stats["prefill_tokens"] == b_off.stats["prefill_tokens"] - pc["saved_prefill_tokens"]
    assert b_on.stats["cached_tokens_loaded"] == pc["saved_prefill_tokens"]
    assert all(not b_on.holds(r.id) for r in on.requests) and b_on.batch_rows == []


def test_preemption_with_prefix_caching_resumes_from_its_own_cached_kv(micro, references):
    pol = make_policy("vllm", {"max_num_batched_tokens": "64"})
    result, backend = run_real(micro, pol, trace(), kv=640, block_size=16, prefix_caching=True)
    s = summarize(result)
    assert s["preemptions"] > 0 and s["prefix_cache"]["saved_prefill_tokens"] > 0
    assert backend.stats["cached_tokens_loaded"] == s["prefix_cache"]["saved_prefill_tokens"]
    assert_exact(backend, references, trace())


def test_a_copied_block_is_checked_against_its_owner(micro):
    """The engine refuses a cached block whose owner's tokens differ (a wrong hash)."""
    from schedlab.engine.backend import EngineStateError

    reqs = [Request("x", 0.0, 600, 3, (5,)), Request("y", 0.5, 600, 3, (5,))]
    backend = MLXBackend(micro)
    seq = {}

    orig = backend._ids

    def lying_ids(r):  # y's prompt is not what its prefix ids promise
        ids = orig(r)
        if r.id == "y" and "y" not in seq:
            ids[3] = (ids[3] + 1) % micro.vocab_size
            seq["y"] = True
        return ids

    backend._ids = lying_ids
    with pytest.raises(EngineStateError, match="differ from those of request x"):
        run_replica(
            reqs, make_policy("vllm"), NO_COST, kv_capacity=100_000, backend=backend, block_size=16, prefix_caching=True
        )


def test_closed_loop_clients_on_the_real_engine(micro, references):
    result, backend = run_real(
        micro, make_policy("vllm", {"max_num_batched_tokens": "128"}), ClientSource(trace(), 2), block_size=16
    )
    s = summarize(result)
    assert s["clients"]["peak_concurrency"] == 2
    assert_exact(backend, references, trace())


@pytest.mark.slow
def test_run_real_cli_with_prefix_caching_computes_only_what_is_not_cached(tmp_path):
    """run-real on a shared-prefix trace: with prefix caching the engine computes a fifth of the
    prompt tokens it computes without (every token checked by the engine); the summary reports the
    hit rate. (What that does to TTFT is a timing, measured by the benches, not asserted here.)"""
    reqs = [Request(f"q{i}", 0.15 * i, 1536 + 16 * (i % 5), 4, (101, 202, 303)) for i in range(10)]
    path = tmp_path / "shared.json"
    path.write_text(json.dumps({"name": "shared", "requests": [r.to_json() for r in reqs]}))
    out = {}
    for flag in ([], ["--prefix-caching"]):
        d = tmp_path / ("on" if flag else "off")
        proc = subprocess.run(
            [
                *command("run-real"),
                "--policy",
                "vllm",
                "--trace",
                str(path),
                "--model",
                "micro",
                "--no-calibrate",
                "--kv-tokens",
                "40000",
                "--out",
                str(d),
                "-q",
                *flag,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        out[bool(flag)] = (json.loads((d / "summary.json").read_text()), json.loads((d / "meta.json").read_text()))
    (on, meta_on), (off, meta_off) = out[True], out[False]
    assert on["prefix_cache"]["hit_rate"] > 0.8 and "prefix_cache" not in off
    assert meta_on["engine"]["prefill_tokens"] < 0.2 * meta_off["engine"]["prefill_tokens"]
