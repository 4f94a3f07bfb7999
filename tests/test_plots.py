"""plot: figures from run directories. Numbers drawn are checked against the run, not pixels.

Run directories are made by the real pieces (sim.run, summarize, write_run); the "real"
half of a validation directory is a real-mode run (RealtimeEnvironment) whose backend
sleeps what a second, different cost model predicts, so measured and predicted differ.
The cost coefficients are made up for the tests and mean nothing about any machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import schedlab
from schedlab.policies import make_policy
from schedlab.sim import WallClock, run_replica, summarize
from schedlab.sim.cost import LinearCostModel
from schedlab.sim.output import write_run
from schedlab.analysis import plots
from simkit import drawn_fraction, pixels_of, png_rgb, read_table
from schedlab.traces.schema import Request

COEFFS = {
    "d_pass": 0.02,
    "d_rows": 0.001,
    "d_kv": 1e-6,
    "p_pass": 0.01,
    "p_tokens": 2e-4,
    "p_attn": 1e-8,
    "s_step": 0.001,
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_requests():
    # a burst, a lull, a second burst; one request with a single output token (no decode rate)
    spec = [
        (0.0, 300, 40),
        (0.05, 120, 25),
        (0.1, 600, 30),
        (0.12, 50, 1),
        (0.4, 200, 20),
        (1.5, 80, 35),
        (1.52, 400, 15),
        (1.55, 90, 28),
        (1.6, 700, 10),
        (2.4, 60, 22),
        (2.45, 150, 18),
        (3.0, 30, 12),
    ]
    return [Request(f"q{i}", a, p, o) for i, (a, p, o) in enumerate(spec)]


def simulate_to(out: Path, policy: str, requests, cost=None, **opts):
    cost = cost or LinearCostModel(dict(COEFFS))
    result = run_replica(requests, make_policy(policy, opts), cost, kv_capacity=100_000, trace_name="t")
    write_run(out, result, summarize(result))
    return result


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    reqs = make_requests()
    res = {
        "pp": (base / "pp", simulate_to(base / "pp", "prefer-prefill", reqs)),
        "cp": (base / "cp", simulate_to(base / "cp", "chunked-prefill", reqs, budget=256)),
    }
    return res


def _ttft_ms(result):
    return sorted((r.first_token_s - r.arrival_s) * 1e3 for r in result.requests if r.finish_s is not None)


def _itl_ms(result):
    return sorted(
        float(g) * 1e3 for r in result.requests if r.finish_s is not None for g in np.diff(np.asarray(r.token_times))
    )


# ---------------------------------------------------------------- CDFs


@pytest.mark.parametrize("metric", ["ttft", "itl"])
def test_cdf_draws_the_runs_values_and_marks_summary_percentiles(runs, tmp_path, metric):
    loaded = [plots.load_run(path) for path, _ in runs.values()]
    plots._unique_labels(loaded)
    d = plots.plot_cdf(loaded, metric, tmp_path, formats=("png",))
    assert [p.name for p in d["files"]] == [f"{metric}_cdf.png"]
    (ax,) = d["figure"].axes
    img = png_rgb(d["files"][0])
    assert img.shape[:2] == (550, 935)  # 8.5 x 5 in at 110 dpi
    for (path, result), run_data in zip(runs.values(), loaded):
        drawn = d["runs"][run_data.label]
        expected = _ttft_ms(result) if metric == "ttft" else _itl_ms(result)
        # the curve: every value of the run, sorted, against i/n
        np.testing.assert_allclose(drawn["x"], expected, rtol=1e-12)
        n = len(expected)
        assert drawn["n"] == n
        np.testing.assert_allclose(drawn["y"], np.arange(1, n + 1) / n)
        # ... and so it is on the figure's axes (a step from 0 up through every value) and in
        # the file, in the run's colour (its markers and legend line alone leave ~120 pixels)
        (curve,) = [line for line in ax.get_lines() if line.get_label().startswith(f"{run_data.label}: p50 ")]
        np.testing.assert_allclose(curve.get_xdata(), np.r_[expected[0], expected], rtol=1e-12)
        np.testing.assert_allclose(curve.get_ydata(), np.r_[0.0, np.arange(1, n + 1) / n])
        assert pixels_of(img, curve.get_color()) > 300, run_data.label
        # the markers: the summary's p50 and p99
        summary = json.loads((path / "summary.json").read_text())[f"{metric}_ms"]
        assert drawn["p50"] == pytest.approx(summary["p50"], rel=1e-12)
        assert drawn["p99"] == pytest.approx(summary["p99"], rel=1e-12)
    if metric == "itl":  # one gap per output token after the first, finished requests only
        assert d["runs"][loaded[0].label]["n"] == sum(r.output_tokens - 1 for r in make_requests())


class StopsAtStep:
    """A user policy that raises mid-run: the run keeps what it did, some requests unfinished."""

    name = "stops"

    def __init__(self, at):
        self.inner, self.at = make_policy("chunked-prefill", {"budget": 256}), at

    def plan(self, view):
        if view.step_index >= self.at:
            raise RuntimeError("stop")
        return self.inner.plan(view)


def test_a_summary_computed_while_the_tables_are_written_is_the_same(tmp_path):
    """write_run takes the summary as a function, asked once while the tables are written in
    the background: on a run that stopped with rows still in the batch (their token times
    not yet copied out), the files equal those written from a summary made beforehand."""

    def stopped():
        return run_replica(make_requests(), StopsAtStep(40), LinearCostModel(dict(COEFFS)), kv_capacity=100_000)

    eager = stopped()
    write_run(tmp_path / "eager", eager, summarize(eager))
    lazy, calls = stopped(), []
    assert any(r._seg >= 0 and len(r._times) > r._seg for r in lazy.requests)  # times pending in the batch

    def summary():
        calls.append(1)
        return summarize(lazy)

    write_run(tmp_path / "lazy", lazy, summary)
    assert calls == [1]
    for name in ("summary.json", "requests.csv"):
        assert (tmp_path / "lazy" / name).read_bytes() == (tmp_path / "eager" / name).read_bytes(), name
    for name in ("tokens.parquet", "steps.parquet", "passes.parquet"):
        pd.testing.assert_frame_equal(
            pd.read_parquet(tmp_path / "lazy" / name), pd.read_parquet(tmp_path / "eager" / name)
        )


def test_cdfs_of_a_run_that_stopped_early_leave_out_unfinished_requests(tmp_path):
    res = run_replica(make_requests(), StopsAtStep(40), LinearCostModel(dict(COEFFS)), kv_capacity=100_000)
    assert res.error and any(r.finish_s is None and r.token_times for r in res.requests)
    write_run(tmp_path / "r", res, summarize(res))
    r = plots.load_run(tmp_path / "r")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    d = plots.plot_cdf([r], "itl", tmp_path, formats=("png",))["runs"][r.label]
    np.testing.assert_allclose(d["x"], _itl_ms(res), rtol=1e-12)
    assert d["p99"] == pytest.approx(summary["itl_ms"]["p99"], rel=1e-12)
    assert plots.check_against_summary(r) == []
    t = plots.plot_timeline(r, tmp_path, "tl", formats=("png",))
    unfinished = [q for q in res.requests if q.finish_s is None and q.token_times]
    for q in unfinished:  # drawn up to where it got
        assert max(e for rid, _, _, e in t["segments"] if rid == q.id) <= res.steps[-1].end_s


def test_labels_name_policy_and_mode_and_stay_unique(runs):
    a = plots.load_run(runs["pp"][0])
    b = plots.load_run(runs["pp"][0])
    c = plots.load_run(runs["cp"][0])
    group = [a, b, c]
    plots._unique_labels(group)
    assert c.label == "chunked-prefill (sim)"
    assert a.label.startswith("prefer-prefill (sim)") and len({a.label, b.label, c.label}) == 3


# ---------------------------------------------------------------- decode rates


def test_decode_rate_bars_are_the_requests_rates_sorted_with_the_summary_median(runs, tmp_path):
    loaded = [plots.load_run(path) for path, _ in runs.values()]
    d = plots.plot_decode_rates(loaded, tmp_path, formats=("png",))
    for (path, result), run_data in zip(runs.values(), loaded):
        bars = d["runs"][run_data.label]
        rates = {
            r.id: (r.output_tokens - 1) / (r.finish_s - r.first_token_s) for r in result.requests if r.output_tokens > 1
        }
        heights = np.asarray(bars["heights"])
        assert np.all(np.diff(heights) >= 0)  # ascending
        assert sorted(bars["ids"]) == sorted(rates)  # the one-token request has no bar
        assert "q3" not in bars["ids"]
        for rid, h in zip(bars["ids"], heights):
            assert h == pytest.approx(rates[rid], rel=1e-12)
        summary = json.loads((path / "summary.json").read_text())
        assert bars["median"] == pytest.approx(summary["decode_rate_tok_s"]["p50"], rel=1e-12)
        med = float(np.median(list(rates.values())))
        assert sorted(bars["starved"]) == sorted(k for k, v in rates.items() if v < 0.5 * med)


# ---------------------------------------------------------------- timeline


def without_passes(path: Path, tmp_path: Path) -> Path:
    """A copy of a run directory without passes.parquet (the timeline falls back to tokens)."""
    import shutil

    d = tmp_path / f"{path.name}-nopasses"
    shutil.copytree(path, d)
    (d / "passes.parquet").unlink()
    return d


def test_timeline_from_tokens_ends_each_segment_at_its_token(runs, tmp_path):
    path, result = runs["cp"]
    r = plots.load_run(without_passes(path, tmp_path))
    d = plots.plot_timeline(r, tmp_path, "tl", lanes=5, formats=("png",))
    assert d["source"] == "tokens"
    by_arrival = sorted(result.requests, key=lambda q: q.arrival_s)
    assert d["lanes"] == [q.id for q in by_arrival[:5]]
    steps = [(s.start_s, s.end_s) for s in result.steps]
    for q in by_arrival[:5]:
        mine = [s for s in d["segments"] if s[0] == q.id]
        assert [k for _, k, _, _ in mine] == ["first"] + ["decode"] * (q.output_tokens - 1)
        assert [e for _, _, _, e in mine] == pytest.approx(q.token_times, rel=1e-12)
        for _, _, start, end in mine:  # inside the step that produced the token
            ((s0, s1),) = [(a, b) for a, b in steps if a < end <= b]
            assert s0 <= start < end <= s1


def test_timeline_single_pass_steps_span_the_step(runs, tmp_path):
    # prefer-prefill runs one pass per step here, so each token's segment is its whole step
    path, result = runs["pp"]
    assert all(s.passes == 1 for s in result.steps)
    d = plots.plot_timeline(plots.load_run(without_passes(path, tmp_path)), tmp_path, "tl", formats=("png",))
    assert d["source"] == "tokens"
    start_of = {s.end_s: s.start_s for s in result.steps}
    assert len(d["segments"]) == sum(len(q.token_times) for q in result.requests)
    for _, _, start, end in d["segments"]:
        assert start == start_of[end]


def test_timeline_window_selects_requests_alive_in_it(runs, tmp_path):
    path, result = runs["cp"]
    d = plots.plot_timeline(plots.load_run(path), tmp_path, "tl", window=(1.5, 1.7), formats=("png",))
    alive = [
        q.id for q in sorted(result.requests, key=lambda q: q.arrival_s) if q.arrival_s <= 1.7 and q.finish_s >= 1.5
    ]
    assert d["lanes"] == alive and d["x_range"] == (1.5, 1.7)
    assert set(d["lanes"]) >= {"q5", "q6"} and "q0" not in d["lanes"]


def test_timeline_uses_passes_when_present(runs, tmp_path):
    path, result = runs["cp"]
    rows = read_table(path / "passes.parquet")
    # what the timeline will draw agrees with the run: every token ends a pass holding its
    # request, and each request's prefill chunks add up to its prompt (no preemption here)
    ends = {(r["request_id"], float(r["end_s"])) for r in rows}
    for q in result.requests:
        assert all((q.id, t) in ends for t in q.token_times)
        assert (
            sum(int(r["tokens"]) for r in rows if r["request_id"] == q.id and r["kind"] == "prefill") == q.prompt_tokens
        )
    d = plots.plot_timeline(plots.load_run(path), tmp_path, "tl", lanes=4, formats=("png",))
    assert d["source"] == "passes"
    lanes = set(d["lanes"])
    assert lanes == {q.id for q in sorted(result.requests, key=lambda q: q.arrival_s)[:4]}
    want = sorted(
        (r["request_id"], r["kind"], float(r["start_s"]), float(r["end_s"])) for r in rows if r["request_id"] in lanes
    )
    assert sorted(d["segments"]) == want


def test_bad_passes_kind_is_an_error(tmp_path):
    import pandas as pd

    out = tmp_path / "run"
    simulate_to(out, "chunked-prefill", make_requests()[:3])
    df = pd.read_parquet(out / "passes.parquet")
    df["kind"] = df["kind"].astype(str).str.replace("decode", "dekode", n=1)
    df.to_parquet(out / "passes.parquet")
    with pytest.raises(plots.RunDirError, match="kind must be decode or prefill"):
        plots.load_run(out)


# ---------------------------------------------------------------- validation directories


class SleepBackend:
    """A real-mode backend for tests: each pass sleeps what a second cost model predicts."""

    mode = "real"

    def __init__(self, cost):
        self.cost = cost

    def make_clock(self):
        return WallClock()

    def start(self, state, requests):
        pass

    def step_overhead(self, predicted_s):
        return 0.0

    def execute(self, p, shape, state):
        t = time.perf_counter()
        time.sleep(self.cost.pass_seconds(shape))
        return time.perf_counter() - t

    def release(self, r):
        pass

    def finish(self):
        return {}


@pytest.fixture(scope="module")
def validation_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("val") / "v1"
    reqs = [Request(f"v{i}", 0.01 * i, p, o) for i, (p, o) in enumerate([(40, 4), (90, 3), (20, 5), (60, 2)])]
    predict = LinearCostModel({"d_pass": 0.002, "d_rows": 0.0002, "p_pass": 0.002, "p_tokens": 2e-5, "s_step": 0.0002})
    truth = LinearCostModel({"d_pass": 0.003, "p_pass": 0.001, "p_tokens": 4e-5})
    sim_res = run_replica(reqs, make_policy("chunked-prefill", {"budget": 64}), predict, kv_capacity=10_000)
    write_run(base / "sim", sim_res, summarize(sim_res))
    real_res = run_replica(
        reqs, make_policy("chunked-prefill", {"budget": 64}), predict, kv_capacity=10_000, backend=SleepBackend(truth)
    )
    write_run(base / "real", real_res, summarize(real_res))
    (base / "validation.json").write_text(json.dumps({"policy": "chunked-prefill"}))
    return base, sim_res, real_res


def test_validation_overlays_and_step_scatter(validation_dir, tmp_path):
    base, sim_res, real_res = validation_dir
    assert plots.is_validation_dir(base)
    v = plots.load_validation(base)
    d = plots.plot_validation(v, tmp_path, "val", formats=("png",))
    assert sorted(p.name for p in d["files"]) == ["val_cdfs.png", "val_step_time.png"]
    # the files are these figures: their size, and the simulated curves in their colour
    for name, fig in d["figures"].items():
        w, h = fig.canvas.get_width_height()
        assert png_rgb(tmp_path / f"{name}.png").shape[:2] == (h, w), name
    assert pixels_of(png_rgb(tmp_path / "val_cdfs.png"), "#d1495b") > 300
    # on the CDF axes, each run's every value; on the scatter, every step (predicted, measured)
    axes = d["figures"]["val_cdfs"].axes
    for ax, values in zip(axes, (_ttft_ms, _itl_ms)):
        for prefix, res in (("measured (real): p50 ", real_res), ("simulated: p50 ", sim_res)):
            (curve,) = [line for line in ax.get_lines() if line.get_label().startswith(prefix)]
            np.testing.assert_allclose(curve.get_xdata()[1:], values(res), rtol=1e-12)
    points = np.concatenate([c.get_offsets() for c in d["figures"]["val_step_time"].axes[0].collections])
    want = [(s.predicted_s * 1e3, s.measured_s * 1e3) for s in real_res.steps]
    np.testing.assert_allclose(sorted(map(tuple, points)), sorted(want), rtol=1e-12)
    for mode, res in (("sim", sim_res), ("real", real_res)):
        summary = json.loads((base / mode / "summary.json").read_text())
        for metric in ("ttft", "itl"):
            drawn = d["cdfs"][metric][mode]
            assert drawn["p50"] == pytest.approx(summary[f"{metric}_ms"]["p50"], rel=1e-12)
            assert drawn["p99"] == pytest.approx(summary[f"{metric}_ms"]["p99"], rel=1e-12)
        np.testing.assert_allclose(d["cdfs"]["ttft"][mode]["x"], _ttft_ms(res), rtol=1e-12)
    pred = np.array([s.predicted_s for s in real_res.steps])
    meas = np.array([s.measured_s for s in real_res.steps])
    np.testing.assert_allclose(d["predicted_s"], pred, rtol=1e-12)
    np.testing.assert_allclose(d["measured_s"], meas, rtol=1e-12)
    assert d["median_abs_pct_error"] == pytest.approx(float(np.median(np.abs(pred - meas) / meas)) * 100)


def test_a_validation_of_several_policies_is_each_policys(validation_dir, tmp_path):
    # validate -p A,B --out DIR writes DIR/A, DIR/B (each a validation directory) and an overview
    base, _, _ = validation_dir
    import shutil

    top = tmp_path / "several"
    for name in ("b-policy", "a-policy"):
        shutil.copytree(base, top / name)
    (top / "validation.json").write_text(json.dumps({"policies": {"b-policy": {}, "a-policy": {}}}))
    assert plots.validation_dirs(top) == [top / "b-policy", top / "a-policy"]  # (the overview's order)
    assert plots.validation_dirs(base) == [base] and plots.validation_dirs(base / "sim") == []
    runs, vals = plots.load_inputs([top])
    assert [v.path for v in vals] == [top / "b-policy", top / "a-policy"] and len(runs) == 4
    figs = schedlab.plot(top, kinds="validation")
    assert sum(1 for name in figs if name.endswith("_cdfs")) == 2, list(figs)


def test_validation_dir_needs_measured_steps(validation_dir, tmp_path):
    base, _, _ = validation_dir
    fake = tmp_path / "v"
    fake.mkdir()
    (fake / "validation.json").write_text("{}")
    import shutil

    shutil.copytree(base / "sim", fake / "sim")
    shutil.copytree(base / "sim", fake / "real")  # a sim run posing as the real one
    with pytest.raises(plots.RunDirError, match="no step has measured_s"):
        plots.plot_validation(plots.load_validation(fake), tmp_path, formats=("png",))


# ---------------------------------------------------------------- the CLI


def cli(*args, cwd=None):
    code = "import sys; from schedlab.commands.plot import main; sys.argv[0] = 'plot'; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.mark.slow
def test_cli_writes_every_figure_in_both_formats(runs, validation_dir, tmp_path):
    out = tmp_path / "figs"
    base = validation_dir[0]
    p = cli(runs["pp"][0], base, "--out", out, "--lanes", "8")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    names = {f.name for f in out.iterdir()}
    stems = {
        "ttft_cdf",
        "itl_cdf",
        "decode_rate",
        "timeline_prefer-prefill-sim",
        "timeline_chunked-prefill-sim",
        "timeline_chunked-prefill-real",
        "validate_v1_cdfs",
        "validate_v1_step_time",
    }
    assert names == {f"{s}.{ext}" for s in stems for ext in ("png", "svg")}
    assert sorted(p.stdout.split()) == sorted(str(out / n) for n in names)
    for n in names:
        data = (out / n).read_bytes()
        assert len(data) > 1000
        if n.endswith(".png"):
            assert data.startswith(PNG_MAGIC)
        else:
            root = ET.fromstring(data)
            assert root.tag.endswith("svg")
    # each file is its figure as drawn here from the same directories: the PNG its size and
    # drawn on (not a blank page), the SVG carrying its titles (counts and labels of the runs)
    figures = plots.plot_all([runs["pp"][0], base], None, lanes=8).figures
    assert set(figures) == stems
    for stem, fig in figures.items():
        img = png_rgb(out / f"{stem}.png")
        w, h = fig.canvas.get_width_height()
        assert img.shape[:2] == (h, w), stem
        assert drawn_fraction(img) > 0.035, stem  # (these draw 4-30 % of the page; bare axes ~1.7 %)
        root = ET.fromstring((out / f"{stem}.svg").read_bytes())
        texts = {"".join(t.itertext()) for t in root.iter() if t.tag.endswith("text")}
        titles = [line for ax in fig.axes for line in ax.get_title().splitlines()]
        assert titles and set(titles) <= texts, (stem, set(titles) - texts)


@pytest.mark.slow
def test_cli_default_out_is_run_dir_plots_and_format_option(runs):
    path = runs["pp"][0]
    p = cli(path, "--format", "svg", "-q")
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""
    stems = ("ttft_cdf", "itl_cdf", "decode_rate", "timeline_prefer-prefill-sim")
    assert {f.name for f in (path / "plots").iterdir()} == {f"{s}.svg" for s in stems}
    # the CDFs' legends carry this run's p50 and p99 (summary.json's), the CDF titles its counts
    summary = json.loads((path / "summary.json").read_text())
    n = {"ttft": len(_ttft_ms(runs["pp"][1])), "itl": len(_itl_ms(runs["pp"][1]))}
    for metric, unit in (("ttft", "requests"), ("itl", "token gaps")):
        root = ET.fromstring((path / "plots" / f"{metric}_cdf.svg").read_bytes())
        texts = {"".join(t.itertext()) for t in root.iter() if t.tag.endswith("text")}
        q = summary[f"{metric}_ms"]
        assert f"prefer-prefill (sim): p50 {plots.fmt_ms(q['p50'])}, p99 {plots.fmt_ms(q['p99'])}" in texts, texts
        assert any(t.endswith(f": CDF over {n[metric]} {unit}") for t in texts), texts


def _break(tmp_path, runs, name, fn):
    import shutil

    d = tmp_path / name
    shutil.copytree(runs["pp"][0], d)
    fn(d)
    return d


@pytest.mark.parametrize(
    "case, expect",
    [
        ("missing", "no such directory"),
        ("file", "is not a run directory"),
        ("no_tokens", "missing tokens.parquet"),
        ("bad_json", "summary.json: invalid JSON"),
        ("bad_number", "column time_s has a non-numeric value"),
        ("binary", "requests.csv"),
        ("no_column", "missing column(s) end_s"),
        ("window", "--window must be START:END"),
        ("format", "--format must be png, svg"),
    ],
)
def test_cli_bad_input_is_one_line(runs, tmp_path, case, expect):
    args = []
    if case == "missing":
        args = [tmp_path / "nope"]
    elif case == "file":
        f = tmp_path / "f.json"
        f.write_text("{}")
        args = [f]
    elif case == "no_tokens":
        args = [_break(tmp_path, runs, case, lambda d: (d / "tokens.parquet").unlink())]
    elif case == "bad_json":
        args = [_break(tmp_path, runs, case, lambda d: (d / "summary.json").write_text('{"policy": '))]
    elif case == "bad_number":
        args = [
            _break(
                tmp_path,
                runs,
                case,
                lambda d: pd.DataFrame({"request_id": ["q0"], "token_index": [0], "time_s": ["soon"]}).to_parquet(
                    d / "tokens.parquet"
                ),
            )
        ]
    elif case == "binary":
        args = [
            _break(tmp_path, runs, case, lambda d: (d / "requests.csv").write_bytes(b"\xff\xfe\x00garbage\x00" * 50))
        ]
    elif case == "no_column":
        args = [
            _break(
                tmp_path,
                runs,
                case,
                lambda d: pd.DataFrame({"step": [0], "start_s": [0.0]}).to_parquet(d / "steps.parquet"),
            )
        ]
    elif case == "window":
        args = [runs["pp"][0], "--window", "3-4"]
    elif case == "format":
        args = [runs["pp"][0], "--format", "pdf"]
    args = [*args, "--out", tmp_path / "o"]
    if case in ("missing", "binary"):  # a real process: exit status, nothing but one line
        p = cli(*args)
        code, err = p.returncode, p.stderr
        assert "Traceback" not in err
    else:  # the same entry point in-process (faster); an uncaught exception fails the test
        code, err = cli_in_process(*args)
    assert code not in (0, None)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plot: error:"), err
    assert expect in lines[0]


def cli_in_process(*args):
    import contextlib
    import io

    from schedlab.commands.plot import main as plot_main

    err = io.StringIO()
    argv = sys.argv
    sys.argv = ["plot", *map(str, args)]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                plot_main()
                code = 0
            except SystemExit as exc:
                code = exc.code
    finally:
        sys.argv = argv
    return code, err.getvalue()
