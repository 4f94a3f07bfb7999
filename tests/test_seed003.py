"""Seed 003 (slot recycling) on the real engine: ``slots`` with B slots serving N > B requests that
all arrive at once, with varied prompts and caps, so a queued request is admitted mid-stream into the
slot a finished one frees; every request's greedy stream equals that request run alone, and a
half-full batch gives the same streams as a full one. ``bench/seeds.py``'s ``seed003_real`` at a
small scale (SmolLM2-135M on the CPU: short prompts, caps of 3-6 tokens), and the recorded run's
figures (``bench/results/seeds.json``, which docs/seeds.md quotes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import schedlab
from schedlab.traces import Request, Trace

BENCH = Path(__file__).resolve().parents[1] / "bench"
SMALL = {
    "model": "smollm2-135m",
    "cases": [[2, 4], [4, 4]],
    "caps": [3, 6, 4, 5],
    "prompt_lines": [1, 3, 2, 1],
    "half_full": [4, 2],
}


@pytest.fixture(scope="module")
def small(seeds):
    # (slots reads no cost model: the profile is whichever is at hand, its warning unheard)
    engine = schedlab.load_engine(
        model="smollm2-135m", ignore_eos=True, no_calibrate=True, log=lambda kind, message: None
    )
    return seeds.seed003_real(SMALL, engine=engine)


@pytest.mark.slow
def test_every_stream_under_slot_recycling_equals_the_request_alone(small):
    """B=2, N=4: the two requests queued behind the first two are admitted while another decodes, and
    every request's tokens are the ones it gives alone (which are the model's alone, and differ
    between requests, so a stream given to the wrong request or a slot's stale cache shows)."""
    case = small["cases"]["B=2,N=4"]
    assert case["caps"] == SMALL["caps"] and len(set(case["prompt_tokens"])) == 4
    assert case["admits"] == 4 and case["mid_stream"] == 2 and case["admitted_mid_stream"] == ["s2", "s3"]
    assert case["streams_equal_reference"] == 4 and case["all_equal"]
    assert case["tokens_compared"] == sum(SMALL["caps"])
    assert case["simulated"] == {"admits": 4, "mid_stream": 2}
    assert small["alone_equals_model_alone"] and small["distinct_references"] == 4
    full = small["cases"]["B=4,N=4"]  # as many slots as requests: nobody waits for a slot
    assert full["admits"] == 4 and full["mid_stream"] == 0 and full["all_equal"]


@pytest.mark.slow
def test_a_half_full_batch_gives_the_full_batchs_streams(small):
    assert small["half_full"] == {"n_slots": 4, "requests": 2, "equal_full_batch": True, "equal_reference": True}


def test_mid_stream_admits_are_told_from_the_passes(seeds):
    """The count has teeth: slots recycles a freed slot while the others decode (N - B mid-stream
    admits); static batching with as many rows admits only when its whole batch is done (none)."""
    reqs = [Request(f"s{i}", 0.0, 16 + 9 * i, cap) for i, cap in enumerate(seeds.REAL003["caps"])]
    trace = Trace("seed003-sim", "", reqs)
    for b in (3, 4):
        slots = seeds.admissions(schedlab.simulate("slots", trace, options={"n_slots": b}))
        static = seeds.admissions(schedlab.simulate("static", trace, options={"batch_size": b}))
        assert len(slots) == len(static) == len(reqs)
        assert sum(slots.values()) == len(reqs) - b and not any(list(slots.values())[:b])
        assert sum(static.values()) == 0


def test_recorded_seed003_real_is_reference_exact_with_the_published_admits():
    """The recorded run (``python bench/seeds.py --real``) docs/seeds.md quotes: B=3 N=6 and B=4 N=8
    admit every request, N - B of them mid-stream, as the PR's runs did; every stream equals its
    reference; the simulator admits the same way; the half-full batch equals the full one."""
    rec = json.loads((BENCH / "results" / "seeds.json").read_text())["seed003_real"]
    assert sorted(rec["cases"]) == sorted(rec["published"]) == [f"B={b},N={n}" for b, n in rec["setup"]["cases"]]
    for b, n in rec["setup"]["cases"]:
        case, pub = rec["cases"][f"B={b},N={n}"], rec["published"][f"B={b},N={n}"]
        assert (case["admits"], case["mid_stream"]) == (pub["admits"], pub["mid_stream"]) == (n, n - b)
        assert case["admitted_mid_stream"] == [f"s{i}" for i in range(b, n)]
        assert case["all_equal"] and case["streams_equal_reference"] == n
        assert case["simulated"] == {"admits": case["admits"], "mid_stream": case["mid_stream"]}
        assert min(case["caps"]) == 12 and max(case["caps"]) == 39
    assert rec["alone_equals_model_alone"] and rec["distinct_references"] == len(rec["setup"]["caps"])
    assert rec["half_full"]["equal_full_batch"] and rec["half_full"]["equal_reference"]
