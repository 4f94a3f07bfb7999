"""schedlab's Python API: every function, checked against the commands' own output files, on
real traces, the real simulator and (run_real, calibrate, validate) real MLX with the micro model."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import schedlab
from simkit import command, drawn_fraction, png_rgb, KNOWN

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
TABLES = ("requests", "tokens", "steps", "passes")
# a calibration grid small enough for seconds on micro, covering real-smoke's shapes
SMALL_GRID = dict(
    name="test-small",
    decode_batches=(1, 2, 4, 8),
    decode_contexts=(40, 200),
    decode_reps=2,
    prefill_chunks=(1, 16, 64, 128),
    prefill_contexts=(0, 128),
    prefill_reps=1,
    max_attention=128 * 300,
    padded=((2, 32, 0), (3, 64, 0), (4, 16, 64)),
    mixed=((2, 64, 32, 0), (4, 100, 16, 64)),
    loop_requests=4,
    loop_policies=("mlx-default",),
    rounds=1,
)


def cli(name: str, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*command(name), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600)


def read_dir(d: Path) -> dict:
    """A run directory's files read back as a user reads them."""
    out = {
        "summary": json.loads((d / "summary.json").read_text()),
        "requests": pd.read_csv(
            d / "requests.csv", dtype={"id": str, "status": str}, keep_default_na=False, na_values=[""]
        ),
    }
    for name in ("tokens", "steps", "passes"):
        out[name] = pd.read_parquet(d / f"{name}.parquet")
    return out


def assert_run_is_dir(run: schedlab.Run, d: Path) -> None:
    files = read_dir(d)
    assert run.summary == files["summary"]
    for name in TABLES:
        pd.testing.assert_frame_equal(getattr(run, name), files[name], check_exact=True, obj=name)


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prof") / "known.json"
    p.write_text(
        json.dumps({"schema": "schedlab-profile/1", "model": "test", "kv_tokens": 262144, "coefficients": KNOWN})
    )
    return p


@pytest.fixture(scope="module")
def mooncake_head(tmp_path_factory) -> Path:
    """The first 400 requests of the bundled Mooncake conversation window, as Mooncake JSONL."""
    from schedlab.traces import DATA_DIR

    p = tmp_path_factory.mktemp("mc") / "mooncake_head.jsonl"
    p.write_text("".join((DATA_DIR / "mooncake_conv_10min.jsonl").read_text().splitlines(keepends=True)[:400]))
    return p


@pytest.fixture(scope="module")
def big_request_trace(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("tr") / "t.json"
    p.write_text(
        json.dumps(
            {
                "name": "t",
                "requests": [
                    {"id": "small1", "arrival_s": 0.0, "prompt_tokens": 100, "output_tokens": 10},
                    {"id": "huge", "arrival_s": 0.1, "prompt_tokens": 5000, "output_tokens": 10},
                    {"id": "small2", "arrival_s": 0.2, "prompt_tokens": 200, "output_tokens": 1},
                ],
            }
        )
    )
    return p


# ---------------------------------------------------------------------------- the package


def test_import_is_light_and_simulating_never_imports_mlx():
    code = (
        "import sys, schedlab\n"
        "heavy = {'mlx', 'mlx_lm', 'sim', 'engine', 'pandas', 'numpy', 'matplotlib', 'typer', 'simpy'}\n"
        "assert not heavy & {m.split('.')[0] for m in sys.modules}, sorted(heavy & set(sys.modules))\n"
        "run = schedlab.simulate('unified', 'real-smoke')\n"
        "figs = run.plot()\n"
        "assert run.requests['status'].eq('finished').all() and figs\n"
        "assert 'mlx' not in sys.modules and 'engine' not in sys.modules, 'the simulator imported the engine'\n"
        "assert not {'typer', 'click', 'fastapi', 'schedlab.commands'} & set(sys.modules), 'the API imported commands'\n"
        "print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_every_api_name_is_exported_and_no_module_shadows_one():
    import importlib
    import pkgutil

    from schedlab import api
    from schedlab.cli import COMMANDS

    for name in schedlab.__all__:
        assert getattr(schedlab, name) is not None, name
    assert set(schedlab.__all__) == set(api.__all__)
    for module, entry, _ in COMMANDS.values():  # importing every command's module ...
        assert callable(getattr(importlib.import_module(module), entry))
    # ... leaves the API's names as they were: no module of schedlab or schedlab.api is named as
    # a public function (importing a submodule sets it as its package's attribute)
    for pkg in (schedlab, api):
        clash = {m.name for m in pkgutil.iter_modules(pkg.__path__)} & set(schedlab.__all__)
        assert not clash, clash
    assert schedlab.validate is api.validate and callable(schedlab.validate)
    assert issubclass(schedlab.SchedlabError, ValueError)


# ---------------------------------------------------------------------------- simulate == simulate --out


SIM_CASES = {
    "options": ("chunked-prefill", "real-mixed", ["-o", "budget=256"], {"options": {"budget": 256}}),
    "seed-and-slo": (
        "unified",
        "MOONCAKE",
        ["--seed", "3", "--slo", "ttft_ms=2000,tpot_ms=100"],
        {"seed": 3, "slo": {"ttft_ms": 2000, "tpot_ms": 100}},
    ),
    "rejected": ("mlx-default", "BIG", ["--kv-tokens", "1000"], {"kv_tokens": 1000}),
    "analytic": (
        "static",
        "real-smoke",
        ["--hardware", "m4-max", "--model-config", "qwen3-8b", "--quant", "4"],
        {"hardware": "m4-max", "model_config": "qwen3-8b", "quant": 4},
    ),
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c == "seed-and-slo" else c for c in SIM_CASES]
)  # seed-and-slo: the head of the Mooncake window (its tick jitter is seeded), ~2 s
def test_simulate_equals_the_commands_out_files(case, profile, big_request_trace, mooncake_head, tmp_path):
    policy, trace, args, kwargs = SIM_CASES[case]
    trace = {"BIG": str(big_request_trace), "MOONCAKE": str(mooncake_head)}.get(trace, trace)
    prof = [] if case == "analytic" else ["--profile", profile]
    out = tmp_path / "cli"
    proc = cli("simulate", "-p", policy, "-t", trace, *prof, *args, "--out", out, "-q", "--passes")
    if "hardware" not in kwargs:
        kwargs = {**kwargs, "profile": profile}
    run = schedlab.simulate(policy, trace, **kwargs)
    assert_run_is_dir(run, out)
    # the problems the command reports are the Run's
    errors = [ln.split("error: ", 1)[1] for ln in proc.stderr.splitlines() if "error: " in ln]
    assert errors == run.problems
    assert proc.returncode == (1 if run.problems else 0), proc.stderr
    if case == "rejected":
        assert (
            run.rejected and run.rejected[0][0] == "huge" and "KV capacity is 992 in blocks of 16" in run.rejected[0][1]
        )  # 1000 tokens = 62 whole blocks
        assert list(run.requests["status"]) == ["finished", "rejected", "finished"]
        assert run.requests["tpot_ms"].isna().sum() == 2  # the rejected one and a one-token output
    # save() writes the same files, byte for byte (meta.json records the command line)
    saved = run.save(tmp_path / "api")
    for name in ("summary.json", "requests.csv", "tokens.parquet", "steps.parquet", "passes.parquet"):
        assert (saved / name).read_bytes() == (out / name).read_bytes(), name
    meta_cli, meta_api = (json.loads((d / "meta.json").read_text()) for d in (out, saved))
    for key in ("argv", "wall_s"):
        meta_cli.pop(key), meta_api.pop(key)
    assert meta_api == meta_cli
    # read back, the directory is the same run
    back = schedlab.load_run(out)
    assert back.summary == run.summary and back.kv_tokens == run.kv_tokens
    for name in TABLES:  # (exact: the inexact path compares categorical columns value by value, seconds a table)
        pd.testing.assert_frame_equal(getattr(back, name), getattr(run, name), check_exact=True)
    assert run.report() == back.report() and "Serving Benchmark Result" in run.report()
    # saved without passes.parquet (simulate without --passes): the rest reads back, the
    # passes say which file is missing
    lean = schedlab.load_run(run.save(tmp_path / "lean", passes=False))
    assert not (tmp_path / "lean" / "passes.parquet").exists() and lean.summary == run.summary
    pd.testing.assert_frame_equal(lean.tokens, run.tokens, check_exact=True)
    with pytest.raises(schedlab.SchedlabError, match="has no passes.parquet .simulate writes it with --passes."):
        lean.passes
    # a run read back, copied without its passes over an earlier copy, leaves no stale timeline
    back.save(tmp_path / "copy")
    assert (tmp_path / "copy" / "passes.parquet").is_file()
    back.save(tmp_path / "copy", passes=False)
    assert not (tmp_path / "copy" / "passes.parquet").exists()


def test_a_simulation_without_its_pass_log_is_the_same_run_less_the_passes(profile, tmp_path):
    full = schedlab.simulate("chunked-prefill", "real-mixed", profile=profile)
    lean = schedlab.simulate("chunked-prefill", "real-mixed", profile=profile, passes=False)
    assert lean.summary == full.summary and len(full.passes) > 0
    for name in ("requests", "tokens", "steps"):
        pd.testing.assert_frame_equal(getattr(lean, name), getattr(full, name), check_exact=True)
    with pytest.raises(schedlab.SchedlabError, match="kept no pass log"):
        lean.passes
    with pytest.raises(schedlab.SchedlabError, match="no pass log to write"):
        lean.save(tmp_path / "x", passes=True)
    lean.save(tmp_path / "lean")  # writes what it has
    assert not (tmp_path / "lean" / "passes.parquet").exists() and (tmp_path / "lean" / "tokens.parquet").is_file()


# ---------------------------------------------------------------------------- policies and traces


USER_POLICY = """
from schedlab.policies.base import Pass, Plan


class ShortestFirst:
    name = "shortest-first"

    def __init__(self, room=16):
        self.room = room

    def plan(self, view):
        room = self.room - len(view.prefilling) - len(view.decoding)
        waiting = sorted(view.waiting, key=lambda r: r.prompt_tokens)
        admit = [r for r in waiting[: max(room, 0)]
                 if r.kv_footprint <= view.kv_capacity - view.kv_reserved]
        chunks = [(r.id, r.remaining_prompt) for r in list(view.prefilling) + admit]
        passes = [Pass(prefill=chunks)] if chunks else []
        if view.decoding:
            passes.append(Pass(decode=view.decoding.ids()))
        return Plan(admit=[r.id for r in admit], passes=passes)
"""


def _same_run(a: schedlab.Run, b: schedlab.Run) -> None:
    assert a.summary == b.summary
    for name in TABLES:
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), obj=name)


def test_option_objects_give_the_run_their_fields_give(profile):
    replica = schedlab.ReplicaOptions(kv_tokens=4000, block_size=32, prefix_caching=True)
    clients = schedlab.ClientOptions(max_concurrency=3, think_time=0.5)
    a = schedlab.simulate("unified", "real-smoke", profile=profile, replica=replica, clients=clients)
    b = schedlab.simulate(
        "unified",
        "real-smoke",
        profile=profile,
        kv_tokens=4000,
        block_size=32,
        prefix_caching=True,
        max_concurrency=3,
        think_time=0.5,
    )
    assert a.summary == b.summary and a.meta == b.meta and a.kv_tokens == 4000 and a.meta["block_size"] == 32
    assert a.summary != schedlab.simulate("unified", "real-smoke", profile=profile).summary
    with pytest.raises(dataclasses.FrozenInstanceError):
        replica.block_size = 8
    with pytest.raises(schedlab.SchedlabError, match="either replica= or block_size"):
        schedlab.simulate("unified", "real-smoke", profile=profile, replica=replica, block_size=8)
    with pytest.raises(schedlab.SchedlabError, match="think_time is the pause of a closed-loop client"):
        schedlab.ClientOptions(think_time=1.0)
    with pytest.raises(schedlab.SchedlabError, match="request_rate must be a number > 0 or inf"):
        schedlab.ClientOptions(request_rate="fast")
    assert schedlab.ClientOptions(request_rate="inf").request_rate == float("inf")
    with pytest.raises(schedlab.SchedlabError, match="block_size must be >= 1"):
        schedlab.ReplicaOptions(block_size=0)
    with pytest.raises(schedlab.SchedlabError, match="model_seed must be an integer"):
        schedlab.EngineOptions(model_seed="x")


def test_a_policy_may_be_a_name_a_class_an_object_or_a_file(profile, tmp_path):
    from schedlab.policies.chunked_prefill import ChunkedPrefill

    ref = schedlab.simulate("chunked-prefill", "real-mixed", options={"budget": 128}, profile=profile)
    for pol, opts in (
        (ChunkedPrefill, {"budget": "128"}),
        (ChunkedPrefill(budget=128), None),
        (schedlab.policy("chunked-prefill", budget=128), None),
    ):
        _same_run(ref, schedlab.simulate(pol, "real-mixed", options=opts, profile=profile))
    assert ref.meta["policy_options"]["budget"] == 128
    # a user's class (no from_options): by class, as an object, and as file.py:Class
    f = tmp_path / "mine.py"
    f.write_text(USER_POLICY)
    spec = f"{f}:ShortestFirst"
    by_file = schedlab.simulate(spec, "real-mixed", options={"room": 4}, profile=profile)
    assert by_file.policy == "shortest-first" and by_file.error is None
    cls = type(schedlab.policy(spec))
    _same_run(by_file, schedlab.simulate(cls, "real-mixed", options={"room": 4}, profile=profile))
    _same_run(by_file, schedlab.simulate(cls(room=4), "real-mixed", profile=profile))
    other = schedlab.simulate(cls(room=1), "real-mixed", profile=profile)
    assert other.summary["ttft_ms"] != by_file.summary["ttft_ms"]  # the option is used
    assert set(schedlab.bundled_policies()) == {
        "mlx-default",
        "prefer-prefill",
        "static",
        "slots",
        "chunked-prefill",
        "unified",
        "vllm",
    }


def test_a_trace_may_be_a_name_a_path_a_spec_a_list_or_a_dataframe(profile):
    from schedlab import traces

    tr = schedlab.load_trace("real-mixed")
    ref = schedlab.simulate("unified", "real-mixed", profile=profile)
    frame = pd.DataFrame([r.to_json() for r in tr.requests]).sample(frac=1.0, random_state=1)  # any row order
    for given in (traces.resolve("real-mixed"), tr, tr.requests, frame):
        run = schedlab.simulate("unified", given, profile=profile)
        assert {k: v for k, v in run.summary.items() if k != "trace"} == {
            k: v for k, v in ref.summary.items() if k != "trace"
        }
        pd.testing.assert_frame_equal(run.tokens, ref.tokens)
    # a run's requests table is a trace too (its extra columns are ignored)
    again = schedlab.simulate("unified", ref.requests, profile=profile)
    assert again.summary["ttft_ms"] == ref.summary["ttft_ms"]
    # dataset specs, seeded as the commands seed them
    spec = "random:n=30,input_len=64,output_len=16,rate=5"
    a = schedlab.simulate("unified", spec, seed=1, profile=profile)
    b = schedlab.simulate("unified", traces.load(spec, seed=1).requests, profile=profile)
    assert a.summary["ttft_ms"] == b.summary["ttft_ms"]
    assert schedlab.simulate("unified", spec, seed=2, profile=profile).summary["ttft_ms"] != a.summary["ttft_ms"]
    # head and rate
    short = schedlab.load_trace("mixed", head=50, rate=2.0)
    assert len(short) == 50 and traces.mean_rate(short) == pytest.approx(2.0)
    st = schedlab.trace_stats(frame)
    assert st["requests"] == len(tr) and st["prompt_max"] == max(r.prompt_tokens for r in tr.requests)


def test_cost_models_profiles_and_an_own_cost_model(profile):
    cm = schedlab.cost_model(profile=profile)
    assert cm.kv_tokens == 262144 and cm.source == {"profile": str(profile)}
    a = schedlab.simulate("slots", "real-smoke", profile=profile)
    b = schedlab.simulate("slots", "real-smoke", cost=cm)
    assert a.summary == b.summary

    class Slower:  # any object with the cost-model methods
        def pass_seconds(self, shape):
            return 2 * cm.pass_seconds(shape)

        def step_overhead_seconds(self, n_passes, n_rows):
            return 2 * cm.step_overhead_seconds(n_passes, n_rows)

    burst = pd.DataFrame([dict(r.to_json(), arrival_s=0.0) for r in schedlab.load_trace("real-smoke").requests])
    a = schedlab.simulate("slots", burst, cost=cm)
    c = schedlab.simulate("slots", burst, cost=Slower(), kv_tokens=cm.kv_tokens)
    assert len(c.steps) == len(a.steps)  # the same schedule, every step twice as long
    assert c.summary["makespan_s"] == pytest.approx(2 * a.summary["makespan_s"], rel=1e-9)
    an = schedlab.cost_model(hardware="h100-sxm", model_config="llama-3.1-8b")
    assert an.kv_tokens > 100_000 and an.meta["kv_tokens"] == an.kv_tokens and an.hardware.name == "h100-sxm"
    prof = schedlab.load_profile()  # the bundled one
    assert prof.path.name == "tiny-cpu.json" and prof.model == "tiny" and len(prof.samples) > 100
    assert set(prof.fit.index) >= {"decode", "prefill", "held_out_passes"}
    assert prof.cost_model().kv_tokens == prof.kv_tokens


# ---------------------------------------------------------------------------- bad arguments


def _bad_cases(tmp):
    one = tmp / "one.json"
    one.write_text(json.dumps({"requests": [{"id": "x", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5}]}))
    S = schedlab
    return [
        (lambda: S.simulate("nope", "mixed"), "unknown policy 'nope'"),
        (lambda: S.simulate("static", "mixed", options={"batch_size": "big"}), "batch_size='big' is not a valid int"),
        (lambda: S.simulate("static", "mixed", options={"batch_size": 2.5}), "is not a valid int"),
        (lambda: S.simulate("static", "mixed", options={"frobnicate": 1}), "has no option 'frobnicate'"),
        (lambda: S.simulate(object(), "mixed"), "a policy is a bundled name"),
        (lambda: S.simulate("static", "no-such-trace"), "trace not found"),
        (
            lambda: S.simulate("static", pd.DataFrame({"id": ["a"], "arrival_s": [0.0]})),
            "missing column(s) output_tokens",
        ),
        (lambda: S.simulate("static", [1, 2]), "traces.Request"),
        (lambda: S.simulate("static", "mixed", profile=tmp / "none.json"), "profile not found"),
        (lambda: S.simulate("static", "mixed", kv_tokens=0), "kv_tokens must be >= 1"),
        (lambda: S.simulate("static", "mixed", slo={"ttft_s": 1}), "unknown SLO key 'ttft_s'"),
        (lambda: S.simulate("static", "mixed", slo="ttft_ms=nan"), "finite number > 0"),
        (lambda: S.simulate("static", "mixed", hardware="m4-max"), "hardware and model_config go together"),
        (lambda: S.simulate("static", "mixed", quant=4), "quant goes with hardware and model_config"),
        (lambda: S.simulate("static", "mixed", hardware="m4", model_config="qwen3-235b-a22b"), "GB of weights"),
        (lambda: S.load_trace("mixed", rate=-1), "must be a finite number > 0"),
        (lambda: S.run_real("static", "real-smoke", model="gigantic"), "unknown model preset 'gigantic'"),
        (lambda: S.run_real("static", "real-smoke", dtype="float64"), "unknown dtype 'float64'"),
        (lambda: S.run_real("static", "real-smoke", model="micro", sampling="temperature=hot"), "sampling"),
        (lambda: S.calibrate(model="micro", grid={"nope": 1}), "unknown field(s) nope"),
        (lambda: S.calibrate(model="micro", from_profile=one), "from_profile goes with analytic or add_verify"),
        (lambda: S.calibrate(model="micro", add_verify=True), "add_verify goes with from_profile"),
        (lambda: S.validate("static", "real-smoke", model="micro", repeat=0), "repeat must be >= 1"),
        (
            lambda: S.validate("static", "real-smoke", model="micro", profile=one, hardware="m4-max"),
            "either profile or hardware",
        ),
        (lambda: S.validate("static", "real-smoke", model="micro", hardware="warp-drive"), "unknown hardware"),
        (
            lambda: S.validate("static", "real-smoke", model="micro", speed_probe="wall"),
            "speed_probe must be 'passes' or 'replay', not 'wall'",
        ),
        (lambda: S.sweep("chunked-prefill", "mixed", rates=[0, 1]), "every rate must be a finite number > 0"),
        (lambda: S.sweep("chunked-prefill", "mixed", rates=[1], attainment=1.5), "attainment must be in (0, 1]"),
        (lambda: S.sweep("chunked-prefill", one, rates=[1]), "cannot set a rate"),
        (lambda: S.plot(), "at least one run"),
        (lambda: S.plot(tmp / "nowhere"), "no such directory"),
        (lambda: S.load_run(one), "is not a run directory"),
        (lambda: S.plot(S.simulate("static", "real-smoke"), lanes=0), "lanes must be >= 1"),
        (lambda: S.plot(S.simulate("static", "real-smoke"), formats="pdf"), "formats must be png, svg"),
        # an empty output path is the current directory, which nobody named: refused, as --out "" is
        (lambda: S.sweep("chunked-prefill", "mixed", rates=[1], out=""), "out must not be empty"),
        (lambda: S.capacity("vllm", "mixed", slo="ttft_ms=2000", out=""), "out must not be empty"),
        (lambda: S.plot(S.simulate("static", "real-smoke"), out=""), "out must not be empty"),
        (lambda: S.validate("static", "real-smoke", model="micro", out=""), "out must not be empty"),
        (lambda: S.calibrate(model="micro", out=""), "out must not be empty"),
        (lambda: S.run_real("static", "real-smoke", model="micro", out=""), "out must not be empty"),
        (lambda: S.validate_served(tmp / "nowhere", out=""), "out must not be empty"),
        (lambda: S.sweep("chunked-prefill", "mixed", rates=[1], out=5), "out must be a str or pathlib.Path, got int"),
        (lambda: S.load_run(None), "path must be a str or pathlib.Path, got NoneType None"),
        (lambda: S.load_run(""), "path must not be empty"),
        # arguments of the wrong type: one line before any work, not a TypeError from below
        (lambda: S.simulate("vllm", "mixed", options=[1, 2]), "policy options are a mapping of names to values"),
        (lambda: S.sweep("vllm", "mixed", rates=[1], options=[1]), "policy options are a mapping of names to values"),
        (lambda: S.simulate("vllm", "mixed", passes="no"), "passes must be True or False, got 'no'"),
        (lambda: S.simulate("vllm", "mixed", prefix_caching="no"), "prefix_caching must be True or False"),
        (lambda: S.capacity("vllm", "mixed", slo="ttft_ms=2000", early_stop=0), "early_stop must be True or False"),
        (lambda: S.sweep("vllm", "mixed", rates=[1], on_done=5), "on_done must be a function (or None), got int 5"),
        (lambda: S.run_real("vllm", "real-smoke", model="micro", on_step=5), "on_step must be a function"),
        (lambda: S.sweep("vllm", "mixed", rates=[1], workers="2"), "workers must be an integer, got '2'"),
        (lambda: S.validate("static", "real-smoke", model="micro", repeat="2"), "repeat must be an integer, got '2'"),
        (
            lambda: S.simulate("vllm", "mixed", hardware="m4-max", model_config="qwen3-4b", quant="4"),
            "quant must be one of 2, 3, 4, 5, 6, 8, 16, 32 bits, got '4'",
        ),
        (lambda: S.plot(S.simulate("static", "real-smoke"), window="a:b"), "window must be START:END"),
        (
            lambda: S.run_real("vllm", "real-smoke", model=str(tmp / "nope_dir") + "/"),
            "not a preset: micro, tiny, small, micro-qwen3_5, ",
        ),
        (lambda: S.run_real("vllm", "real-smoke", model=str(tmp / "nope_dir") + "/"), "smollm2-135m, gemma3-270m)"),
    ]


def test_bad_arguments_raise_one_error_type_with_one_line(tmp_path):
    for call, fragment in _bad_cases(tmp_path):
        with pytest.raises(schedlab.SchedlabError) as ei:
            call()
        exc = ei.value
        msg = str(exc)
        assert isinstance(exc, ValueError) and "\n" not in msg and fragment in msg, msg
        assert not msg.startswith("--"), msg  # options named as in Python, not as on the command line
        # no traceback noise: nothing chained, no frame below the API's entry point
        assert exc.__cause__ is None and exc.__suppress_context__
        frames = traceback.extract_tb(exc.__traceback__)
        boundary = [f for f in frames if Path(f.filename).parent.name == "api"]  # the public function's wrapper
        assert len(boundary) == 1 and Path(boundary[0].filename).name == "_base.py", frames
        assert all(Path(f.filename).name in ("test_api.py", "python_api.py") for f in frames if f not in boundary), (
            frames
        )
    # the same checks on the command line name the options as options
    proc = cli("simulate", "-p", "static", "-t", "mixed", "--kv-tokens", "0")
    assert proc.returncode == 2 and proc.stderr.strip() == "simulate: error: --kv-tokens must be >= 1, got 0"


def test_saving_refuses_an_empty_or_non_path_out(tmp_path, monkeypatch):
    # Path("") is the current directory: a run, a run read back and a profile all refuse it,
    # and None or a number, as one line (they were a pathlib TypeError, or files written here)
    monkeypatch.chdir(tmp_path)
    run = schedlab.simulate("static", "real-smoke")
    back = schedlab.load_run(run.save(tmp_path / "r"))
    prof = schedlab.load_profile()
    for save in (run.save, back.save, prof.save):
        what = "path" if save == prof.save else "out"
        for out, message in (
            ("", f"{what} must not be empty"),
            (None, f"{what} must be a str or pathlib.Path, got NoneType None"),
            (5, f"{what} must be a str or pathlib.Path, got int 5"),
        ):
            with pytest.raises(schedlab.SchedlabError) as ei:
                save(out)
            assert str(ei.value) == message
    with pytest.raises(schedlab.SchedlabError, match="^passes must be True or False, got 'no'$"):
        run.save(tmp_path / "p", passes="no")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_the_model_help_is_the_same_for_every_command_that_loads_one():
    from schedlab.engine.gguf import GGUF_PRESETS

    helps = {}
    for name in ("run-real", "validate", "calibrate"):
        text = " ".join(cli(name, "--help").stdout.split())
        helps[name] = text[text.index("-m, --model") : text.index("[default: tiny]")]
    assert len(set(helps.values())) == 1, helps
    assert all(p in helps["validate"] for p in ("micro, tiny, small", *GGUF_PRESETS, ".gguf file")), helps


def test_a_run_that_stops_early_is_returned_with_its_error(profile, tmp_path):
    f = tmp_path / "bad.py"
    f.write_text(
        "from schedlab.policies.base import Plan, Pass\n"
        "class DecodeWaiting:\n"
        "    name = 'decode-waiting'\n"
        "    def plan(self, view):\n"
        "        return Plan(passes=[Pass(decode=[view.waiting[0].id])])\n"
    )
    run = schedlab.simulate(f"{f}:DecodeWaiting", "real-smoke", profile=profile)
    assert run.error and "policy 'decode-waiting' step 0" in run.error and run.problems == [run.error]
    assert run.summary["error"] == run.error and (run.requests["status"] == "unfinished").all()


def test_a_policy_file_imports_its_neighbours_and_its_faults_are_one_line(profile, tmp_path):
    # a policy file that imports a module beside it (as a script may), and a module:Class policy
    # in the folder the command runs from
    (tmp_path / "helper.py").write_text(USER_POLICY)
    (tmp_path / "pol.py").write_text("from helper import ShortestFirst as Mine\n")
    run = schedlab.simulate(f"{tmp_path / 'pol.py'}:Mine", "real-mixed", options={"room": 4}, profile=profile)
    assert run.error is None and run.policy == "shortest-first"
    proc = cli("simulate", "-p", "helper:ShortestFirst", "-t", "real-mixed", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # a constructor that raises, and a plan holding something that is not a Pass: one line each
    (tmp_path / "bad.py").write_text(
        "from schedlab.policies.base import Plan\n"
        "class Boom:\n"
        "    def __init__(self):\n"
        "        raise ValueError('ctor boom')\n"
        "    def plan(self, view):\n"
        "        return Plan()\n"
        "class Garbage:\n"
        "    name = 'garbage'\n"
        "    def plan(self, view):\n"
        "        return Plan(admit=[r.id for r in view.waiting][:1], passes=['hello'])\n"
    )
    with pytest.raises(schedlab.SchedlabError, match=r"bad.py:Boom': its constructor raised ValueError: ctor boom"):
        schedlab.simulate(f"{tmp_path / 'bad.py'}:Boom", "real-smoke", profile=profile)
    run = schedlab.simulate(f"{tmp_path / 'bad.py'}:Garbage", "real-smoke", profile=profile)
    assert run.error == "policy 'garbage' step 0: plan holds str, not a Pass"
    for cls in ("Boom", "Garbage"):
        proc = cli("simulate", "-p", f"{tmp_path / 'bad.py'}:{cls}", "-t", "real-smoke")
        assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------- sweep and plot


@pytest.mark.slow
def test_sweep_equals_the_commands_files(profile, tmp_path):
    from schedlab import traces
    from schedlab.analysis.sweep import ROW_FIELDS

    tr = schedlab.load_trace("mixed", head=80)
    path = tmp_path / "t.json"
    traces.save_json(tr, path)
    slo = "ttft_ms=2000,tpot_ms=100"
    out = tmp_path / "cli"
    proc = cli(
        "sweep",
        "-p",
        "chunked-prefill,unified",
        "-t",
        path,
        "--rates",
        "0.5,4",
        "--profile",
        profile,
        "--slo",
        slo,
        "--workers",
        "1",
        "--out",
        out,
        "-q",
    )
    assert proc.returncode == 0, proc.stderr
    table = schedlab.sweep("chunked-prefill,unified", path, rates=[4, 0.5], profile=profile, slo=slo, workers=1)
    assert list(table.columns) == list(ROW_FIELDS) and len(table) == 4
    csv = pd.read_csv(out / "sweep.csv", keep_default_na=False, na_values=[""])
    for col in ROW_FIELDS:
        if col == "error" or table[col].isna().all():  # no error; no client limit in a rate sweep
            assert table[col].isna().all() and csv[col].isna().all(), col
        else:
            assert list(table[col]) == list(csv[col]), col
    data = json.loads((out / "sweep.json").read_text())
    info = table.attrs["info"]
    assert info["max_sustained_rate"] == data["max_sustained_rate"] and info["rates_rps"] == [0.5, 4.0]
    # a policy class runs in this process and gives the same rows
    from schedlab.policies.unified import Unified

    mine = schedlab.sweep([Unified], path, rates=[0.5, 4], profile=profile, slo=slo)
    pd.testing.assert_frame_equal(
        mine.drop(columns="policy").reset_index(drop=True),
        table[table["policy"] == "unified"].drop(columns="policy").reset_index(drop=True),
    )
    fig = schedlab.plot_sweep(table, out=tmp_path / "fig", formats="png")
    assert len(fig.axes) == 4
    img = png_rgb(tmp_path / "fig" / "latency_vs_load.png")  # the figure, 12.5 x 8.6 in at 110 dpi, drawn on
    assert img.shape[:2] == tuple(reversed(fig.canvas.get_width_height())) == (946, 1375)
    assert drawn_fraction(img) > 0.035
    # each panel draws every policy's rows at both rates, in the policy's colour: latencies
    # (p50 solid, p99 dashed), output throughput, SLO attainment (%)
    panels = [
        {"-": "ttft_p50_ms", "--": "ttft_p99_ms"},
        {"-": "itl_p50_ms", "--": "itl_p99_ms"},
        {"-": "output_throughput_tok_s"},
        {"-": "slo_attainment"},
    ]
    for i, pol in enumerate(dict.fromkeys(table["policy"])):
        mine = table[table["policy"] == pol].sort_values("rate_rps")
        for ax, keys in zip(fig.axes, panels):
            drawn = {
                line.get_linestyle(): line
                for line in ax.get_lines()
                if line.get_color() == f"C{i}" and line.get_marker() in ("o", "s")  # (not the sustained-rate line)
            }
            assert set(drawn) == set(keys), (pol, keys)
            for style, key in keys.items():
                scale = 100.0 if key == "slo_attainment" else 1.0
                np.testing.assert_allclose(drawn[style].get_xdata(), [0.5, 4.0])
                np.testing.assert_allclose(drawn[style].get_ydata(), mine[key].to_numpy(float) * scale, rtol=1e-12)


@pytest.mark.slow
def test_plot_gives_the_plot_commands_figures(profile, tmp_path):
    run = schedlab.simulate("prefer-prefill", "real-mixed", profile=profile)
    d = run.save(tmp_path / "run")
    proc = cli("plot", d, "--out", tmp_path / "cli", "--format", "png", "--lanes", "12")
    assert proc.returncode == 0, proc.stderr
    figs = run.plot(out=tmp_path / "api", formats="png", lanes=12)
    stems = sorted(p.stem for p in (tmp_path / "cli").iterdir())
    assert sorted(figs) == stems == sorted(p.stem for p in figs.files)
    assert all(type(f).__name__ == "Figure" for f in figs.values())
    for stem, fig in figs.items():  # the command's files are these figures: their size, drawn on
        img = png_rgb(tmp_path / "cli" / f"{stem}.png")
        assert img.shape[:2] == tuple(reversed(fig.canvas.get_width_height())), stem
        assert drawn_fraction(img) > 0.035, stem
    # the TTFT CDF steps through every finished request's TTFT, from 0 to 1
    (curve,) = [line for line in figs["ttft_cdf"].axes[0].get_lines() if ": p50 " in line.get_label()]
    req = run.requests
    ttft = np.sort(req.loc[req["status"] == "finished", "ttft_ms"].to_numpy(float))
    np.testing.assert_allclose(curve.get_xdata(), np.r_[ttft[0], ttft], rtol=1e-12)
    np.testing.assert_allclose(curve.get_ydata(), np.r_[0.0, np.arange(1, ttft.size + 1) / ttft.size])
    assert list(run.plot(kinds=["timeline"])) == ["timeline_prefer-prefill-sim"]
    # runs side by side: one curve per run in the CDFs
    other = schedlab.simulate("unified", "real-mixed", profile=profile)
    both = schedlab.plot(run, other, kinds="ttft")
    assert len(both["ttft_cdf"].axes[0].get_legend().get_texts()) == 2


# ---------------------------------------------------------------------------- the real engine (micro)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro") / "micro.json"
    lines = []
    prof = schedlab.calibrate(model="micro", grid=SMALL_GRID, out=out, log=lambda k, m: lines.append((k, m)))
    return prof, lines


@pytest.mark.slow
def test_calibrate_returns_the_profile_it_writes(micro, tmp_path):
    from schedlab.sim.cost import FEATURES

    prof, lines = micro
    assert prof.path is not None and prof.path.is_file() and prof.path.with_suffix(".md").is_file()
    assert json.loads(prof.path.read_text()) == prof.data
    assert prof.model == "micro" and set(prof.coefficients) == set(FEATURES)
    assert prof.data["calibration"]["grid"] == "test-small"
    assert len(prof.samples) == prof.data["calibration"]["samples"] and "seconds" in prof.samples
    assert {"decode", "prefill", "step", "held_out_passes"} <= set(prof.fit.index)
    assert "held-out passes" in prof.report()
    assert lines and all(kind == "progress" for kind, _ in lines)
    assert prof.mismatch("micro") is None and "model" in prof.mismatch("tiny")
    assert schedlab.load_profile(prof.path).coefficients == prof.coefficients
    # the analytic roofline's factors fitted to the stored samples, nothing timed
    fitted = schedlab.calibrate(model="micro", analytic=True, from_profile=prof.path, out=tmp_path / "a.json")
    assert fitted.analytic is not None and fitted.coefficients == prof.coefficients
    assert "analytic roofline on cpu-local" in fitted.report()
    assert "## Analytic roofline on cpu-local" in (tmp_path / "a.md").read_text()
    # a profile kept in memory works wherever a profile goes
    mem = schedlab.calibrate(model="micro", analytic=True, from_profile=prof.path)
    assert mem.path is None
    a = schedlab.simulate("static", "real-smoke", profile=mem)
    assert a.summary == schedlab.simulate("static", "real-smoke", profile=prof.path).summary


@pytest.mark.slow
def test_run_real_gives_a_run_like_run_reals(micro, tmp_path):
    prof, _ = micro
    trace = schedlab.load_trace("real-smoke", head=6)
    seen, logged = [], []
    run = schedlab.run_real(
        "prefer-prefill",
        trace,
        model="micro",
        profile=prof,
        options={"prefill_step_size": 64},
        on_step=lambda done, total: seen.append((done, total)),
        log=lambda k, m: logged.append((k, m)),
    )
    assert run.mode == "real" and run.error is None and run.summary["finished"] == 6
    assert seen and seen[-1] == (6, 6) and not [m for k, m in logged if k == "warning"]
    st = run.steps
    assert (st["measured_s"] > 0).all() and (st["predicted_s"] > 0).all()
    assert len(run.tokens) == run.summary["total_output_tokens"]
    assert run.meta["profile"] == str(prof.path) and run.meta["policy_options"]["prefill_step_size"] == 64
    assert run.meta["model"] == "micro" and run.meta["engine"]["decode_rows"] > 0
    assert list(run.texts["id"]) == [r.id for r in trace.requests]
    d = run.save(tmp_path / "api")
    assert_run_is_dir(run, d)
    assert (d / "texts.jsonl").is_file()
    pd.testing.assert_frame_equal(run.features, pd.read_parquet(d / "features.parquet"))
    assert len(run.features) == len(st) and run.meta["step_bias"] and "noise" in run.meta
    assert len(run.residuals()) > 0 and "n" in run.residuals().columns
    # the cost model fitted to the run's own steps (no engine needed)
    refit = schedlab.calibrate(from_runs=[d], grid=prof.path, out=tmp_path / "refit.json")
    assert refit.path.is_file() and set(refit.coefficients) >= set(prof.coefficients)
    with pytest.raises(schedlab.SchedlabError, match="from_runs needs one or more run directories"):
        schedlab.calibrate(from_runs=[])
    # the command writes the same files, the same columns and types
    out = tmp_path / "cli"
    proc = cli(
        "run-real",
        "-p",
        "prefer-prefill",
        "-t",
        "real-smoke",
        "-m",
        "micro",
        "--profile",
        prof.path,
        "-o",
        "prefill_step_size=64",
        "--out",
        out,
        "-q",
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in d.iterdir())
    back = schedlab.load_run(out)
    for name in TABLES:
        assert dict(getattr(back, name).dtypes.astype(str)) == dict(getattr(run, name).dtypes.astype(str)), name
    assert set(back.summary) == set(run.summary) and back.mode == "real"


def test_a_loaded_engine_runs_a_trace_and_a_live_source(micro):
    from schedlab.sim import LiveSource, WallClock

    prof, _ = micro
    eng = schedlab.load_engine(
        schedlab.EngineOptions(model="micro"), replica=schedlab.ReplicaOptions(block_size=8), profile=prof
    )
    assert eng.kv_tokens == prof.kv_tokens and eng.cost_model.source == {"profile": str(prof.path)}
    trace = schedlab.load_trace("real-smoke", head=4)
    a = eng.run("static", trace)
    assert a.mode == "real" and a.summary["finished"] == 4 and a.meta["block_size"] == 8 and a.trace == trace.name
    # the same requests handed in while the replica runs (as serve's HTTP handlers do), on its clock
    clock = WallClock()

    def ready() -> None:
        for r in trace.requests:
            source.submit(r)
        source.close()

    source = LiveSource(clock, on_ready=ready)
    b = eng.run("static", source, clock=clock)
    assert (
        b.summary["finished"] == 4
        and b.trace == "live"
        and [r.id for r in source.received] == [r.id for r in trace.requests]
    )
    assert sorted(b.requests["output_tokens"]) == sorted(a.requests["output_tokens"])
    with pytest.raises(schedlab.SchedlabError, match="clients go with a trace"):
        eng.run("static", LiveSource(clock), clients=schedlab.ClientOptions(max_concurrency=2))


@pytest.mark.slow
def test_validate_and_compare(micro, tmp_path):
    from schedlab.analysis.validation import METRICS

    prof, _ = micro
    trace = schedlab.load_trace("real-smoke", head=6)
    out = tmp_path / "val"
    results, said = [], []
    v = schedlab.validate(
        ["unified", "static"],
        trace,
        model="micro",
        profile=prof,
        out=out,
        repeat=2,
        on_result=lambda name, r: results.append((name, r)),
        log=lambda kind, msg: said.append(msg),
    )
    assert v.policies == ["unified", "static"] and [n for n, _ in results] == v.policies
    # the real runs go round by round (the machine drifts: every policy meets it alike), the
    # machine's speed timed once before the first round and once after the last
    assert [m for m in said if "real run" in m] == [
        "unified: real run 1/2",
        "static: real run 1/2",
        "unified: real run 2/2",
        "static: real run 2/2",
    ]
    assert v["unified"]["machine_speed"] == v["static"]["machine_speed"]
    assert sum("reference passes" in m for m in said) == 1 and len(v.real["static"]) == 2
    assert all(r is v[n] or r == v[n] for n, r in results) and results[0][1]["residuals"]
    assert set(v.table.index.get_level_values("metric")) == {k for k, _, _ in METRICS}
    assert list(v.errors.index) == v.policies and (v.errors["steps"] > 0).all()
    assert (v.errors["speed_before"] > 0).all()
    applied = [v[p]["drift_adjusted"]["applied"] for p in v.policies]  # (where the speed explains the bias)
    assert list(v.errors["drift_adjusted_median_abs_error_pct"].notna()) == applied
    # each real run's own speed, read back from its steps, and the simulation made again at it
    from schedlab.analysis.residuals import run_speed
    from schedlab.sim.features import step_table

    for pol in v.policies:
        speeds = [run_speed(step_table(r._result)) for r in v.real[pol]]
        assert v[pol]["speed_matched"]["speeds"] == pytest.approx(speeds, abs=1e-4) and min(speeds) > 0
    assert v.errors["speed_matched_median_abs_error_pct"].notna().all()
    assert "speed-matched" in v.report()
    # each real run held out against the other: the simulation beside a real run's own error
    for pol in v.policies:
        assert v.errors.loc[pol, "held_out_real_median_abs_pct"] == v[pol]["hold_one_out"]["real_median_pct"] >= 0
    assert "held out: sim / a real run %" in v.report()
    for pol in v.policies:  # what validate --out wrote is what the Validation holds
        assert json.loads((out / pol / "validation.json").read_text()) == json.loads(json.dumps(v[pol]))
        assert_run_is_dir(v.sim[pol], out / pol / "sim")
        assert_run_is_dir(v.real[pol][0], out / pol / "real")
        row = v.table.loc[(pol, "makespan_s")]
        assert row["sim"] == v.sim[pol].summary["makespan_s"]
        assert row["real"] == pytest.approx(sum(r.summary["makespan_s"] for r in v.real[pol]) / 2)  # their median
    overview = json.loads((out / "validation.json").read_text())
    assert set(overview["policies"]) == set(v.policies)
    # its figures are the plot command's for the directory
    assert sorted(v.plot()) == sorted(schedlab.plot(out / "unified", out / "static"))
    assert {"validate_unified_cdfs", "validate_unified_step_time"} <= set(v.plot(kinds="validation"))
    again = v.save(tmp_path / "again")
    assert sorted(p.name for p in again.rglob("*") if p.name != "meta.json") == sorted(
        p.name for p in out.rglob("*") if p.name != "meta.json"
    )
    # compare: the same comparison from runs made separately
    c = schedlab.compare(v.sim["static"], v.real["static"])
    pd.testing.assert_frame_equal(c.table, v.table.loc[["static"]])
    assert c["static"]["step_error_pct"] == v["static"]["step_error_pct"]
    assert "static on real-smoke" in c.report()
    with pytest.raises(schedlab.SchedlabError, match="must be real runs"):
        schedlab.compare(v.sim["static"], v.sim["static"])
    # another policy's real runs, or another trace's, are not this simulation's to compare with
    with pytest.raises(schedlab.SchedlabError, match="is static on real-smoke, real run 1 is unified on real-smoke"):
        schedlab.compare(v.sim["static"], v.real["unified"])
    other = schedlab.simulate("static", "real-mixed", profile=v.sim["static"].meta.get("profile"))
    with pytest.raises(schedlab.SchedlabError, match="is static on real-mixed, real run 1 is static on real-smoke"):
        schedlab.compare(other, v.real["static"])


# ---------------------------------------------------------------------------- the notebooks


def _imports(nb_path: Path) -> set[str]:
    nb = json.loads(nb_path.read_text())
    names = set()
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "\n".join(line for line in "".join(cell["source"]).splitlines() if not line.startswith("%"))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names.add(node.module)
    return names


@pytest.mark.parametrize("name", ["prefer_prefill_victims", "sim_vs_real", "one_model_three_machines"])
def test_notebooks_use_only_the_api(name):
    names = _imports(ROOT / "notebooks" / f"{name}.ipynb")
    internal = {n for n in names if n.split(".")[0] in ("sim", "engine", "policies", "analysis", "traces")}
    assert internal <= {"policies.base"}, internal
    assert "schedlab" in names


def test_a_script_may_sweep_at_its_top_level(profile, tmp_path):
    # spawned workers do not re-run the script (they would start sweeps of their own and hang)
    script = tmp_path / "quick.py"
    script.write_text(
        "import schedlab\n"
        "print('top level')\n"
        f"t = schedlab.sweep('unified,static', 'real-mixed', rates=[0.5, 1], profile={str(profile)!r}, "
        "workers=2)\n"
        "print(len(t), t['error'].isna().all())\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["top", "level", "4", "True"]
