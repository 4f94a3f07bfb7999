"""The analytic model on this CPU: the optional factors, the engine's counting, the fit of
cpu-local's factors to calibration samples, and validate --hardware cpu-local end to end."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from schedlab.policies import make_policy
from schedlab.policies.base import PassShape
from schedlab.sim import run_replica
from schedlab.analysis.analytic import AnalyticError, Efficiency, analytic_from_config, fit_efficiency
from schedlab.analysis.analytic.hardware import DEFAULT_EFFICIENCY, Hardware, read_hardware_file
from schedlab.analysis.analytic.local import BLOCK_KEY, efficiency_from_block, fit_local, shape_from_sample
from schedlab.sim.cost import pass_features
from schedlab.analysis.validation import METRICS
from schedlab.traces.schema import Request

from simkit import command, read_table

BIN = Path(sys.executable).parent

# A CPU with round figures (no measurement: the fits below must not depend on this machine)
CPU = Hardware(
    name="cpu-local",
    title="test CPU",
    kind="cpu",
    memory_bytes=16e9,
    bandwidth=20e9,
    peak_flops={"fp32": 200e9},
    default_compute="fp32",
    efficiency=DEFAULT_EFFICIENCY["cpu"],
)
TRUE = Efficiency(0.12, 0.4, 1.2e-3, attention=0.03, decode_attention=0.015, copy=0.25, copy_overhead_per_layer_s=4e-4)


def preset(name):
    from schedlab.engine.models import preset_config

    return preset_config(name)


def cpu_model(name="tiny", eff=TRUE, **kw):
    return analytic_from_config(CPU, preset(name), 32, name=name, kv_bits=32, efficiency=eff, **kw)


def grid_shapes(seed=0):
    """Shapes like calibrate's grid: decode batches (forming, steady, joining, leaving),
    single prefill chunks (half completing), padded chunks, mixed passes."""
    rng = random.Random(seed)
    out = []
    for b in (1, 2, 4, 8, 16, 32):
        for c in (40, 300, 1000, 2500):
            ctx = tuple(c - (i * 37) % max(1, c // 4) for i in range(b))
            out.append(("decode", PassShape(decode_contexts=ctx, batch_rows_before=b)))
            out.append(("join", PassShape(decode_contexts=ctx, joins=b)))
            k = max(1, b // 8)
            out.append(("join", PassShape(decode_contexts=ctx + (c // 2,) * k, batch_rows_before=b, joins=k)))
            out.append(("leave", PassShape(decode_contexts=ctx, batch_rows_before=b, leaves=(b + 1) // 2)))
    for i, n in enumerate((1, 16, 64, 256, 1024)):
        for j, c in enumerate((0, 300, 1000, 2500)):
            out.append(("prefill", PassShape(prefill=((n, c),), prefill_done=((i + j) % 2 == 1,))))
    for k, (rows, n, c) in enumerate(((2, 64, 0), (4, 256, 0), (8, 32, 500), (3, 512, 300))):
        out.append(
            (
                "padded",
                PassShape(prefill=((n, c),) * rows, padded=True, prefill_done=(bool(k % 2),) + (False,) * (rows - 1)),
            )
        )
    for b, c, n, cc in ((4, 256, 128, 0), (16, 512, 256, 0), (8, 1000, 64, 500)):
        out.append(
            (
                "mixed",
                PassShape(
                    decode_contexts=(c,) * b,
                    batch_rows_before=b,
                    prefill=((n, cc),),
                    prefill_done=(rng.random() < 0.5,),
                ),
            )
        )
    return out


def profile_samples(cm, step_s=2.5e-4, noise=0.0, seed=1):
    """Calibration samples as a profile stores them, timed by ``cm`` itself."""
    rng = random.Random(seed)
    rows = []
    for group, s in grid_shapes():
        secs = cm.pass_seconds(s) * (1 + rng.uniform(-noise, noise))
        rows.append(
            {
                "group": group,
                "label": f"{group} {len(rows)}",
                "seconds": secs,
                "runs": [secs],
                "features": {k: v for k, v in pass_features(s).items() if v},
            }
        )
    for i in range(40):
        over = step_s * (1 + (0.2 if i % 3 == 0 else -0.1 if i % 3 == 1 else 0.0))
        rows.append(
            {
                "group": "step",
                "label": f"step {i}",
                "seconds": over,
                "runs": [over],
                "features": {"s_step": 1.0, "s_row": float(i % 7)},
            }
        )
    return rows


# ---------------------------------------------------------------------- the factors


def test_optional_factors_round_trip_and_presets_keep_their_blocks():
    d = TRUE.to_dict()
    back = Efficiency.from_dict(d)
    for k in (
        "compute",
        "bandwidth",
        "overhead_per_layer_s",
        "attention",
        "decode_attention",
        "copy",
        "copy_overhead_per_layer_s",
    ):
        assert getattr(back, k) == getattr(TRUE, k), k
    assert back.extra == {}
    plain = Efficiency(0.5, 0.7, 1e-4)
    assert plain.attention_factor == 0.5 and plain.decode_attention_factor == 0.5 and plain.copy_factor == 0.7
    assert not {"attention", "decode_attention", "copy", "copy_overhead_per_layer_s"} & set(plain.to_dict())
    for name, p in read_hardware_file()["presets"].items():  # the published fits use none of them
        if "efficiency" in p:
            assert Efficiency.from_dict(p["efficiency"]).attention is None, name
    with pytest.raises(AnalyticError, match="attention"):
        Efficiency(0.5, 0.5, attention=1.5)
    with pytest.raises(AnalyticError, match="copy_overhead"):
        Efficiency(0.5, 0.5, copy_overhead_per_layer_s=-1.0)


def test_attention_and_copies_cost_what_their_factors_say():
    cm = cpu_model()
    m = cm.model
    # a big chunk is compute-bound: its attention runs at the attention rate, the rest at e_c
    n, b = 1024, 500
    s = PassShape(prefill=((n, b),), prefill_done=(True,))
    (f,) = cm.forwards(s)
    assert cm.bound(f) == "compute"
    matmul = 2 * n * m.active_matmul_params() + 2 * m.vocab * m.hidden
    attn = 4 * m.layers * m.heads * m.head_dim * n * (b + n)  # every score: MLX's CPU attention masks
    expected = m.layers * TRUE.overhead_per_layer_s + matmul / (200e9 * TRUE.compute) + attn / (200e9 * TRUE.attention)
    assert cm.pass_seconds(s) == pytest.approx(expected, rel=1e-12)
    # copies: outside the max, at the copy rate, plus a per-layer overhead per copy event
    steady = PassShape(decode_contexts=(2000,) * 16, batch_rows_before=16)
    joined = PassShape(decode_contexts=(2000,) * 16, batch_rows_before=15, joins=1)
    copy = 2 * 16 * 2000 * cm.kv_bytes_per_token / (20e9 * TRUE.copy) + m.layers * TRUE.copy_overhead_per_layer_s
    assert cm.pass_seconds(joined) - cm.pass_seconds(steady) == pytest.approx(copy, rel=1e-9)
    # a leave that keeps no row copies nothing
    gone = PassShape(decode_contexts=(2000,) * 2, batch_rows_before=2, leaves=2)
    assert cm.pass_seconds(gone) == pytest.approx(
        cm.pass_seconds(PassShape(decode_contexts=(2000,) * 2, batch_rows_before=2)), rel=1e-12
    )


def test_lazy_prefill_on_cpu_and_the_fast_path_agrees_with_the_forwards():
    cm = cpu_model()
    assert cm.lazy_prefill and not cm.causal_skip
    done = cm.pass_seconds(PassShape(prefill=((256, 100),), prefill_done=(True,)))
    not_done = cm.pass_seconds(PassShape(prefill=((256, 100),), prefill_done=(False,)))
    unknown = cm.pass_seconds(PassShape(prefill=((256, 100),)))
    assert not_done < done and unknown == done  # unknown counts as completing (the full cost)
    eager = cpu_model(lazy_prefill=False)
    assert eager.pass_seconds(PassShape(prefill=((256, 100),), prefill_done=(False,))) == pytest.approx(done)
    causal = cpu_model(causal_skip=True)
    assert causal.pass_seconds(PassShape(prefill=((1024, 0),))) < cm.pass_seconds(PassShape(prefill=((1024, 0),)))
    rng = random.Random(5)
    for model in (cm, cpu_model("micro"), cpu_model(lazy_prefill=False, causal_skip=True)):
        for _ in range(300):
            chunks = tuple((rng.randint(1, 700), rng.randint(0, 2000)) for _ in range(rng.randint(0, 3)))
            done_flags = tuple(rng.random() < 0.5 for _ in chunks) if rng.random() < 0.8 else ()
            s = PassShape(
                decode_contexts=tuple(rng.randint(1, 3000) for _ in range(rng.randint(0, 9))),
                prefill=chunks,
                padded=rng.random() < 0.5,
                batch_rows_before=rng.randint(0, 9),
                joins=rng.randint(0, 2),
                leaves=rng.randint(0, 3),
                prefill_done=done_flags,
            )
            assert model.pass_seconds(s) == pytest.approx(
                sum(model.forward_seconds(f) for f in model.forwards(s)), rel=1e-12, abs=1e-15
            )


# ---------------------------------------------------------------------- shapes from samples


def test_shapes_are_recovered_from_calibration_features():
    cm = cpu_model()
    for group, s in grid_shapes():
        got = shape_from_sample({"group": group, "features": pass_features(s)})
        assert got is not None, (group, s)
        assert pass_features(got) == pytest.approx(pass_features(s))
        assert cm.pass_seconds(got) == pytest.approx(cm.pass_seconds(s), rel=1e-12), (group, s)
    assert shape_from_sample({"group": "step", "features": {"s_step": 1.0}}) is None
    two = PassShape(prefill=((10, 0), (20, 5)))  # two unpadded chunks: their sizes are lost
    assert shape_from_sample({"group": "prefill", "features": pass_features(two)}) is None
    bad = pass_features(PassShape(decode_contexts=(100,) * 4))
    bad["d_kv"] = 123.0  # not rows x longest: no shape gives these features back
    assert shape_from_sample({"group": "decode", "features": bad}) is None


# ---------------------------------------------------------------------- the fit


def test_fit_local_recovers_known_factors_from_synthetic_samples():
    truth = cpu_model(eff=TRUE)
    samples = profile_samples(truth)
    block = fit_local(samples, preset("tiny"), name="tiny", hardware=CPU)
    full = Efficiency.from_dict(block["models"]["full"]["efficiency"])
    for k in (
        "compute",
        "bandwidth",
        "overhead_per_layer_s",
        "attention",
        "decode_attention",
        "copy",
        "copy_overhead_per_layer_s",
    ):
        assert getattr(full, k) == pytest.approx(getattr(TRUE, k), rel=1e-4), k
    assert full.step_overhead_s == pytest.approx(2.5e-4)  # the median of the fitted steps
    assert set(block["models"]["full"]["fitted"]) == {
        "compute",
        "bandwidth",
        "overhead_per_layer_s",
        "attention",
        "decode_attention",
        "copy",
        "copy_overhead_per_layer_s",
    }
    assert block["models"]["full"]["held_out_passes"]["max_abs_pct"] < 1e-6
    assert block["samples"]["skipped"] == 0 and block["samples"]["held_out"] >= 10
    # the plain roofline cannot express this CPU's slow attention: a worse fit, reported so
    assert block["models"]["plain"]["all_passes"]["median_abs_pct"] > 1.0
    assert "attention" not in block["models"]["plain"]["efficiency"]
    # the block gives the model back as fitted, against the peaks it was fitted to
    hw, eff = efficiency_from_block(block, CPU)
    again = analytic_from_config(hw, preset("tiny"), 32, name="tiny", kv_bits=32)
    for _, s in grid_shapes()[::7]:
        assert again.pass_seconds(s) == pytest.approx(truth.pass_seconds(s), rel=1e-4)


def test_fit_with_noise_stays_close_and_the_plain_fit_keeps_optional_factors_unset():
    truth = cpu_model(eff=TRUE)
    block = fit_local(profile_samples(truth, noise=0.03), preset("tiny"), name="tiny", hardware=CPU)
    full = block["models"]["full"]
    assert full["held_out_passes"]["median_abs_pct"] < 3.0
    assert full["efficiency"]["attention"] == pytest.approx(TRUE.attention, rel=0.15)
    assert full["efficiency"]["compute"] == pytest.approx(TRUE.compute, rel=0.15)
    # fit_efficiency without optional factors and a prior without them: the plain roofline
    res = fit_efficiency(
        [(s, truth.pass_seconds(s)) for _, s in grid_shapes()], cost_model=cpu_model(eff=Efficiency(0.2, 0.5, 1e-3))
    )
    assert res.efficiency.attention is None and res.efficiency.copy is None
    # an optional factor the samples say nothing about (no join or leave: no copy) stays unset
    no_copies = [(s, truth.pass_seconds(s)) for g, s in grid_shapes() if g in ("decode", "prefill")]
    res = fit_efficiency(
        no_copies,
        cost_model=cpu_model(eff=Efficiency(0.2, 0.5, 1e-3)),
        optional=("attention", "decode_attention", "copy"),
    )
    assert "copy" not in res.fitted and res.efficiency.copy is None
    assert any(n.startswith("copy ") for n in res.notes)
    assert res.efficiency.attention == pytest.approx(TRUE.attention, rel=1e-4)
    with pytest.raises(AnalyticError, match="optional"):
        fit_efficiency([(PassShape(decode_contexts=(5,)), 0.01)], cost_model=truth, optional=("nope",))


def test_fit_local_needs_readable_samples():
    with pytest.raises(AnalyticError, match="at least 4"):
        fit_local(
            [{"group": "step", "label": "s", "seconds": 1e-4, "features": {"s_step": 1.0}}],
            preset("tiny"),
            hardware=CPU,
        )


# ---------------------------------------------------------------------- the engine side


@pytest.fixture(scope="module")
def micro():
    from schedlab.engine.models import load_model

    return load_model("micro")


def _profile_for(info, samples, block=None):
    """A profile as calibrate writes it (linear fit and report included) around ``samples``."""
    from schedlab.engine.calibrate import _blas_key
    from schedlab.analysis.fit import Sample, fit_profile

    meta = info.metadata()
    coef, report = fit_profile([Sample.from_json(s) for s in samples])
    prof = {
        "schema": "schedlab-profile/1",
        "model": meta["model"],
        "dtype": meta["dtype"],
        "parameters": meta["parameters"],
        "blas": _blas_key(meta["blas"]),
        "machine": meta["machine"],
        "kv_tokens": 262144,
        "calibration": {"grid": "synthetic", "seed": 0, "samples": len(samples), "wall_s": 0.0},
        "coefficients": coef,
        "fit_report": report,
        "samples": samples,
    }
    if block is not None:
        prof[BLOCK_KEY] = block
    return prof


def test_validate_picks_fitted_factors_then_samples_then_priors(micro, tmp_path, monkeypatch):
    from schedlab.engine.calibrate import fit_analytic
    from schedlab.api._validation import analytic_cost

    monkeypatch.setenv("SCHEDLAB_CACHE_DIR", str(tmp_path))
    cost, meta = analytic_cost("cpu-local", micro)
    assert meta["kind"] == "analytic" and meta["factors"] == "prior" and "calibrate --analytic" in meta["factors_note"]
    assert cost.efficiency == DEFAULT_EFFICIENCY["cpu"] and cost.bits == 32 and cost.kv_bits == 32
    hw = cost.hardware
    truth = analytic_from_config(hw, micro.config, 32, name="micro", kv_bits=32, efficiency=TRUE)
    samples = profile_samples(truth)
    cached = tmp_path / "profiles" / f"micro-{micro.dtype}-{micro.n_params}.json"
    cached.parent.mkdir()
    cached.write_text(json.dumps(_profile_for(micro, samples)))
    cost, meta = analytic_cost("cpu-local", micro)
    assert meta["factors"] == "fitted-now" and str(cached) in meta["factors_note"]
    assert cost.efficiency.attention == pytest.approx(TRUE.attention, rel=1e-4)
    block = fit_analytic(samples, micro)
    block["models"]["full"]["efficiency"]["compute"] = 0.0777  # a stored block wins over the samples
    cached.write_text(json.dumps(_profile_for(micro, samples, block)))
    cost, meta = analytic_cost("cpu-local", micro)
    assert meta["factors"] == "fitted" and cost.efficiency.compute == 0.0777
    cost, meta = analytic_cost("m4-max", micro)  # another preset: its own factors, said so
    assert meta["factors"] == "preset" and cost.hardware.name == "m4-max"


@pytest.mark.slow
def test_calibrate_analytic_from_a_stored_profile(micro, tmp_path):
    truth = analytic_from_config(CPU, micro.config, 32, name="micro", kv_bits=32, efficiency=TRUE)
    src = tmp_path / "src.json"
    src.write_text(json.dumps(_profile_for(micro, profile_samples(truth))))
    out = tmp_path / "out.json"
    env = {"SCHEDLAB_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [*command("calibrate"), "--model", "micro", "--analytic", "--from-profile", str(src), "--out", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    assert "with attention and copy factors" in proc.stdout
    prof = json.loads(out.read_text())
    assert prof[BLOCK_KEY]["model"] == "micro" and prof[BLOCK_KEY]["samples"]["skipped"] == 0
    assert "## Analytic roofline on cpu-local" in out.with_suffix(".md").read_text()
    bad = subprocess.run(
        [*command("calibrate"), "--model", "tiny", "--analytic", "--from-profile", str(src), "--out", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert bad.returncode != 0 and len(lines) == 1 and "not measured on this model" in lines[0]


@pytest.mark.slow
def test_validate_hardware_cpu_local_end_to_end(tmp_path):
    """A seconds-long trace on the micro model: the simulated side and the real runs'
    predictions both come from the analytic model (here with its prior factors)."""
    reqs = [Request("a", 0.0, 40, 6), Request("b", 0.0, 24, 4), Request("c", 0.05, 16, 5)]
    trace = tmp_path / "tiny-trace.json"
    trace.write_text(
        json.dumps(
            {
                "name": "tiny-trace",
                "description": "test",
                "requests": [
                    {
                        "id": r.id,
                        "arrival_s": r.arrival_s,
                        "prompt_tokens": r.prompt_tokens,
                        "output_tokens": r.output_tokens,
                    }
                    for r in reqs
                ],
            }
        )
    )
    out = tmp_path / "val"
    env = {**__import__("os").environ, "SCHEDLAB_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [
            *command("validate"),
            "--policy",
            "mlx-default",
            "--trace",
            str(trace),
            "--model",
            "micro",
            "--hardware",
            "cpu-local",
            "--out",
            str(out),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "prior factors" in proc.stderr and "per-step cost-model error" in proc.stdout
    v = json.loads((out / "validation.json").read_text())
    assert v["policy"] == "mlx-default" and v["trace"] == "tiny-trace"
    assert set(v["metrics"]) == {k for k, _, _ in METRICS}
    for key, row in v["metrics"].items():
        assert {"sim", "real", "error_pct"} <= set(row), key
        assert row["error_pct"] == pytest.approx(100 * (row["sim"] - row["real"]) / row["real"]), key
    errs = [abs(r["error_pct"]) for r in v["metrics"].values() if r["error_pct"] is not None]
    assert v["median_abs_error_pct"] is not None and v["max_abs_error_pct"] == pytest.approx(max(errs))
    se = v["step_error_pct"]
    assert se["n"] > 0 and 0 <= se["p50"] <= se["p90"]
    assert v["cost_model"]["kind"] == "analytic" and v["cost_model"]["factors"] == "prior"
    assert v["cost_model"]["analytic"]["cost_model"] == "analytic-roofline"
    # the same analytic model, built here, reproduces the simulated steps exactly...
    import os

    os.environ["SCHEDLAB_CACHE_DIR"] = env["SCHEDLAB_CACHE_DIR"]  # the same cpu-local measurement
    try:
        cm = analytic_from_config("cpu-local", preset("micro"), 32, name="micro", kv_bits=32)
    finally:
        del os.environ["SCHEDLAB_CACHE_DIR"]
    res = run_replica(reqs, make_policy("mlx-default"), cm, kv_capacity=262144, trace_name="tiny-trace")
    sim_pred = [float(r["predicted_s"]) for r in read_table(out / "sim" / "steps.parquet")]
    assert sim_pred == pytest.approx([s.predicted_s for s in res.steps], rel=1e-9)
    # ...and the real run's first step (the same plan at t = 0) was predicted by it too
    real_rows = read_table(out / "real" / "steps.parquet")
    assert float(real_rows[0]["predicted_s"]) == pytest.approx(res.steps[0].predicted_s, rel=1e-9)
    assert all(math.isfinite(float(r["measured_s"])) for r in real_rows)
