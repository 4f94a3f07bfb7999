"""calibrate's fit, and validate end to end (real MLX, micro model, real traces)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from schedlab.policies.base import PassShape
from schedlab.sim.cost import FEATURES, LinearCostModel, pass_features, step_features
from schedlab.analysis.fit import Sample, fit_profile
from schedlab.analysis.validation import METRICS, compare, format_table, hold_one_out
from simkit import command, KNOWN, read_table


def cli(name, *args, cwd=None):
    return subprocess.run([*command(name), *args], capture_output=True, text=True, cwd=cwd, timeout=600)


# ---------------------------------------------------------------------------- the fit


def synthetic_samples(coef: dict[str, float], noise: float, seed: int = 1) -> list[Sample]:
    """Samples shaped like calibrate's grid, timed by a known linear model (plus noise)."""
    rng = random.Random(seed)
    model = LinearCostModel(coef)
    out: list[Sample] = []

    def add(group, label, shape=None, step=None):
        if shape is not None:
            feats, secs = pass_features(shape), model.pass_seconds(shape)
        else:
            feats, secs = step_features(*step), model.step_overhead_seconds(*step)
        secs *= 1 + rng.uniform(-noise, noise)
        out.append(Sample(group, label, feats, secs, [secs]))

    for bi, b in enumerate((1, 2, 3, 4, 8, 16, 32, 64)):
        for ci, c in enumerate((40, 300, 1000, 2500)):
            if b > 2 and (bi + ci) % 2:  # heavy-tailed: one long row, the rest short (as the grid)
                ctx = (c,) + tuple(max(2, c // 8 + (i * 37) % max(1, c // 4)) for i in range(1, b))
            else:
                ctx = tuple(c - (i * 37) % max(1, c // 4) for i in range(b))
            add("decode", f"B={b} C={c}", PassShape(decode_contexts=ctx))
            add("join", f"B={b} C={c} merge", PassShape(decode_contexts=ctx, joins=b, join_context=sum(ctx)))
            k = max(1, b // 8)
            add(
                "join",
                f"B={b} C={c} +{k}",
                PassShape(decode_contexts=ctx + (c // 2,) * k, batch_rows_before=b, joins=k, join_context=c // 2 * k),
            )
            add("leave", f"B={b} C={c}", PassShape(decode_contexts=ctx, batch_rows_before=b, leaves=(b + 1) // 2))
    for i, n in enumerate((1, 16, 64, 256, 1024, 2048)):
        for j, c in enumerate((0, 300, 1000, 2500)):
            done = (i + j) % 2 == 1
            add("prefill", f"n={n} c={c}", PassShape(prefill=((n, c),), prefill_done=(done,)))
    for k, (rows, n, c) in enumerate(((2, 64, 0), (4, 256, 0), (8, 32, 500), (3, 512, 300), (6, 96, 1000))):
        chunks = tuple((max(1, n - 7 * r), c if r % 2 else 0) for r in range(rows))
        add("padded", f"rows={rows}", PassShape(prefill=chunks, padded=True, prefill_done=(bool(k % 2),) * rows))
    for b, c, n, cc in ((4, 256, 128, 0), (16, 512, 256, 0), (8, 1000, 512, 300)):
        add("mixed", f"B={b}", PassShape(decode_contexts=(c,) * b, prefill=((n, cc),), prefill_done=(True,)))
    for p in (1, 2, 3):
        for rows in range(1, 40, 3):
            add("step", f"{p} {rows}", step=(p, rows))
    return out


def test_fit_recovers_known_coefficients():
    # a merge's copy of each row's own length and an extend's concatenation planted beside the
    # zero-filled allocation: the grid's uniform and heavy-tailed batches tell the three apart
    truth = {**KNOWN, "c_join_ctx": 1.5e-8, "c_extend": 2e-8}
    coef, report = fit_profile(synthetic_samples(truth, noise=0.0))
    for k in FEATURES:
        assert coef[k] == pytest.approx(truth.get(k, 0.0), rel=1e-6, abs=1e-12), k
    for group in ("decode", "join", "leave", "prefill", "mixed"):
        assert report[group]["held_out"]["max_abs_pct"] < 1e-6
    # with 2 % noise: the terms that dominate some samples are recovered, and predictions
    # of held-out points stay within the noise
    coef, report = fit_profile(synthetic_samples(KNOWN, noise=0.02))
    for k in ("d_pass", "c_join", "p_tokens", "s_step"):
        assert coef[k] == pytest.approx(KNOWN[k], rel=0.15), k
    assert report["held_out_passes"]["median_abs_pct"] < 2.0
    assert report["held_out_passes"]["max_abs_pct"] < 6.0


def test_fit_keeps_the_decode_shape_terms_only_where_the_grid_shows_them():
    """A planted small-batch cost (rows 2-4) and a context knee are found and recovered; on a
    grid timed without them neither is added (analysis.fit.shape_terms)."""
    planted = {**KNOWN, "d_few": 5e-4, "d_kv_long": 3e-7, "p_small": 2e-4}
    coef, report = fit_profile(synthetic_samples(planted, noise=0.02))
    assert set(report["decode"]["terms"]) >= {"d_few", "d_kv_long"}
    assert coef["d_few"] == pytest.approx(5e-4, rel=0.25)
    assert coef["d_kv_long"] == pytest.approx(3e-7, rel=0.25)
    assert report["decode"]["held_out"]["median_abs_pct"] < 2.0
    assert "p_small" in report["prefill"]["terms"] and coef["p_small"] == pytest.approx(2e-4, rel=0.25)
    tries = report["decode_shape_tries"]  # the base decode terms alone missed by far more
    assert tries[0]["loo_median_abs_pct"] > 2 * min(t["loo_median_abs_pct"] for t in tries if t["kept"])
    coef, report = fit_profile(synthetic_samples(KNOWN, noise=0.02))
    assert not {"d_few", "d_kv_long"} & set(report["decode"]["terms"]) and "p_small" not in report["prefill"]["terms"]
    assert coef["d_few"] == coef["d_kv_long"] == coef["p_small"] == 0.0
    assert any(t["terms"][-1] == "d_few" for t in report["decode_shape_tries"])  # it was tried


def test_samples_and_step_tables_recorded_before_the_decode_shape_terms_get_them(tmp_path):
    """A profile's samples and a run's features.parquet written before d_few / d_kv_long
    existed: the terms' features are derived from the rows and longest context they kept, equal
    to what pass_features gives the same pass."""
    from schedlab.analysis.fit import Sample
    from schedlab.sim.cost import DECODE_SHAPE_TERMS, KV_KNEE, PREFILL_SHAPE_TERMS
    from schedlab.sim.features import COLUMNS, features_table, read_features
    import pyarrow.parquet as pq

    shapes = [
        PassShape(decode_contexts=(KV_KNEE + 300,) + (40,) * 5),
        PassShape(decode_contexts=(90,)),
        PassShape(decode_contexts=(KV_KNEE + 1, 7)),
    ]
    for shape in shapes:
        f = pass_features(shape)
        old = {k: v for k, v in f.items() if v and k not in DECODE_SHAPE_TERMS}
        got = Sample.from_json({"group": "decode", "label": "x", "seconds": 0.01, "features": old}).features
        for k in DECODE_SHAPE_TERMS:
            assert got.get(k, 0.0) == f[k], (shape, k)
    # a prefill sample (one chunk) and a padded one (rows from its label, as calibrate writes it)
    for group, label, shape in (
        ("prefill", "n=9 c=0", PassShape(prefill=((9, 0),))),
        ("prefill", "n=300 c=40 done", PassShape(prefill=((300, 40),), prefill_done=(True,))),
        ("padded", "rows=3 n<=12 c=0", PassShape(prefill=((12, 0), (5, 0), (7, 0)), padded=True)),
    ):
        f = pass_features(shape)
        old = {k: v for k, v in f.items() if v and k not in PREFILL_SHAPE_TERMS}
        got = Sample.from_json({"group": group, "label": label, "seconds": 0.01, "features": old}).features
        assert got["p_small"] == f["p_small"] > 0, label
    assert pass_features(shapes[0])["d_kv_long"] > 0 and pass_features(shapes[0])["d_few"] > 0
    steps = shapes + [
        PassShape(prefill=((9, 0),)),
        PassShape(prefill=((12, 0), (5, 0), (7, 0)), padded=True),
        PassShape(decode_contexts=(600, 30), prefill=((40, 100),)),
    ]  # a mixed step
    cols = {k: np.zeros(len(steps)) for k in COLUMNS}
    for j, shape in enumerate(steps):
        cols["decode_rows"][j] = len(shape.decode_contexts)
        cols["decode_ctx"][j] = max(shape.decode_contexts, default=0)
        cols["prefill_chunks"][j] = len(shape.prefill)
        cols["prefill_tokens"][j] = shape.prefill_tokens
        cols["padded"][j] = int(shape.padded)
        for k, v in pass_features(shape).items():
            cols[k][j] = v
    assert all(cols["p_small"][len(shapes) :] > 0)
    table = features_table(cols)
    pq.write_table(table.drop_columns(list(DECODE_SHAPE_TERMS + PREFILL_SHAPE_TERMS)), tmp_path / "features.parquet")
    back = read_features(tmp_path)
    for k in DECODE_SHAPE_TERMS + PREFILL_SHAPE_TERMS:
        assert list(back[k]) == list(cols[k]), k


def test_compare_errors_and_spread():
    sim = {
        "ttft_ms": {"p50": 110.0, "p90": 200.0, "p99": 300.0},
        "itl_ms": {"p50": 10.0, "p99": 50.0},
        "tpot_ms": {"p50": 12.0},
        "e2e_ms": {"p50": 900.0},
        "output_throughput_tok_s": 95.0,
        "makespan_s": 10.0,
    }
    real1 = json.loads(json.dumps(sim))
    real1["ttft_ms"]["p50"] = 100.0
    real2 = json.loads(json.dumps(real1))
    real2["ttft_ms"]["p50"] = 120.0
    real2["makespan_s"] = 12.0
    v = compare(sim, [real1, real2], policy="p", trace="t")
    row = v["metrics"]["ttft_ms.p50"]
    assert row["real"] == 110.0 and row["error_pct"] == pytest.approx(0.0) and row["within_spread"]
    assert row["spread_pct"] == pytest.approx(100 * 20 / 110)
    ms = v["metrics"]["makespan_s"]
    assert ms["real"] == 11.0 and ms["error_pct"] == pytest.approx(100 * (10 - 11) / 11) and ms["within_spread"]
    one = compare(sim, [real1], policy="p", trace="t")
    assert one["metrics"]["ttft_ms.p50"]["error_pct"] == pytest.approx(10.0)
    assert "within_spread" not in one["metrics"]["ttft_ms.p50"]
    assert one["median_abs_error_pct"] == pytest.approx(0.0) and one["max_abs_error_pct"] == pytest.approx(10.0)


def test_hold_one_out_puts_the_simulation_where_a_real_run_stands():
    # each run against the median of the others; the simulation against the same medians
    runs = [100.0, 110.0, 130.0]
    refs = [120.0, 115.0, 105.0]
    sim_err, real_err = hold_one_out(105.0, runs)
    assert sim_err == pytest.approx(sum(100 * abs(105 - r) / r for r in refs) / 3)
    assert real_err == pytest.approx(sum(100 * abs(x - r) / r for x, r in zip(runs, refs)) / 3)
    # a simulation that sits at the runs' median is no further off than a run; one far off is
    assert hold_one_out(110.0, runs)[0] < real_err < hold_one_out(150.0, runs)[0]
    assert hold_one_out(105.0, [100.0]) is None and hold_one_out(None, runs) is None
    # one simulation per run (each at its run's probed speed): the others' median is predicted by
    # the median of the others' simulations
    assert hold_one_out(None, runs, sims=runs)[0] == 0.0
    assert hold_one_out(None, runs, sims=[100.0, 110.0, 150.0])[0] == pytest.approx(
        (100 * abs(130 - 120) / 120 + 100 * abs(125 - 115) / 115 + 0.0) / 3
    )
    with pytest.raises(ValueError, match="2 simulations for 3 real runs"):
        hold_one_out(None, runs, sims=[100.0, 110.0])
    # in compare: with several real runs, per comparison (median and worst over the metrics)
    sim = {
        "ttft_ms": {"p50": 100.0, "p90": 200.0, "p99": 300.0},
        "itl_ms": {"p50": 10.0, "p99": 50.0},
        "tpot_ms": {"p50": 12.0},
        "e2e_ms": {"p50": 900.0},
        "output_throughput_tok_s": 95.0,
        "makespan_s": 10.0,
    }
    reals = [json.loads(json.dumps(sim)) for _ in runs]
    for r, x in zip(reals, runs):
        r["ttft_ms"]["p50"] = x
    v = compare(sim, reals, policy="p", trace="t")
    h = v["hold_one_out"]
    assert h["metrics"] == len(METRICS)
    assert h["sim_max_pct"] == pytest.approx(hold_one_out(100.0, runs)[0])
    assert h["real_max_pct"] == pytest.approx(real_err)
    assert h["sim_median_pct"] == 0.0 and h["real_median_pct"] == 0.0  # the other metrics agree exactly
    assert "the machine's own repeat error" in format_table(v)
    assert "hold_one_out" not in compare(sim, reals[:1], policy="p", trace="t")


# ---------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def micro_profile(micro_quick_calibration) -> Path:
    proc, out = micro_quick_calibration  # calibrate --quick --model micro --out OUT -q (conftest: once a session)
    assert proc.returncode == 0, proc.stderr
    assert "held-out passes" in proc.stdout
    return out


@pytest.mark.slow
def test_calibrate_writes_a_profile_with_its_fit_report(micro_profile, tmp_path):
    prof = json.loads(micro_profile.read_text())
    assert prof["schema"] == "schedlab-profile/1" and prof["model"] == "micro" and prof["dtype"] == "float32"
    assert set(prof["coefficients"]) == set(FEATURES)
    assert all(v >= 0 for v in prof["coefficients"].values())
    assert {"name", "threads"} <= set(prof["blas"]) and prof["machine"]["cpu_count"] and prof["date"]
    rep = prof["fit_report"]
    for group in ("decode", "join", "leave", "prefill", "step", "verify"):
        assert rep[group]["held_out"]["n"] >= 1 and rep[group]["r2"] is not None
    assert rep["mixed"]["held_out"]["n"] >= 1
    # verify passes (speculative decoding) were timed beside plain ones: the model prices them itself
    from schedlab.policies.base import PassShape, verify_seconds

    model = LinearCostModel(prof["coefficients"])
    plain, verify = PassShape((600,) * 4), PassShape((600,) * 4, decode_drafts=(4,) * 4)
    assert model.prices_drafts and verify_seconds(model, verify) == 0
    assert model.pass_seconds(verify) > model.pass_seconds(plain)
    assert rep["verify_passes"]["n"] == sum(s["group"] == "verify" for s in prof["samples"]) > 0
    assert len(prof["samples"]) == prof["calibration"]["samples"]
    from schedlab.engine.calibrate import DECODE_WARM, decode_warm

    assert decode_warm(prof) == DECODE_WARM  # its steady decode samples skipped the passes after the join
    assert micro_profile.with_suffix(".md").read_text().startswith("# Cost profile: micro")
    # simulate takes it as it is
    proc = cli("simulate", "-p", "unified", "-t", "real-smoke", "--profile", str(micro_profile), "-q")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_profile_mismatch_names_the_difference(micro_profile, monkeypatch):
    from schedlab import engine  # noqa: F401
    from schedlab.engine.calibrate import profile_mismatch
    from schedlab.engine.models import load_model

    meta = json.loads(micro_profile.read_text())
    info = load_model("micro")
    assert profile_mismatch(meta, info) is None
    assert "model" in profile_mismatch(dict(meta, model="tiny"), info)
    assert "BLAS threads" in profile_mismatch(dict(meta, blas=dict(meta["blas"], threads=99)), info)
    # same core count and architecture, another CPU (or BLAS kernel): not this machine
    assert meta["machine"]["cpu_model"]
    assert "CPU model" in profile_mismatch(dict(meta, machine=dict(meta["machine"], cpu_model="Other CPU")), info)
    assert "BLAS build" in profile_mismatch(dict(meta, blas=dict(meta["blas"], config="OpenBLAS 0.3.21 Haswell")), info)
    # measured under other allocator settings (engine.noise: what a join costs): not used here,
    # and a profile from before they were recorded counts as measured under the defaults
    assert meta["allocator"] == {"malloc_keep": False, "mlx_cache": None}
    kept = dict(meta, allocator={"malloc_keep": True, "mlx_cache": None})
    assert "allocator settings" in profile_mismatch(kept, info)
    assert profile_mismatch({k: v for k, v in meta.items() if k != "allocator"}, info) is None
    monkeypatch.setenv("SCHEDLAB_NOISE", "malloc-keep,gc-off")
    assert profile_mismatch(kept, info) is None and "allocator settings" in profile_mismatch(meta, info)


@pytest.mark.slow
def test_validate_end_to_end(micro_profile, tmp_path):
    out = tmp_path / "val"
    proc = cli(
        "validate",
        "--policy",
        "prefer-prefill",
        "--trace",
        "real-smoke",
        "--model",
        "micro",
        "--profile",
        str(micro_profile),
        "--repeat",
        "2",
        "--out",
        str(out),
        "-q",
    )
    assert proc.returncode == 0, proc.stderr
    assert "TTFT p50 (ms)" in proc.stdout and "per-step cost-model error" in proc.stdout
    v = json.loads((out / "validation.json").read_text())
    assert v["policy"] == "prefer-prefill" and v["trace"] == "real-smoke" and v["repeats"] == 2
    assert set(v["metrics"]) == {k for k, _, _ in METRICS}
    sim = json.loads((out / "sim" / "summary.json").read_text())
    reals = [json.loads((out / d / "summary.json").read_text()) for d in ("real", "real-2")]
    assert sim["mode"] == "sim" and all(r["mode"] == "real" for r in reals)
    row = v["metrics"]["makespan_s"]
    assert row["sim"] == sim["makespan_s"]
    assert row["real"] == pytest.approx(
        sorted(r["makespan_s"] for r in reals)[0] / 2 + sorted(r["makespan_s"] for r in reals)[1] / 2
    )
    assert row["error_pct"] == pytest.approx(100 * (row["sim"] - row["real"]) / row["real"])
    for key, r in v["metrics"].items():
        assert {"sim", "real", "error_pct", "real_runs", "spread_pct", "within_spread"} <= set(r), key
    errs = [abs(r["error_pct"]) for r in v["metrics"].values()]
    assert v["max_abs_error_pct"] == pytest.approx(max(errs))
    se = v["step_error_pct"]
    assert se["n"] > 0 and 0 <= se["p50"] <= se["p90"]
    # each real run held out against the other: the simulation's error beside a real run's own
    h = v["hold_one_out"]
    ttft = v["metrics"]["ttft_ms.p50"]["real_runs"]
    assert h["metrics"] == len(METRICS) and h["real_max_pct"] >= 100 * abs(ttft[0] - ttft[1]) / max(ttft)
    assert "the machine's own repeat error" in proc.stdout
    # the machine's speed, before and after the real runs, against the profile it was timed with
    for when in ("before", "after"):
        sp = v["machine_speed"][when]
        assert sp["points"] >= 2 and sp["ratio"] > 0 and sp["decode"] > 0 and sp["prefill"] > 0
    assert "machine speed: the profile's reference passes ran at" in proc.stdout
    # ... and the simulation again at that speed, against the same real runs
    # (only where that speed explains the real steps' bias in direction: else said and not applied)
    adj = v["drift_adjusted"]
    ms = v["machine_speed"]
    assert adj["speed_factor"] == pytest.approx((ms["before"]["ratio"] + ms["after"]["ratio"]) / 2)
    steps = pd.concat([pd.read_parquet(out / d / "steps.parquet") for d in ("real", "real-2")])
    steps = steps[(steps.predicted_s > 0) & (steps.measured_s > 0)]
    assert adj["step_ratio"] == pytest.approx(steps.measured_s.sum() / steps.predicted_s.sum())
    if adj["applied"]:
        assert (adj["speed_factor"] - 1) * (adj["step_ratio"] - 1) > 0
        assert set(adj["error_pct"]) == set(v["metrics"]) and adj["max_abs_error_pct"] >= adj["median_abs_error_pct"]
        assert "drift-adjusted (the simulation with every pass" in proc.stdout
    else:
        assert (adj["speed_factor"] - 1) * (adj["step_ratio"] - 1) <= 0 and "error_pct" not in adj
        assert "drift adjustment not applied" in proc.stdout and "drift-adjusted (" not in proc.stdout
    # the plot command reads a validate directory as it is
    figs = tmp_path / "figs"
    proc = cli("plot", str(out), "--out", str(figs))
    assert proc.returncode == 0, proc.stderr
    assert any(p.name.startswith("validate_") and p.suffix == ".png" for p in figs.iterdir())


@pytest.mark.slow
def test_validate_bad_inputs(micro_profile, tmp_path):
    for args, frag in (
        (["--policy", "nope", "--trace", "real-smoke"], "unknown policy"),
        (["--policy", "static", "--trace", "real-smoke", "--repeat", "0"], "--repeat"),
        (["--policy", "static", "--trace", "real-smoke", "--model", "huge"], "preset"),
        (
            ["--policy", "static", "--trace", "real-smoke", "--profile", str(micro_profile), "--hardware", "m4-max"],
            "either --profile or --hardware",
        ),
    ):
        proc = cli("validate", *args, "--out", str(tmp_path / "x"))
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and frag in lines[0], proc.stderr


def test_speed_points_come_from_the_profile_and_the_speed_line_reads_them():
    from schedlab.engine.calibrate import speed_points
    from schedlab.analysis.validation import speed_line

    samples = [
        {"group": "decode", "label": f"B={b} C={c}", "seconds": 0.001 * b + 1e-6 * c}
        for b in (1, 2, 4, 16, 64)
        for c in (40, 600, 2500)
    ]
    samples += [
        {"group": "prefill", "label": f"n={n} c={c}" + (" done" if d else ""), "seconds": 1e-4 * n}
        for n, c, d in ((1, 0, False), (16, 0, True), (64, 300, False), (256, 0, True), (2048, 0, False))
    ]
    samples += [{"group": "join", "label": "B=4 C=40 merge", "seconds": 0.01}]
    pts = speed_points({"samples": samples})
    dec = [a for k, a, _ in pts if k == "decode"]
    pre = [a for k, a, _ in pts if k == "prefill"]
    # a few rows at short context; chunks of tens to hundreds of tokens; never another group
    assert len(dec) == 3 and all(2 <= b <= 16 and c <= 700 for b, c in dec)
    assert (2, 40) in dec and (16, 600) in dec  # the smallest and the largest, not all alike
    assert pre == [(16, 0, True), (64, 300, False), (256, 0, True)]
    assert speed_points({"samples": []}) == [] and speed_points({}) == []
    line = speed_line({"before": {"ratio": 1.31}, "after": {"ratio": 1.02}})
    assert "1.31x (before the real runs) and 1.02x (after the real runs)" in line and "31 % slower" in line
    assert "20 % faster" in speed_line({"before": {"ratio": 0.8}, "after": None})
    assert "not the cost model" not in speed_line({"before": {"ratio": 1.01}, "after": {"ratio": 0.98}})
    assert "sped up by 22 % during them" in line
    assert "slowed by 36 % during them" in speed_line({"before": {"ratio": 0.89}, "after": {"ratio": 1.21}})
    assert "during them" not in speed_line({"before": {"ratio": 1.05}, "after": {"ratio": 1.1}})
    assert speed_line(None) is None and speed_line({"before": None}) is None


def test_a_scaled_cost_model_scales_every_second_and_the_whole_schedule():
    from schedlab.policies import make_policy
    from schedlab.sim import run_replica
    from schedlab.sim.cost import ScaledCostModel
    from simkit import cost_model, req

    base = cost_model()
    shape = PassShape(decode_contexts=(100, 80), prefill=((64, 0),), prefill_done=(True,), joins=1)
    twice = ScaledCostModel(base, 2.0)
    assert twice.pass_seconds(shape) == pytest.approx(2 * base.pass_seconds(shape))
    assert twice.step_overhead_seconds(2, 5) == pytest.approx(2 * base.step_overhead_seconds(2, 5))
    # every request there at 0 s: the same plans, each step twice as long
    reqs = [req(i, 40 + 17 * i, 5 + i) for i in range(6)]
    a = run_replica(reqs, make_policy("chunked-prefill"), base, kv_capacity=10**6)
    b = run_replica(reqs, make_policy("chunked-prefill"), twice, kv_capacity=10**6)
    assert len(a.steps) == len(b.steps)
    assert b.steps[-1].end_s == pytest.approx(2 * a.steps[-1].end_s)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            ScaledCostModel(base, bad)


def test_the_grids_steady_decode_sample_skips_the_passes_right_after_the_batch_forms():
    """measure_decode times its steady passes after ``warm`` untimed ones (the passes right
    after a join run slower than later ones): the sample's shapes are those passes' (each
    context ``warm`` tokens longer), and a profile says how many it skipped, so that a speed
    check times its points as they were measured (0 for profiles from before)."""
    from schedlab.engine.calibrate import DECODE_WARM, Rig, decode_warm, measure_decode
    from schedlab.engine.models import load_model

    rig = Rig(load_model("micro"), seed=0)
    cold = {(s.group, s.label): s for s in measure_decode(rig, 3, 40, 1, warm=0)}
    warm = {(s.group, s.label): s for s in measure_decode(rig, 3, 40, 1, warm=4)}
    assert set(cold) == set(warm) and len(cold) == 4
    d0, d4 = cold["decode", "B=3 C=40"].features, warm["decode", "B=3 C=40"].features
    assert d4["d_ctx"] - d0["d_ctx"] == 4 and d4["d_rows"] == d0["d_rows"] == 3
    for key in cold:  # the extend and the leave come after the warm passes too
        if key != ("join", "B=3 C=40 merge"):
            assert warm[key].features["d_ctx"] - cold[key].features["d_ctx"] == 4, key
    merge = ("join", "B=3 C=40 merge")
    assert warm[merge].features == cold[merge].features  # the join itself comes first
    assert DECODE_WARM > 0
    assert decode_warm({"calibration": {"grid": "quick", "decode_warm": DECODE_WARM}}) == DECODE_WARM
    assert decode_warm({"calibration": {"kind": "grid+replay", "grid": {"decode_warm": 2}}}) == 2
    assert decode_warm({"calibration": {"grid": "quick"}}) == 0 and decode_warm({}) == 0


@pytest.mark.slow
def test_validate_can_time_the_machine_with_the_calibrations_own_replay(tmp_path):
    """``speed_probe="replay"``: the machine's speed before and after the real runs (here after
    each of them too) is the default calibration's own replay trace run again in the real loop
    (drawn again from the profile's grid samples), and the drift-adjusted simulation runs at each
    run's speed; a profile without a replay falls back to the reference passes."""
    import pandas as pd

    from schedlab import traces
    from schedlab.engine.calibrate import (
        calibrate_default,
        grid_coefficients,
        replay_speed_check,
        replay_trace,
        write_profile,
    )
    from schedlab.engine.models import load_model
    from schedlab.policies import make_policy
    from schedlab.api._validation import validate_many
    from schedlab.analysis.validation import speed_line

    info = load_model("micro")
    # short: 1 s replays (~30 requests, ~300 steps each), and one round of the quick grid (a round
    # always completes; a zero budget stops the next)
    prof = calibrate_default(info, replay_s=1.0, grid_budget_s=0.0, keep=tmp_path / "replay")
    assert prof["calibration"]["grid"]["rounds"] == 1
    assert prof["calibration"]["kind"] == "grid+replay"
    assert prof["allocator"] == {"malloc_keep": False, "mlx_cache": None}  # the grid's, kept by the joint fit
    # the grid's own fit draws the very trace the calibration replayed
    again = replay_trace(LinearCostModel(grid_coefficients(prof)), 1.0, 0)
    kept = pd.read_csv(tmp_path / "replay" / "mlx-default" / "requests.csv")
    assert [r.prompt_tokens for r in again] == kept["prompt_tokens"].tolist()
    assert [r.output_tokens for r in again] == kept["output_tokens"].tolist() and len(again) >= 4
    path = write_profile(prof, tmp_path / "profile.json")
    probe = replay_speed_check(info, prof)
    assert probe["kind"] == "replay" and probe["policy"] == "mlx-default" and probe["steps"] > len(again)
    assert probe["requests"] == len(again) and probe["seed"] == 0  # the calibration's trace
    assert 0.2 < probe["ratio"] < 5
    cost = LinearCostModel.from_profile(path)
    tr = traces.load("real-smoke", seed=0)
    tr.requests = tr.requests[:4]
    said = []
    out = validate_many(
        {"unified": make_policy("unified")},
        tr,
        info,
        cost,
        10**6,
        {},
        2,
        5,
        {"kind": "linear", "profile": str(path)},
        said.append,
        speed_probe="replay",
        speed_every_run=True,
    )
    v = out["unified"][0]
    ms = v["machine_speed"]
    assert ms["before"]["kind"] == ms["after"]["kind"] == "replay" and "points" not in ms["before"]
    assert ms["before"]["requests"] == len(again)  # the calibration's replay, not one of the validation's seed
    # probed before the first run and after each: each run's speed from the probes either side of it
    p = [x["ratio"] for x in ms["probes"]]
    assert len(p) == 3 and ms["runs"] == [(0, 1), (1, 2)] and ms["after"] is ms["probes"][-1]
    assert v["drift_adjusted"]["speed_factor"] == pytest.approx(((p[0] + p[1]) / 2 + (p[1] + p[2]) / 2) / 2)
    if v["drift_adjusted"]["applied"]:
        assert v["drift_adjusted"]["speeds"] == pytest.approx([(p[0] + p[1]) / 2, (p[1] + p[2]) / 2], abs=1e-4)
    assert sum("replay again" in m for m in said) == 1  # said once, before the runs
    assert speed_line(ms).startswith("machine speed: the profile's own replay ran at")
    # a grid-only profile has no replay to run: the reference passes
    grid_only = write_profile(
        {k: v for k, v in prof.items() if k != "calibration"} | {"calibration": {"kind": "grid"}},
        tmp_path / "grid.json",
    )
    assert replay_speed_check(info, json.loads(grid_only.read_text())) is None
    out = validate_many(
        {"unified": make_policy("unified")},
        tr,
        info,
        cost,
        10**6,
        {},
        1,
        0,
        {"kind": "linear", "profile": str(grid_only)},
        said.append,
        speed_probe="replay",
    )
    assert out["unified"][0]["machine_speed"]["before"]["points"] >= 2
    assert sum(m.startswith("timing the profile's reference passes") for m in said) == 1  # this call's
    with pytest.raises(ValueError, match="speed_probe"):
        validate_many(
            {"unified": make_policy("unified")},
            tr,
            info,
            cost,
            10**6,
            {},
            1,
            0,
            {"kind": "linear", "profile": str(path)},
            said.append,
            speed_probe="wall",
        )


def test_validate_and_calibrate_refuse_what_they_cannot_use_in_one_line(tmp_path):
    bundled = Path(__file__).resolve().parent.parent / "sim" / "profiles" / "tiny-cpu.json"
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    base = ["--policy", "vllm", "--trace", "real-smoke", "--model", "micro"]
    bad_kv = tmp_path / "bad-kv.json"
    bad_kv.write_text(json.dumps({**json.loads(bundled.read_text()), "kv_tokens": "big"}))
    folder = tmp_path / "profiles"
    folder.mkdir()
    for name, args, frags in (
        # an --out it cannot make: the same line as simulate, capacity, plot and calibrate give
        ("validate", [*base, "--profile", str(bundled), "--out", str(blocker / "x")], ["cannot write", str(blocker)]),
        (
            "calibrate",
            ["--quick", "--out", str(blocker / "p.json")],
            [f"cannot write {blocker / 'p.json'}: {blocker} is a file"],
        ),
        # a bad profile fails before --out is made (checked below: no empty folder left)
        ("validate", [*base, "--profile", str(bad_kv), "--out", str(tmp_path / "v")], [str(bad_kv), "'big'"]),
        # a folder where a file goes, and a file where a folder goes: named as such
        (
            "validate",
            [*base, "--profile", str(folder), "--out", str(tmp_path / "w")],
            [f"profile {folder} is a directory"],
        ),
        ("validate", ["--served", str(blocker)], [f"--served {blocker} is a file, not a real cluster's run directory"]),
        # MLX's random key takes an unsigned 64-bit seed
        ("calibrate", ["--quick", "--out", str(tmp_path / "p.json"), "--model-seed", "-1"], ["--model-seed", "-1"]),
        ("calibrate", ["--quick", "--out", str(tmp_path / "p.json"), "--model-seed", str(2**64)], ["[0, 2**64)"]),
    ):
        proc = cli(name, *args)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and ": note:" not in ln]
        assert len(lines) == 1 and lines[0].startswith(f"schedlab {name}: error:"), proc.stderr
        assert all(f in lines[0] for f in frags), lines[0]
    assert not (tmp_path / "p.json").exists()
    assert not (tmp_path / "v").exists() and not (tmp_path / "w").exists()


def test_the_machines_speed_is_timed_only_against_a_profile_of_the_model_validated(smol):
    # another model's profile times its own passes: this model's time against them is not the
    # machine's speed (validate said "this machine ran 2073 % slower" for SmolLM2 on tiny's profile)
    from schedlab.api._validation import _speed_reference
    from schedlab.sim.profiles import PROFILE_DIR

    own = _speed_reference({"profile": str(PROFILE_DIR / "smollm2-135m-cpu.json")}, smol)
    assert own is not None and own["model"] == smol.metadata()["model"]
    assert _speed_reference({"profile": str(PROFILE_DIR / "tiny-cpu.json")}, smol) is None
    assert _speed_reference({}, smol) is None  # (an analytic model: no profile to time)


@pytest.mark.slow
def test_validate_counts_a_trace_of_text_with_the_models_tokenizer(tmp_path):
    # a trace of chats with no token counts: validate counts them as run-real does (it refused them,
    # "give --model", with --model given)
    from schedlab.sim.profiles import PROFILE_DIR

    chats = [
        {"id": f"c{i}", "arrival_s": 0.1 * i, "output_tokens": 3, "messages": [{"role": "user", "content": q}]}
        for i, q in enumerate(("What is 2 + 2?", "Name a colour."))
    ]
    (tmp_path / "chats.json").write_text(json.dumps({"name": "chats", "requests": chats}))
    # the model's bundled profile without its grid samples: nothing to time the machine's speed with
    # (a minute of probes this test does not need)
    prof = json.loads((PROFILE_DIR / "smollm2-135m-cpu.json").read_text())
    (tmp_path / "p.json").write_text(json.dumps({**prof, "samples": []}))
    out = tmp_path / "val"
    proc = cli(
        "validate",
        *("--policy", "vllm", "--trace", str(tmp_path / "chats.json"), "--model", "smollm2-135m"),
        *("--profile", str(tmp_path / "p.json"), "--out", str(out), "-q"),
    )
    assert proc.returncode == 0, proc.stderr
    from schedlab.engine.models import load_model
    from schedlab import traces

    tok = load_model("smollm2-135m").tokenizer
    want = [len(traces.prompt_ids(r, tok)) for r in traces.load(str(tmp_path / "chats.json"), tokenizer=tok).requests]
    for side in ("sim", "real"):
        rows = read_table(out / side / "requests.csv")
        assert [int(r["prompt_tokens"]) for r in rows] == want and all(int(r["output_tokens"]) == 3 for r in rows)
