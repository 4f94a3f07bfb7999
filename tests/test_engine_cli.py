"""`run-real` end to end through its console script: files, measured times, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from simkit import command, read_table

BIN = Path(sys.executable).parent


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*command("run-real"), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("run-real: note:")]
    assert len(lines) == 1, proc.stderr
    for frag in fragments:
        assert frag in lines[0], lines[0]


@pytest.mark.slow
def test_run_real_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = cli(
        "--policy",
        "prefer-prefill",
        "--trace",
        "real-smoke",
        "--model",
        "micro",
        "--out",
        str(out),
        "-o",
        "prefill_step_size=128",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "real (MLX)" in proc.stdout
    for name in ("summary.json", "requests.csv", "tokens.parquet", "steps.parquet", "passes.parquet", "meta.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "real" and summary["finished"] == summary["requests"] == 10
    steps = read_table(out / "steps.parquet")
    assert steps and all(float(s["measured_s"]) > 0 for s in steps)
    # the bundled profile was measured on tiny, not micro: run-real calibrates micro first (or
    # finds this session's cached calibration), so every step has a prediction beside it
    assert all(float(s["predicted_s"]) > 0 for s in steps)
    meta = json.loads((out / "meta.json").read_text())
    assert Path(meta["profile"]).is_file() and json.loads(Path(meta["profile"]).read_text())["model"] == "micro"
    assert (
        abs(sum(float(s["measured_s"]) for s in steps) - sum(float(s["end_s"]) - float(s["start_s"]) for s in steps))
        < 1e-6
    )
    tokens = read_table(out / "tokens.parquet")
    assert len(tokens) == summary["total_output_tokens"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["model"] == "micro" and meta["parameters"] > 0 and meta["dtype"] == "float32"
    assert {"name", "path", "threads"} <= set(meta["blas"]) and meta["mlx"] and meta["mlx_lm"]
    # prefer-prefill hands every prompt off to the decode batch: each token is a decode row
    assert meta["engine"]["decode_rows"] == summary["total_output_tokens"]
    assert meta["engine"]["joins"] == meta["engine"]["leaves"] == 10
    assert meta["policy_options"]["prefill_step_size"] == 128
    # tokens come at wall-clock times after their arrivals, in order
    reqs = {r["id"]: r for r in read_table(out / "requests.csv")}
    for r in reqs.values():
        assert float(r["first_token_s"]) > float(r["arrival_s"]) and float(r["finish_s"]) >= float(r["first_token_s"])


@pytest.mark.slow
def test_profile_predictions_and_blas_mismatch_warning(tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text(
        json.dumps(
            {
                "schema": "schedlab-profile/1",
                "kv_tokens": 100000,
                "blas": {"name": "some-other-blas", "threads": 64},
                "coefficients": {
                    "d_pass": 0.003,
                    "d_rows": 0.0002,
                    "p_pass": 0.004,
                    "p_tokens": 2e-5,
                    "s_step": 0.0005,
                },
            }
        )
    )
    out = tmp_path / "run"
    proc = cli("-p", "mlx-default", "-t", "real-smoke", "-m", "micro", "--profile", str(prof), "--out", str(out), "-q")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    warn = [ln for ln in proc.stderr.splitlines() if "warning" in ln]
    assert len(warn) == 2  # not measured on this model; measured under another BLAS
    assert any("some-other-blas" in w for w in warn) and any("not measured on this model" in w for w in warn)
    steps = read_table(out / "steps.parquet")
    assert all(float(s["predicted_s"]) >= 0.0005 for s in steps) and all(float(s["measured_s"]) > 0 for s in steps)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["kv_tokens"] == 100000 and any("some-other-blas" in w for w in meta["warnings"])


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / "empty").mkdir()
    (root / "cfg").mkdir()
    (root / "cfg" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "file.txt").write_text("x")
    long = root / "long.json"
    long.write_text(
        json.dumps(
            {
                "requests": [
                    {"id": "ok", "arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5},
                    {"id": "huge-one", "arrival_s": 0, "prompt_tokens": 32700, "output_tokens": 100},
                ]
            }
        )
    )
    return root


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["--model", "no/such/model"], ["model not found"]),
        (["--model", "{root}/empty"], ["no config.json"]),
        (["--model", "{root}/cfg"], ["no model*.safetensors"]),
        (["--model", "{root}/file.txt"], ["not a directory"]),
        (["--model", "gigantic"], ["unknown model preset 'gigantic'"]),
        (["--dtype", "float64"], ["unknown dtype 'float64'"]),
        (["--sampling", "temperature=hot"], ["sampling"]),
        (["--sampling", "temperature=0.7,seed=1.5"], ["sampling seed must be an integer, got '1.5'"]),
        (["--model-seed", "-1"], ["--model-seed must be in [0, 2**64), got -1"]),
        (["--model-seed", str(2**64)], [f"--model-seed must be in [0, 2**64), got {2**64}"]),
        (["--trace", "{root}/long.json", "--model", "micro"], ["request huge-one", "context of 32768"]),
    ],
)
def test_bad_input_is_one_line(bad_models, args, fragments):
    args = [a.replace("{root}", str(bad_models)) for a in args]
    base = ["--policy", "mlx-default", "--trace", "real-smoke"]
    proc = cli(*base, *args)
    assert_one_line_error(proc, *fragments)


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS uses Accelerate")
@pytest.mark.slow
def test_missing_fast_blas_is_told_once(tmp_path):
    import os

    tr = tmp_path / "two.json"
    tr.write_text(
        json.dumps(
            {
                "requests": [
                    {"id": "a", "arrival_s": 0, "prompt_tokens": 20, "output_tokens": 3},
                    {"id": "b", "arrival_s": 0, "prompt_tokens": 9, "output_tokens": 2},
                ]
            }
        )
    )
    out = tmp_path / "run"
    proc = subprocess.run(
        [*command("run-real"), "-p", "slots", "-t", str(tr), "-m", "micro", "-q", "--out", str(out), "--no-calibrate"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SCHEDLAB_BLAS": "none"},
    )
    assert proc.returncode == 0, proc.stderr
    hints = [ln for ln in proc.stderr.splitlines() if "libopenblas0-pthread" in ln]
    assert len(hints) == 1 and "cmeel-openblas" in hints[0]
    # --no-calibrate with no profile of this model: the bundled one plans, with a warning
    assert any("measured elsewhere" in ln for ln in proc.stderr.splitlines())
    meta = json.loads((out / "meta.json").read_text())
    assert meta["blas"]["active"] is False and meta["blas"]["path"] is None
