"""What ``validate`` says, on planted numbers (no MLX: the real runs here are simulations of a
machine slower or faster than the cost model, their steps' measured seconds planted).

- The headline is the plain simulation as a prediction: each real run held out against the
  others' median, beside a real run's own error there (the machine's repeat error).
- The drift adjustment is applied only where the machine's measured speed explains the real
  steps' bias in direction; otherwise it says so and simulates nothing.
"""

from __future__ import annotations

import pytest

from schedlab import traces
from schedlab.analysis.validation import compare, format_table
from schedlab.api._validation import drift_adjusted, drift_explains
from schedlab.policies import make_policy
from schedlab.sim import run, summarize
from schedlab.sim.cost import LinearCostModel, ScaledCostModel
from schedlab.sim.profiles import resolve_profile


def test_drift_explains_only_a_bias_in_the_same_direction():
    assert drift_explains(1.2, 1.1) and drift_explains(0.9, 0.95)
    assert not drift_explains(0.94, 1.16)  # the machine ran faster, the steps slower: not drift
    assert not drift_explains(1.1, 0.9) and not drift_explains(1.0, 1.2) and not drift_explains(1.1, None)


@pytest.fixture(scope="module")
def setting():
    cost = LinearCostModel.from_profile(resolve_profile(None))
    tr = traces.load("real-smoke")
    return cost, tr


def _real(setting, slow: float):
    """A 'real run': the simulation with every step measured at ``slow`` x its prediction."""
    cost, tr = setting
    res = run(tr.requests, make_policy("unified"), cost, kv_capacity=4096, trace_name=tr.name)
    steps = [s._replace(measured_s=s.predicted_s * slow) for s in res.steps]
    return summarize(res), steps


@pytest.mark.parametrize(
    "machine, steps_slow, applied",
    [(1.15, 1.10, True), (0.90, 0.92, True), (0.94, 1.16, False), (1.10, 0.95, False)],
)
def test_the_drift_adjustment_needs_the_machines_speed_to_explain_the_bias(setting, machine, steps_slow, applied):
    cost, tr = setting
    summary, steps = _real(setting, steps_slow)
    speed = {"before": {"ratio": machine}, "after": {"ratio": machine}}
    adj = drift_adjusted(make_policy("unified"), tr, cost, 4096, speed, [summary], steps)
    assert adj["applied"] is applied
    assert adj["speed_factor"] == pytest.approx(machine) and adj["step_ratio"] == pytest.approx(steps_slow)
    assert ("median_abs_error_pct" in adj) is applied
    v = compare(summary, [summary], policy="unified", trace=tr.name, real_steps=steps)
    v["drift_adjusted"] = adj
    text = format_table(v)
    if applied:
        assert "drift-adjusted (" in text and "not applied" not in text
        # the simulation scaled by the machine's speed: its inter-token latency moved by that factor
        assert adj["error_pct"]["itl_ms.p50"] == pytest.approx(100 * (machine - 1), abs=2)
    else:
        assert f"drift adjustment not applied: the machine ran at x{machine:.2f}" in text
        assert f"the steps took x{steps_slow:.2f}" in text and "drift-adjusted (" not in text


def test_the_headline_is_the_held_out_prediction_beside_the_machines_repeat_error(setting):
    cost, tr = setting
    summary, steps = _real(setting, 1.0)
    faster = summarize(run(tr.requests, make_policy("unified"), ScaledCostModel(cost, 0.9), kv_capacity=4096))
    reals = [summary, summary, faster]
    v = compare(summary, reals, policy="unified", trace=tr.name, real_steps=steps)
    lines = format_table(v).splitlines()
    h = v["hold_one_out"]
    assert lines[1].startswith("prediction, each real run held out against the others' median")
    assert (
        f"off by {h['sim_median_pct']:.1f} %" in lines[1] and f"a real run by {h['real_median_pct']:.1f} %" in lines[1]
    )
    assert lines[1].endswith(
        "within the machine's own repeat error"
        if h["sim_median_pct"] <= h["real_median_pct"]
        else f"{h['sim_median_pct'] / h['real_median_pct']:.1f}x the machine's own repeat error"
    )
    # one real run: no held-out line, the table comes first
    one = format_table(compare(summary, [summary], policy="unified", trace=tr.name)).splitlines()
    assert one[1].startswith("metric")
