"""What ``validate`` says, on planted numbers (no MLX: the real runs here are simulations of a
machine slower or faster than the cost model, their steps' measured seconds planted).

- The headline is the plain simulation as a prediction: each real run held out against the
  others' median, beside a real run's own error there (the machine's repeat error).
- The drift adjustment is applied only where the machine's measured speed explains the real
  steps' bias in direction; otherwise it says so and simulates nothing.
- Each step kind's time is split into its passes and the loop's own work, each against its
  prediction: a cost planted in one part shows in that part only.
"""

from __future__ import annotations

import pytest

from schedlab import traces
from schedlab.analysis.validation import compare, format_table
from schedlab.api._validation import drift_adjusted, drift_explains
from schedlab.policies import make_policy
from schedlab.sim import run_replica, summarize
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
    res = run_replica(tr.requests, make_policy("unified"), cost, kv_capacity=4096, trace_name=tr.name)
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
    faster = summarize(run_replica(tr.requests, make_policy("unified"), ScaledCostModel(cost, 0.9), kv_capacity=4096))
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


def test_a_planted_loop_cost_shows_in_the_loop_part_and_only_there():
    import numpy as np
    from simkit import KNOWN
    from test_runfit import synthetic_runs

    from schedlab.analysis.residuals import format_step_split, step_kinds, step_split
    from schedlab.analysis.runfit import predict

    # the real steps' loop costs 4x what the profile says (s_step); their passes are as predicted
    cols = synthetic_runs({**KNOWN, "s_step": 0.002}, n_runs=1, noise=0.0)[0].cols
    cols["prefill_chunks"] = (cols["prefill_tokens"] > 0).astype(float)
    cols["predicted_s"] = predict(KNOWN, cols)  # what the run planned with
    rows = step_split(cols, KNOWN)
    kinds = {r["kind"]: r for r in rows}
    assert {"decode n", "batch change, decode n", "prefill", "after idle, prefill"} <= set(kinds)
    assert sum(r["n"] for r in rows) == len(cols["measured_s"])
    for r in rows:
        assert r["passes"]["ratio"] == pytest.approx(1.0), r
        assert r["loop"]["ratio"] > 3.0, r  # (0.002 + s_row x rows) / (0.0005 + s_row x rows)
        loop_pred = KNOWN["s_step"] + KNOWN["s_row"] * (cols["decode_rows"] + cols["prefill_chunks"])
        assert r["loop"]["predicted_ms"] == pytest.approx(1e3 * np.median(loop_pred[step_kinds(cols) == r["kind"]]))
        assert 1.0 < r["ratio"] < r["loop"]["ratio"]
    # a prefill step's loop share is small: its whole-step ratio stays near 1
    assert kinds["after idle, prefill"]["ratio"] < kinds["decode n"]["ratio"]
    # a cold machine's after-idle cost is the passes': predicted there, both parts match
    truth = {**KNOWN, "i_step": 0.004, "i_gap": 0.003}
    cold = synthetic_runs(truth, n_runs=1, noise=0.0)[0].cols
    cold["prefill_chunks"] = (cold["prefill_tokens"] > 0).astype(float)
    cold["predicted_s"] = predict(truth, cold)
    split = {r["kind"]: r for r in step_split(cold, truth)}
    idle = split["after idle, prefill"]
    assert idle["passes"]["ratio"] == pytest.approx(1.0) and idle["loop"]["ratio"] == pytest.approx(1.0)
    assert idle["passes"]["predicted_ms"] > split["prefill"]["passes"]["predicted_ms"]
    # without the coefficients (an analytic model) only the measured parts are known
    bare = step_split(cols)
    assert all(r["passes"]["predicted_ms"] is None and r["loop"]["ratio"] is None for r in bare)
    text = format_step_split(rows, "title")
    assert text.splitlines()[0] == "title" and len(text.splitlines()) == len(rows) + 2
    assert "-" in format_step_split(bare).splitlines()[-1]


def test_the_drift_adjustment_per_run_simulates_each_run_at_the_speed_probed_around_it():
    """Two stand-in real runs on a machine 1.3x and 0.85x as slow as the cost model (the policy
    planning with the model, as a real run's does), each bracketed by probes that read its speed:
    each run simulated at its own probed speed matches it; the same speeds given to the wrong
    runs, or one speed for both, do not."""
    from schedlab.api._validation import run_factors
    from schedlab.sim.backend import SimBackend

    cost, tr = LinearCostModel.from_profile(resolve_profile(None)), traces.load("real-mixed")
    planted = [1.3, 0.85]
    reals, run_steps = [], []
    for f in planted:
        machine = LinearCostModel(dict(cost.coefficients), meta=cost.meta)  # a measured run's machine
        res = run_replica(
            tr.requests, make_policy("unified"), cost, kv_capacity=200_000, backend=SimBackend(machine, time_scale=f)
        )
        reals.append(summarize(res))
        run_steps.append(res.steps)
    probes = [{"ratio": 1.25}, {"ratio": 1.35}, {"ratio": 0.85}, None]
    assert run_factors(probes, [(0, 1), (1, 2)]) == pytest.approx([1.3, 1.1])
    assert run_factors(probes, [(2, 3)]) is None  # a probe missing: no per-run speed
    speed = {"before": {"ratio": 1.3}, "after": {"ratio": 0.85}}
    steps = [s for st in run_steps for s in st]

    def adjusted(factors):
        return drift_adjusted(make_policy("unified"), tr, cost, 200_000, speed, reals, steps, factors, run_steps)

    good = adjusted(planted)
    assert good["applied"] and good["speeds"] == pytest.approx(planted)
    assert good["max_abs_error_pct"] < 0.5, good["error_pct"]
    assert good["step_ratio_median"] == pytest.approx(1.0, abs=1e-6)
    h = good["hold_one_out"]
    assert h["sim_median_pct"] < 0.5 < h["real_median_pct"]  # each run predicted from the other's speed
    v = compare(reals[0], reals, policy="unified", trace=tr.name, real_steps=steps)
    v["drift_adjusted"] = good
    text = format_table(v)
    assert "one simulation per real run at its speed probed just before and after it, x0.85-1.30" in text
    assert f"measured/predicted {good['step_ratio_median']:.3f}" in text
    assert f"the simulations off by {h['sim_median_pct']:.1f} %" in text
    swapped = adjusted(planted[::-1])
    assert swapped["hold_one_out"]["sim_median_pct"] > 10 and swapped["step_ratio_median"] != pytest.approx(
        1.0, abs=0.05
    )
    one = drift_adjusted(make_policy("unified"), tr, cost, 200_000, speed, reals, steps)  # the mean, for both
    assert one["speed_factor"] == pytest.approx(1.075) and "hold_one_out" not in one
    assert one["max_abs_error_pct"] > 5 * good["max_abs_error_pct"]
    with pytest.raises(ValueError, match="one speed and one step list per real run"):
        adjusted(planted[:1])
