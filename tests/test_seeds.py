"""The seeds' simulated headlines, recomputed at HEAD (``bench/seeds.py``): the figures
docs/seeds.md quotes from bench/results/seeds.json are what the code gives now, and the behaviour
each seed claims holds in them."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def seeds():
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("seeds")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def seed000(seeds):
    return seeds.seed000()


def test_seed000_recorded_figures_are_todays(seed000):
    recorded = json.loads((BENCH / "results" / "seeds.json").read_text())["seed000"]
    assert seed000["simulated"] == recorded["simulated"]
    assert seed000["sensitivity_3x32768"] == recorded["sensitivity_3x32768"]
    assert seed000["published"] == recorded["published"] and seed000["setup"]["kv_tokens"] > 0


def test_seed000_victims_starve_without_the_flag_and_decode_together_with_it(seed000):
    """At every published N >= 2 (streams arriving apart): without the flag the first stream decodes
    at under a fifth of the last one's rate; with it every stream at one rate, and the mean per-request
    decode rises. A single stream: the flag changes nothing. Two streams prefilled together: no
    victim either way (the PR's N = 2 rows)."""
    rows = seed000["simulated"]
    for key in ("2x8192", "3x8192", "4x8192", "2x32768", "3x32768"):
        off, on = rows[key]["off"], rows[key]["on"]
        assert off["per_decode"][0] < 0.2 * off["fastest"], key
        assert max(on["per_decode"]) - min(on["per_decode"]) <= 0.005 * max(on["per_decode"]), key
        assert rows[key]["per_decode_speedup"] > 1.5, key
    for key in ("1x1024", "1x4096", "2x8192_together"):
        assert rows[key]["off"]["per_decode"] == rows[key]["on"]["per_decode"], key
    together = rows["2x8192_together"]["off"]["per_decode"]
    assert together[0] == together[1]


def test_seed001_recorded_figures_are_todays_and_continuous_batching_answers_first(seeds):
    """Seed 001: static batch_generate returns the whole batch at once; continuous batching gives
    every concurrency a first token several times sooner, its throughput rising with concurrency
    up to static's at 8 streams."""
    got = seeds.seed001()
    recorded = json.loads((BENCH / "results" / "seeds.json").read_text())["seed001"]
    assert got == recorded
    static = got["static"]
    cont = got["continuous"]
    for c in ("1", "2", "4", "8"):
        assert cont[c]["ttft_p50_s"] < static["ttft_whole_s"] / 2.5, c
    tput = [cont[c]["throughput_tok_s"] for c in ("1", "2", "4", "8")]
    assert tput == sorted(tput) and tput[-1] == pytest.approx(static["throughput_tok_s"], rel=0.05)
