"""The fit from real runs' step logs (issue 13, 39), on synthetic step logs with planted costs: whole
runs held out, candidate terms kept only where they lower the held-out score, the mean step time
under slow spells, the residual table and bias; and the calibration replay's wakes. No MLX run:
these sit beside the engine's tests, not in their unit (tests/conftest.py)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from schedlab.policies import make_policy
from schedlab.policies.base import PassShape
from schedlab.sim import run_replica
from schedlab.sim.cost import LinearCostModel, idle_features, pass_features, step_features
from schedlab.sim.features import COLUMNS, STEP_TERMS, after_wake_column
from simkit import KNOWN


# ---------------------------------------------------------------------------- the fit


def synthetic_runs(
    truth: dict,
    n_runs: int = 4,
    steps: int = 400,
    noise: float = 0.02,
    seed: int = 0,
    slow: tuple[float, float] = (0.0, 1.0),
    first_wake_only: bool = False,
):
    """Step logs shaped like real runs (decode batches with joins and leaves, prefill chunks,
    arrivals to an idle replica), timed by ``truth`` (a linear model: planted terms included)
    with relative noise; ``slow``: (share, factor): that share of the steps, drawn at random,
    takes ``factor`` times as long (a machine's slow spells: step times skewed to the slow side).
    ``first_wake_only``: each run's first step is its one wake (a slow model's short replay)."""
    from schedlab.analysis.runfit import RunSteps

    cm = LinearCostModel(truth)
    runs = []
    for k in range(n_runs):
        rng = random.Random(seed * 100 + k)
        rows = []
        for j in range(steps):
            u = rng.random()
            idle_s = 0.0
            if (u < 0.15 and not first_wake_only) or (first_wake_only and j == 0):
                # an arrival to an idle replica: its prompt's chunk
                n, c = rng.choice((16, 64, 200, 500)), 0
                shape = PassShape(prefill=((n, c),), prefill_done=(True,))
                idle_s = rng.uniform(0.005, 2.0)
            elif u < 0.25:
                shape = PassShape(
                    prefill=((rng.randint(8, 512), rng.choice((0, 300))),), prefill_done=(rng.random() < 0.5,)
                )
            else:
                b = rng.randint(1, 24)
                ctx = tuple(rng.randint(40, 1200) for _ in range(b))
                joins = rng.choice((0, 0, 0, 1, 2, 4)) if b > 4 else 0
                leaves = rng.choice((0, 0, 0, 1, 2)) if b > 4 else 0
                shape = PassShape(decode_contexts=ctx, batch_rows_before=b - joins, joins=joins, leaves=leaves)
            rows.append((shape, idle_s))
        cols = {c: np.zeros(steps) for c in COLUMNS}
        cols["i_after"] = after_wake_column(np.array([1.0 if idle_s else 0.0 for _, idle_s in rows]))
        since = None  # steps since the last wake, as the loop counts them
        for j, (shape, idle_s) in enumerate(rows):
            since = 0 if idle_s else (None if since is None else since + 1)
            for key, v in pass_features(shape).items():
                cols[key][j] += v
            n_rows = len(shape.decode_contexts) + len(shape.prefill)
            for key, v in step_features(1, n_rows).items():
                cols[key][j] = v
            if idle_s:
                cols["after_idle"][j] = 1
                cols["idle_before_s"][j] = idle_s
                cols["wake_s"][j] = 2e-4
                for key, v in idle_features(idle_s).items():
                    cols[key][j] = v
            cols["decode_rows"][j] = len(shape.decode_contexts)
            cols["prefill_tokens"][j] = shape.prefill_tokens
            cols["joins"][j], cols["leaves"][j] = shape.joins, shape.leaves
            cols["passes"][j] = 1
            over = cm.step_overhead_seconds(1, n_rows)
            passes = cm.pass_seconds(shape) + (cm.idle_seconds(idle_s)[1] if idle_s else 0.0)
            passes += cm.after_wake_seconds(since) if since else 0.0
            f = (1 + rng.uniform(-noise, noise)) * (slow[1] if rng.random() < slow[0] else 1.0)
            cols["passes_s"][j] = passes * f
            cols["overhead_s"][j] = over * f
            cols["measured_s"][j] = (passes + over) * f
        cols["batch_changed"] = ((cols["joins"] + cols["leaves"]) > 0).astype(float)
        runs.append(RunSteps(f"run{k}", Path("."), {}, cols))
    return runs


@pytest.mark.slow
def test_a_fit_from_runs_recovers_planted_after_idle_and_join_costs():
    from schedlab.analysis.runfit import fit_runs, predict

    truth = {**KNOWN, "i_step": 0.004, "i_gap": 0.006, "c_join_row": 0.0008}
    runs = synthetic_runs(truth, noise=0.02)
    fit = fit_runs(runs)
    chosen = fit.report["chosen"]["terms"]
    assert {"i_step", "i_gap", "c_join_row"} <= set(chosen), fit.report["tries"]
    for k in ("i_step", "i_gap", "c_join_row"):
        assert fit.coefficients[k] == pytest.approx(truth[k], rel=0.2), k
    held = fit.report["held_out"]
    assert held["all"]["median_abs_pct"] < 2.5 and abs(held["all"]["total_pct"]) < 1.0
    assert held["after idle"]["median_abs_pct"] < 2.5 and held["join/leave"]["median_abs_pct"] < 2.5
    # each planted term was kept because the held-out score dropped without it: the base fit is worse
    base = [
        t
        for t in fit.report["tries"]
        if t["what"] == "base"
        and t["mode"] == fit.report["chosen"]["mode"]
        and t["balance"] == fit.report["chosen"]["balance"]
    ][0]
    assert base["score"] > fit.report["score"] + 1.0
    assert base["groups"]["after idle"] > 3 * held["after idle"]["median_abs_pct"]
    # the wake-up latency is measured, not fitted
    assert fit.coefficients["i_wake"] == pytest.approx(2e-4)
    # no planted effect: no candidate is kept
    clean = fit_runs(synthetic_runs(KNOWN, noise=0.02, seed=3))
    assert not {"i_step", "i_gap", "i_after", "c_join_row", "c_leave_row"} & set(clean.report["chosen"]["terms"])
    # predictions use the final coefficients exactly as the loop would
    p = predict(fit.coefficients, runs[0].cols)
    assert np.median(np.abs(p / runs[0].cols["measured_s"] - 1)) < 0.02


def test_a_fit_from_runs_tries_no_after_idle_term_on_a_few_wakes():
    """Runs whose only wake is their first step (a slow model's short replay: three steps in all)
    are too few to say what later wakes pay: the after-idle candidates are not tried (with the
    rule off, these three steps alone make the fit keep i_step), and no after-idle term is
    charged; with the same cost on many wakes the term is found."""
    from schedlab.analysis.runfit import IDLE_TERMS, MIN_WAKES, fit_runs

    truth = {**KNOWN, "i_step": 0.05}
    few = fit_runs(synthetic_runs(truth, n_runs=3, steps=150, noise=0.02, seed=7, first_wake_only=True))
    assert few.report["wakes"] == 3 < MIN_WAKES and few.report["idle_terms_tried"] is False
    assert not any(t["what"] in {f"+{k}" for k in IDLE_TERMS} for t in few.report["tries"])
    assert all(few.coefficients[k] == 0 for k in IDLE_TERMS)
    many = fit_runs(synthetic_runs(truth, n_runs=3, steps=150, noise=0.02, seed=7))
    assert many.report["wakes"] >= MIN_WAKES and many.report["idle_terms_tried"] is True
    assert many.coefficients["i_step"] == pytest.approx(0.05, rel=0.2)


def test_the_default_replay_ends_with_lone_requests_after_known_idle_gaps():
    """The calibration's replay trace gives the after-idle terms wakes of several lengths at any
    model speed: under a slow model's costs (a few requests in all) as under a fast one's, its
    last WAKE_TAIL requests each wake an idle replica after one of WAKE_GAPS_S, and the fit's
    minimum is reached by the three policies' replays together."""
    from schedlab.analysis.runfit import MIN_WAKES
    from schedlab.engine.calibrate import REPLAY_POLICIES, WAKE_GAPS_S, WAKE_SCALE_S, WAKE_TAIL, replay_trace

    # tiny-like passes, 20x slower (SmolLM2 on this machine), and a replay of 1 s (gaps 1/8 as long)
    for scale, seconds in ((1.0, 8.0), (20.0, 8.0), (1.0, 1.0)):
        cost = LinearCostModel({k: v * scale for k, v in KNOWN.items()})
        trace = replay_trace(cost, seconds, seed=0)
        res = run_replica(trace, make_policy("unified"), cost, kv_capacity=10**9)
        # each lone request wakes the idle replica after the gap planned before it
        gaps = [idle_s for idle_s, _ in res.wakes.values()]
        for g in WAKE_GAPS_S[:WAKE_TAIL]:
            g *= min(1.0, seconds / WAKE_SCALE_S)
            assert any(abs(g - x) < 0.01 for x in gaps), (scale, g, gaps)
        assert all(r.prompt_tokens <= 48 and r.output_tokens <= 4 for r in trace[-WAKE_TAIL:])
        assert len(REPLAY_POLICIES) * len(res.wakes) >= MIN_WAKES


def test_a_fit_from_runs_recovers_a_planted_cost_on_the_steps_after_a_wake():
    from schedlab.analysis.runfit import fit_runs

    truth = {**KNOWN, "i_step": 0.004, "i_after": 0.003}
    fit = fit_runs(synthetic_runs(truth, noise=0.02, seed=5))
    assert "i_after" in fit.report["chosen"]["terms"], fit.report["tries"]
    assert fit.coefficients["i_after"] == pytest.approx(0.003, rel=0.25)
    assert fit.coefficients["i_step"] == pytest.approx(0.004, rel=0.25)


def test_a_fit_from_runs_recovers_a_planted_per_step_cost():
    """A cost every real step pays whatever its passes (the loop's own work: plan, state updates,
    hand-over), here 4x the known one and per row on top, is found by the fit from the steps,
    and with it each held-out step's measured/predicted median is 1."""
    from schedlab.analysis.runfit import _concat, fit_runs, predict

    truth = {**KNOWN, "s_step": 0.002, "s_row": 0.0002}
    runs = synthetic_runs(truth, noise=0.02, seed=11)
    fit = fit_runs(runs)
    assert fit.coefficients["s_step"] == pytest.approx(0.002, rel=0.15)
    assert "s_row" in fit.report["chosen"]["terms"], fit.report["tries"]
    assert fit.coefficients["s_row"] == pytest.approx(0.0002, rel=0.25)
    cols = _concat(runs)
    ratio = cols["measured_s"] / predict(fit.coefficients, cols)
    assert abs(np.median(ratio) - 1) < 0.01
    # the known model, without the planted cost, is short on every step
    assert np.median(cols["measured_s"] / predict(KNOWN, cols)) > 1.05


def test_a_fit_from_runs_predicts_the_mean_step_time_when_slow_spells_skew_the_steps():
    from schedlab.analysis.residuals import bias
    from schedlab.analysis.runfit import _concat, fit_runs, predict

    # a fifth of the steps take 1.5x: every shape's mean is 1.1x the truth, its median 1.0x
    runs = synthetic_runs(KNOWN, noise=0.02, seed=7, slow=(0.2, 1.5))
    cols = _concat(runs)
    planted = cols["measured_s"].sum() / predict(KNOWN, cols).sum()
    assert 1.07 < planted < 1.13  # the skew is there
    fit = fit_runs(runs)
    assert fit.report["chosen"]["weigh_by"] == "prediction"
    total = predict(fit.coefficients, cols).sum() / cols["measured_s"].sum() - 1
    assert abs(total) < 0.01  # the total step time: what latencies add up
    # the steps' measured/predicted: the mean meets 1, the median is below (the skew, no missing cost)
    b = bias(cols, fit.coefficients)
    assert abs(b["mean"] - 1) < 0.015 and b["median"] < 0.95, b
    # on whole held-out runs, and in every group of steps (every shape skewed alike)
    held = fit.report["held_out"]
    assert set(held) == {"all", "decode", "prefill", "join/leave", "after idle"}
    assert all(abs(g["total_pct"]) < 2.0 for g in held.values()), held
    # weighted by each step's measured seconds, a slow step counts less and the fit falls short
    old = fit_runs(runs, weigh_by="measured")
    assert predict(old.coefficients, cols).sum() / cols["measured_s"].sum() - 1 < -0.03
    assert all(g["total_pct"] < -2.5 for g in old.report["held_out"].values()), old.report["held_out"]
    with pytest.raises(ValueError, match="weigh_by"):
        fit_runs(runs, weigh_by="median")


def test_a_scaled_fit_keeps_the_grid_shapes_and_finds_the_loops_slowdown():
    from schedlab.analysis.runfit import fit_runs

    slower = {k: v * (1.15 if k.startswith("d_") else 1.0) for k, v in KNOWN.items()}
    truth = {**slower, "i_step": 0.003}
    fit = fit_runs(synthetic_runs(truth, noise=0.01, seed=5), base=dict(KNOWN), modes=("scaled",))
    assert fit.report["chosen"]["mode"] == "scaled"
    assert fit.report["chosen"]["scales"]["a_decode"] == pytest.approx(1.15, rel=0.03)
    assert fit.report["chosen"]["scales"]["a_prefill"] == pytest.approx(1.0, rel=0.05)
    assert fit.coefficients["d_kv"] == pytest.approx(1.15 * KNOWN["d_kv"], rel=0.03)
    assert fit.coefficients["i_step"] == pytest.approx(0.003, rel=0.2)
    # on request only: by default the grid's fit is a base for a joint fit, scaled is not tried
    default = fit_runs(synthetic_runs(truth, noise=0.01, seed=5, n_runs=2, steps=200), base=dict(KNOWN))
    assert default.report["chosen"]["mode"] == "joint"
    assert {t["mode"] for t in default.report["tries"]} == {"joint"}


def test_residual_table_shows_a_planted_effect_in_its_bin():
    from schedlab.analysis.residuals import bias, bias_line, residual_table

    truth = {**KNOWN, "i_step": 0.01}
    cols = synthetic_runs(truth, n_runs=1, noise=0.0)[0].cols
    cols["predicted_s"] = sum(KNOWN.get(k, 0.0) * cols[k] for k in STEP_TERMS)  # a profile without it
    rows = {(r["feature"], r["bin"]): r for r in residual_table(cols)}
    assert rows[("idle before (s)", "back to back")]["median"] == pytest.approx(1.0)
    assert rows[("idle before (s)", "0.25-1")]["median"] > 1.2
    b = bias(cols)
    assert b["back_to_back"] == pytest.approx(1.0) and b["after_idle"] > 1.2 and b["total_pct"] < 0
    assert "after idle" in bias_line(b)
    # slow spells (a block of slow steps) against each step's own noise (alternating)
    pred = np.full(100, 0.01)
    spells = bias({"measured_s": pred * np.repeat([1.0, 1.5], 50), "predicted_s": pred, "after_idle": np.zeros(100)})
    jitter = bias({"measured_s": pred * np.tile([1.0, 1.5], 50), "predicted_s": pred, "after_idle": np.zeros(100)})
    assert spells["lag1_corr"] > 0.9 and jitter["lag1_corr"] < -0.9
    assert spells["median"] == jitter["median"] == pytest.approx(1.25) and spells["mean"] == pytest.approx(1.25)


def test_a_profile_fitted_to_runs_keeps_the_models_cache_layout():
    # sliding windows (Gemma 3): the simulator's memory accounting reads the profile's cache_layout;
    # a fit to runs that dropped it counted every layer as full attention (validate then admitted
    # what the real engine held back)
    from schedlab.analysis.runfit import profile_from_runs

    layout = {"full_layers": 3, "kv_bytes_per_token": 6144, "sliding": [[512, 15]], "state_bytes": 0}
    runs = synthetic_runs(KNOWN, noise=0.02)
    for r in runs:
        r.meta.update(model="m", dtype="float32", parameters=1, cache_layout=layout)
    assert profile_from_runs(runs)["cache_layout"] == layout
    plain = {**layout, "full_layers": 30, "sliding": []}
    for r in runs:
        r.meta["cache_layout"] = plain
    assert "cache_layout" not in profile_from_runs(runs)  # (every layer full attention: nothing to say)
