"""Predictions a user can trust (issue 13): what real runs log for a fit, the fit from real runs
(whole runs held out, candidate terms), the after-idle terms in the loop, the residual table and
the running bias. No timing assertions: real runs only provide shapes and seconds to fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schedlab.policies import make_policy
from schedlab.policies.base import PassShape
from schedlab.sim import run_replica
from schedlab.sim.cost import IDLE_CAP_S, LinearCostModel
from schedlab.sim.features import COLUMNS, STEP_TERMS, step_table
from simkit import command, KNOWN
from schedlab.traces.schema import Request

from test_loop import FixedBackend

BIN = Path(sys.executable).parent


def cli(name, *args):
    return subprocess.run([*command(name), *args], capture_output=True, text=True, timeout=600)


# ---------------------------------------------------------------------------- the loop


def test_idle_terms_charge_only_the_step_after_a_wait():
    reqs = [Request("A", 0.0, 10, 3), Request("B", 0.5, 5, 2), Request("C", 10.0, 4, 1)]
    plain = LinearCostModel({"d_pass": 0.001, "p_pass": 0.002, "s_step": 0.0005})
    idle = LinearCostModel({**plain.coefficients, "i_wake": 0.25, "i_step": 0.5, "i_gap": 0.125})
    # a measuring backend (no step overhead, its own seconds): the prediction carries the extra
    a = run_replica(reqs, make_policy("unified"), plain, kv_capacity=1000, backend=FixedBackend())
    b = run_replica(reqs, make_policy("unified"), idle, kv_capacity=1000, backend=FixedBackend())
    assert [s.start_s for s in a.steps] == [s.start_s for s in b.steps]  # a wall clock is not moved
    assert b.wakes == a.wakes == {3: (10.0 - 2.25, 0.0)}
    extra = [y.predicted_s - x.predicted_s for x, y in zip(a.steps, b.steps)]
    assert extra[:3] == [0.0, 0.0, 0.0] and extra[3] == pytest.approx(0.5 + 0.125 * IDLE_CAP_S)
    # a simulation: the replica starts i_wake after the arrival, and the step costs the extra
    sim = run_replica(reqs, make_policy("unified"), idle, kv_capacity=1000)
    last = sim.steps[-1]
    assert last.start_s == pytest.approx(10.25)
    assert last.end_s - last.start_s == pytest.approx(0.0005 + 0.002 + 0.5 + 0.125)
    assert sim.wakes[last.index] == pytest.approx((10.0 - sim.steps[-2].end_s, 0.0))
    # without idle terms a simulation is what it always was
    base = run_replica(reqs, make_policy("unified"), plain, kv_capacity=1000)
    assert base.steps[-1].start_s == 10.0 and not base.shapes


def test_the_steps_after_a_wake_pay_i_after_halving_and_runs_of_repeats_stay_exact():
    """The k-th step after a wake pays i_after x 0.5^(k-1) (k = 1 .. AFTER_WAKE_STEPS), the wake's own
    step the idle terms only, later steps nothing; in a real run's prediction and in a simulation's
    time alike. A simulation that runs repeated decode steps in bulk gives the same steps as one
    planned step by step (a callback on every step turns the bulk runs off)."""
    from schedlab.sim.cost import AFTER_WAKE_STEPS

    reqs = [Request("A", 0.0, 10, 9), Request("B", 5.0, 6, 9), Request("C", 5.05, 6, 4), Request("D", 20.0, 3, 12)]
    plain = LinearCostModel({"d_pass": 0.001, "p_pass": 0.002, "s_step": 0.0005, "i_step": 0.01})
    after = LinearCostModel({**plain.coefficients, "i_after": 0.004})
    a = run_replica(reqs, make_policy("unified"), plain, kv_capacity=1000, backend=FixedBackend())
    b = run_replica(reqs, make_policy("unified"), after, kv_capacity=1000, backend=FixedBackend())
    assert a.wakes.keys() == b.wakes.keys() and len(b.wakes) == 2  # B's arrival, D's (A's is at 0)

    def charged(res):
        out, k = [], None
        for st in res.steps:
            k = 0 if st.index in res.wakes else (None if k is None else k + 1)
            out.append(0.004 * 0.5 ** (k - 1) if k and k <= AFTER_WAKE_STEPS else 0.0)
        return out

    want = charged(b)
    extra = [y.predicted_s - x.predicted_s for x, y in zip(a.steps, b.steps)]
    assert extra == pytest.approx(want, abs=1e-12) and sum(w > 0 for w in want) >= 2 * AFTER_WAKE_STEPS
    t = step_table(b)  # what a fit reads: the feature, from the wakes alone
    assert np.allclose(0.004 * t["i_after"], want, atol=1e-12)
    # a simulation: the steps take that much longer
    sa = run_replica(reqs, make_policy("unified"), plain, kv_capacity=1000)
    sb = run_replica(reqs, make_policy("unified"), after, kv_capacity=1000)
    assert [(s.decode_rows, s.prefill_tokens) for s in sa.steps] == [
        (s.decode_rows, s.prefill_tokens) for s in sb.steps
    ]
    durations = [(y.end_s - y.start_s) - (x.end_s - x.start_s) for x, y in zip(sa.steps, sb.steps)]
    assert durations == pytest.approx(charged(sb), abs=1e-9) and sum(d > 0 for d in durations) >= 2 * AFTER_WAKE_STEPS
    for name in ("mlx-default", "static", "vllm"):  # policies that plan runs of repeats
        bulk = run_replica(reqs, make_policy(name), after, kv_capacity=1000)
        one_by_one = run_replica(reqs, make_policy(name), after, kv_capacity=1000, on_step=lambda state: None)
        assert [(s.start_s, s.end_s, s.decode_rows) for s in bulk.steps] == [
            (s.start_s, s.end_s, s.decode_rows) for s in one_by_one.steps
        ], name


def test_a_measured_run_keeps_every_pass_shape_and_its_features_sum_to_the_prediction():
    reqs = [Request(str(i), 0.3 * i if i % 3 else 2.0 * i, 20 + 7 * i, 3 + i % 4) for i in range(9)]
    cm = LinearCostModel(
        {
            **KNOWN,
            "c_join_row": 3e-4,
            "c_leave_row": 1e-4,
            "s_pass": 2e-4,
            "i_step": 0.01,
            "i_gap": 0.02,
            "i_after": 0.003,
        }
    )
    for name in ("chunked-prefill", "mlx-default", "unified"):
        res = run_replica(reqs, make_policy(name), cm, kv_capacity=10**6, backend=FixedBackend())
        assert len(res.shapes) == len(res.passes) and all(isinstance(s, PassShape) for s in res.shapes)
        t = step_table(res)
        assert set(t) == set(COLUMNS) and len(t["step"]) == len(res.steps)
        # the features are the cost model's own prediction, term by term
        pred = sum(cm.coefficients.get(k, 0.0) * t[k] for k in STEP_TERMS)
        assert np.allclose(pred, t["predicted_s"], rtol=1e-9, atol=1e-12), name
        assert np.allclose(t["measured_s"], t["passes_s"] + t["overhead_s"])
        assert t["after_idle"].sum() == len(res.wakes) >= 1
        assert (t["batch_changed"] == ((t["joins"] + t["leaves"]) > 0)).all()
        assert (t["after_change"][1:] == t["batch_changed"][:-1]).all()


# ---------------------------------------------------------------------------- real runs (micro)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two real runs of the micro model (seconds each), as run-real writes them."""
    root = tmp_path_factory.mktemp("runs")
    dirs, outs = [], []
    for pol in ("unified", "chunked-prefill"):
        d = root / pol
        proc = cli(
            "run-real", "--policy", pol, "--trace", "real-smoke", "--model", "micro", "--no-calibrate", "--out", str(d)
        )
        assert proc.returncode == 0, proc.stderr
        dirs.append(d)
        outs.append(proc.stdout)
    return dirs, outs


@pytest.mark.slow
def test_run_real_writes_features_and_prints_the_running_bias(recorded):
    from schedlab.sim.features import read_features

    dirs, outs = recorded
    for d, out in zip(dirs, outs):
        assert "cost model on this run: measured/predicted median" in out
        assert "total predicted" in out and "vs measured" in out
        t = read_features(d)
        steps = __import__("pandas").read_parquet(d / "steps.parquet")
        assert len(t["step"]) == len(steps) and (t["measured_s"] > 0).all()
        assert np.allclose(t["measured_s"], steps["measured_s"]) and np.allclose(t["predicted_s"], steps["predicted_s"])
        assert t["after_idle"].sum() >= 1  # real-smoke's later requests find the replica idle
        meta = json.loads((d / "meta.json").read_text())
        assert meta["step_bias"]["steps"] == len(steps) and "gc_off" in meta["noise"]


@pytest.mark.slow
def test_calibrate_from_runs_reproduces_the_steps_within_the_error_it_reports(
    recorded, micro_quick_calibration, tmp_path
):
    from schedlab.analysis.runfit import load_runs, predict
    from schedlab.sim.features import read_features

    dirs, _ = recorded
    out = tmp_path / "runs.json"
    proc = cli("calibrate", "--from-runs", *map(str, dirs), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "held-out steps" in proc.stdout and "leave one run out" in proc.stdout
    prof = json.loads(out.read_text())
    rep = prof["runs_report"]
    assert prof["model"] == "micro" and prof["calibration"]["kind"] == "runs" and len(rep["runs"]) == 2
    assert set(rep["held_out_per_run"]) == {str(d) for d in dirs}
    coef = prof["coefficients"]
    # the profile's coefficients give back the errors the report states, over the same steps
    cols = [read_features(d) for d in dirs]
    pred = np.concatenate([predict(coef, c) for c in cols])
    meas = np.concatenate([c["measured_s"] for c in cols])
    err = np.abs(pred - meas) / meas * 100
    assert np.median(err) == pytest.approx(rep["fit"]["all"]["median_abs_pct"], rel=1e-6)
    assert "step_jitter" not in prof and "step_spread" not in rep  # the simulator predicts the mean only
    assert 100 * (pred.sum() - meas.sum()) / meas.sum() == pytest.approx(
        rep["fit"]["all"]["total_pct"], rel=1e-6, abs=1e-9
    )
    # a directory tree is searched, not required flat: the runs' parent gives both runs
    assert sorted(r.path for r in load_runs([dirs[0].parent])) == sorted(dirs)
    # a real run with the new profile predicts every step as the fit did (one formula)
    d = tmp_path / "check"
    proc = cli(
        "run-real",
        "--policy",
        "unified",
        "--trace",
        "real-smoke",
        "--model",
        "micro",
        "--profile",
        str(out),
        "--out",
        str(d),
        "-q",
    )
    assert proc.returncode == 0, proc.stderr
    t = read_features(d)
    assert np.allclose(predict(coef, t), t["predicted_s"], rtol=1e-9, atol=1e-12)
    # with the grid underneath: a joint fit with the grid's passes as rows, its samples kept for speed checks
    proc, grid = micro_quick_calibration  # calibrate --quick --model micro --out GRID -q (conftest: once a session)
    assert proc.returncode == 0, proc.stderr
    both = tmp_path / "both.json"
    proc = cli("calibrate", "--from-runs", *map(str, dirs), "--grid", str(grid), "--out", str(both))
    assert proc.returncode == 0, proc.stderr
    p2 = json.loads(both.read_text())
    assert p2["calibration"]["kind"] == "grid+runs" and p2["samples"] and p2["fit_report"]["decode"]
    assert "held-out passes" in proc.stdout and "held-out steps" in proc.stdout


def test_calibrate_from_runs_bad_inputs(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    for args, frag in (
        (["--from-runs", str(tmp_path / "nope")], "no such run directory"),
        (["--from-runs", str(tmp_path / "afile")], "is a file, not a run directory"),
        (["--from-runs", str(tmp_path / "empty")], "no features.parquet"),
        (["--from-runs"], "one or more run directories"),
        ([str(tmp_path)], "go with --from-runs"),
    ):
        proc = cli("calibrate", *args, "--out", str(tmp_path / "p.json"))
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and frag in lines[0], proc.stderr


def test_noise_settings_parse_and_apply():
    import gc

    from schedlab.engine.errors import EngineError
    from schedlab.engine.noise import Noise

    n = Noise.parse("gc-off,warmup=3")
    assert n.gc_off and n.warmup == 3 and n.pin is None and Noise.parse(n.spec()) == n
    assert Noise.parse("") == Noise()
    for bad in ("fast", "warmup=x", "pin=99999"):
        with pytest.raises(EngineError):
            Noise.parse(bad)
    was = gc.isenabled()
    with Noise(gc_off=True).active():
        assert not gc.isenabled()
    assert gc.isenabled() == was
    k = Noise.parse("malloc-keep,gc-off")
    assert k.malloc_keep and k.gc_off and Noise.parse(k.spec()) == k and k.describe()["malloc_keep"]
    c = Noise.parse("mlx-cache=512m")
    assert c.mlx_cache == 512 << 20 and Noise.parse(c.spec()) == c and c.describe()["mlx_cache"] == 512 << 20
    assert Noise.parse("mlx-cache=2GiB").mlx_cache == 2 << 30 and Noise.parse("mlx-cache=0").mlx_cache == 0
    for bad in ("mlx-cache=lots", "mlx-cache=-1g", "mlx-cache"):
        with pytest.raises(EngineError):
            Noise.parse(bad)


def test_mlx_cache_keeps_freed_buffers_for_reuse_and_is_restored():
    """``mlx-cache=SIZE``: a freed 64 MiB MLX array stays in MLX's buffer cache (by default, 32
    MiB, it is handed back), and the previous limit is back when the setting is left."""
    code = (
        "import sys\n"
        "from schedlab import engine\n"
        "import mlx.core as mx\n"
        "from schedlab.engine.noise import Noise\n"
        "before = mx.set_cache_limit(0); mx.set_cache_limit(before)\n"
        "with Noise.parse(sys.argv[1]).active():\n"
        "    a = mx.ones((16 << 20,), dtype=mx.float32); mx.eval(a); del a\n"
        "    kept = mx.get_cache_memory()\n"
        "after = mx.set_cache_limit(before)\n"
        "print(kept, before, after)\n"
    )
    got = {}
    for spec in ("", "mlx-cache=1g"):
        r = subprocess.run(
            [sys.executable, "-c", code, spec],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        got[spec] = [int(x) for x in r.stdout.split()[-3:]]
    assert got[""][0] < 64 << 20 <= got["mlx-cache=1g"][0], got
    assert got["mlx-cache=1g"][1] == got["mlx-cache=1g"][2], got  # the limit it found is restored


def test_malloc_keep_keeps_freed_memory_in_the_process():
    """With ``malloc-keep`` a freed 16 MiB block is used again without faulting its pages in
    again; by default (glibc hands such a block back to the system) they fault in anew. Each in
    its own process: the setting holds for the rest of the process."""
    code = (
        "import resource, sys\n"
        "from schedlab.engine.noise import Noise\n"
        "def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "with Noise.parse(sys.argv[1]).active():\n"
        "    b = bytearray(16 << 20); del b\n"
        "    f0 = faults(); b = bytearray(16 << 20); print(faults() - f0)\n"
    )
    pages = (16 << 20) // 4096
    got = {}
    for spec in ("", "malloc-keep"):
        r = subprocess.run(
            [sys.executable, "-c", code, spec],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        got[spec] = int(r.stdout.split()[-1])
    assert got[""] > pages // 2, got  # the measurement sees the faults a fresh block takes
    assert got["malloc-keep"] < pages // 20, got


def test_speed_matched_takes_out_the_speed_a_real_run_ran_at_and_nothing_else():
    """Two stand-in real runs of a bundled real trace on a machine 1.25x and 0.85x as slow as the
    cost model says (every pass, the scheduler's work and waking from idle; the policy plans with
    the model, as a real run's does): the plain comparison is off by about that much, each run's
    own speed is read back from its steps, and the simulations at those speeds match the runs."""
    from schedlab import traces
    from schedlab.api._validation import run_speed, speed_matched
    from schedlab.sim import summarize
    from schedlab.sim.backend import SimBackend
    from schedlab.analysis.validation import compare

    cost = LinearCostModel.from_profile(Path(__file__).resolve().parents[1] / "sim" / "profiles" / "tiny-cpu.json")
    tr = traces.load("real-mixed")
    cap = 200_000
    planted = [1.25, 0.85]
    reals, speeds, steps = [], [], []
    for f in planted:
        machine = LinearCostModel(dict(cost.coefficients), meta=cost.meta)  # not the policy's object: a measured run
        res = run_replica(
            tr.requests,
            make_policy("chunked-prefill"),
            cost,
            kv_capacity=cap,
            backend=SimBackend(machine, time_scale=f),
            trace_name=tr.name,
        )
        assert res.error is None
        reals.append(summarize(res))
        speeds.append(run_speed(step_table(res)))
        steps.append(res.steps)
    assert speeds == pytest.approx(planted, rel=1e-3)
    plain = compare(
        summarize(run_replica(tr.requests, make_policy("chunked-prefill"), cost, kv_capacity=cap, trace_name=tr.name)),
        reals[:1],
        policy="chunked-prefill",
        trace=tr.name,
    )
    assert plain["metrics"]["itl_ms.p50"]["error_pct"] == pytest.approx(-20.0, abs=2.0)  # 1/1.25
    m = speed_matched(make_policy("chunked-prefill"), tr, cost, cap, reals, speeds, steps)
    assert m["speeds"] == pytest.approx(planted, rel=1e-3)
    assert m["max_abs_error_pct"] < 0.5, m["error_pct"]
    # every step against its prediction at its own run's speed: exact; at the other run's, not
    assert m["step_ratio_median"] == pytest.approx(1.0, rel=1e-3) and m["step_ratio_mean"] == pytest.approx(
        1.0, rel=1e-3
    )
    crossed = speed_matched(make_policy("chunked-prefill"), tr, cost, cap, reals, speeds[::-1], steps)
    assert abs(crossed["step_ratio_median"] - 1.0) > 0.3  # one run's steps at 1.47x, the other's at 0.68x
    assert "step_ratio_median" not in speed_matched(make_policy("chunked-prefill"), tr, cost, cap, reals, speeds)
    # no speed taken out: the simulation at 1.0 against the runs' median (about 1.05x)
    none = speed_matched(make_policy("chunked-prefill"), tr, cost, cap, reals, [1.0, 1.0])
    assert none["error_pct"]["itl_ms.p50"] == pytest.approx(100 * (1 / 1.05 - 1), abs=1.0)
    assert speed_matched(make_policy("chunked-prefill"), tr, cost, cap, reals, [None, 1.0]) is None
    with pytest.raises(ValueError):
        SimBackend(cost, time_scale=0.0)
