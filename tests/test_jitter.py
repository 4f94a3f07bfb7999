"""Step jitter (sim.jitter): the spread of real step times around the cost model, carried by a
profile fitted from real runs and drawn by the simulator; totals stay the model's."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from schedlab.policies import make_policy
from schedlab.sim import run, summarize
from schedlab.sim.backend import SimBackend
from schedlab.sim.cost import LinearCostModel
from schedlab.sim.jitter import JitterError, StepJitter
from simkit import KNOWN
from schedlab.traces.schema import Request

from test_fidelity import synthetic_runs

PROFILE = Path(__file__).resolve().parents[1] / "sim" / "profiles" / "tiny-cpu.json"


def skewed(n: int = 4000, seed: int = 1) -> list[float]:
    """A fifth of the steps 1.5x, the rest within 2 % of 1: mean 1.1, median 1.0."""
    rng = random.Random(seed)
    return [(1.5 if rng.random() < 0.2 else 1.0) * (1 + rng.uniform(-0.02, 0.02)) for _ in range(n)]


def test_jitter_from_ratios_keeps_their_shape_rescaled_to_mean_one():
    j = StepJitter.from_ratios(skewed())
    assert j.steps == 4000
    assert j.mean() == pytest.approx(1.0, abs=1e-9)
    assert j.quantile(0.5) == pytest.approx(1.0 / 1.1, rel=0.02)  # the typical step: below the mean
    assert j.quantile(0.95) == pytest.approx(1.5 / 1.1, rel=0.02)  # the slow fifth: above it
    draws = [j.sampler(3)() for _ in range(3)]
    assert len(set(draws)) == 1  # a fresh sampler of one seed starts at the same draw
    s = j.sampler(5)
    many = [s() for _ in range(40000)]
    assert statistics.fmean(many) == pytest.approx(1.0, abs=0.01)
    assert sorted(many)[int(0.9 * len(many))] == pytest.approx(j.quantile(0.9), rel=0.02)
    back = StepJitter.from_dict(j.to_dict())
    assert back.steps == j.steps and back.quantiles == pytest.approx(j.quantiles, rel=1e-5)
    assert back.mean() == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("make", [
    lambda: StepJitter.from_ratios([1.0] * 10),  # too few steps
    lambda: StepJitter.from_ratios([0.0, -1.0, float("nan")] * 100),  # none usable
    lambda: StepJitter((1.2, 0.8)),  # decreasing
    lambda: StepJitter((1.0, 2.0)),  # mean 1.5
    lambda: StepJitter((1.0,)),
    lambda: StepJitter.from_dict({"quantiles": "1,2"}),
    lambda: StepJitter.from_dict({"quantiles": [1.0, True]}),
    lambda: StepJitter.from_dict({"quantiles": [0.0, 0.0]}),
    lambda: StepJitter.from_dict([1.0, 2.0]),
])
def test_bad_jitter_is_refused(make):
    with pytest.raises(JitterError):
        make()


def test_a_jittered_simulation_keeps_the_total_and_takes_the_spread_per_step():
    """One long request decoding alone, every step alike: with jitter its ITL percentiles are the
    jitter's own quantiles, the makespan stays the model's; the draws follow the seed; without
    jitter nothing changes. A busy real trace (steps of every shape, pass by pass): the typical
    step drops below the model's mean, the total stays. (Where the ITL tail is a policy's big
    prefill steps, as here, it need not grow: most of them draw below 1 too.)"""
    from schedlab import traces

    j = StepJitter.from_ratios(skewed())
    one = [Request(id="r0", arrival_s=0.0, prompt_tokens=32, output_tokens=3000)]

    def sim(reqs, backend=None, policy="mlx-default"):
        res = run(reqs, make_policy(policy), cost, kv_capacity=200_000, backend=backend)
        assert res.error is None
        out = summarize(res)
        out.pop("wall_s")  # the simulator's own time
        return out

    cost = LinearCostModel({"d_pass": 0.004, "p_pass": 0.01})  # every decode step alike: ITL = its draws
    plain = sim(one)
    jit = sim(one, SimBackend(cost, jitter=j, seed=0))
    assert plain == sim(one, SimBackend(cost))  # no jitter: the plain simulation exactly
    assert jit["itl_ms"]["p50"] / plain["itl_ms"]["p50"] == pytest.approx(j.quantile(0.5), rel=0.03)
    assert jit["itl_ms"]["p99"] / plain["itl_ms"]["p99"] == pytest.approx(j.quantile(0.99), rel=0.05)
    assert jit["makespan_s"] == pytest.approx(plain["makespan_s"], rel=0.02)
    assert sim(one, SimBackend(cost, jitter=j, seed=0)) == jit  # seeded
    assert sim(one, SimBackend(cost, jitter=j, seed=1))["itl_ms"]["p50"] != jit["itl_ms"]["p50"]

    cost = LinearCostModel.from_profile(PROFILE)
    tr = traces.load("real-mixed")
    plain = sim(tr.requests, policy="chunked-prefill")
    jit = sim(tr.requests, SimBackend(cost, jitter=j, seed=0), policy="chunked-prefill")
    assert jit["itl_ms"]["p50"] < 0.97 * plain["itl_ms"]["p50"]
    assert jit["makespan_s"] == pytest.approx(plain["makespan_s"], rel=0.02)


def test_a_fit_from_runs_measures_the_steps_spread_around_it():
    from schedlab.analysis.runfit import fit_runs, step_jitter

    runs = synthetic_runs(KNOWN, noise=0.02, seed=7, slow=(0.2, 1.5))
    fit = fit_runs(runs)
    j = step_jitter(runs, fit.coefficients)
    assert j.steps == sum(r.n for r in runs)
    assert j.quantile(0.5) == pytest.approx(1.0 / 1.1, rel=0.03)
    assert j.quantile(0.95) == pytest.approx(1.5 / 1.1, rel=0.03)
    # steps with no spread: the jitter is (nearly) none
    flat = step_jitter(synthetic_runs(KNOWN, noise=0.0, seed=7), fit_runs(synthetic_runs(KNOWN, noise=0.0, seed=7))
                       .coefficients)
    assert flat.quantile(0.01) == pytest.approx(1.0, abs=0.01) and flat.quantile(0.99) == pytest.approx(1.0, abs=0.01)
    assert step_jitter(synthetic_runs(KNOWN, n_runs=1, steps=20), fit.coefficients) is None  # too few steps
