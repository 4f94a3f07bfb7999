"""Engine models and BLAS: presets, local checkpoints, bad input, OpenBLAS loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from schedlab import engine  # noqa: F401  (OpenBLAS before mlx)
from schedlab.engine.errors import EngineError
from schedlab.engine.models import PRESETS, load_model, preset_parameters, save_checkpoint
from schedlab.engine.sampling import prompt_ids

import mlx.core as mx

from schedlab.traces.schema import Request


@pytest.fixture(scope="module")
def micro():
    return load_model("micro")


def test_presets_are_seeded_and_counted(micro):
    again = load_model("micro", seed=0)
    other = load_model("micro", seed=1)
    w0 = micro.model.model.layers[0].self_attn.q_proj.weight
    assert mx.array_equal(w0, again.model.model.layers[0].self_attn.q_proj.weight).item()
    assert not mx.array_equal(w0, other.model.model.layers[0].self_attn.q_proj.weight).item()
    assert micro.n_params == preset_parameters("micro")
    assert micro.fast_head and micro.n_layers == PRESETS["micro"]["num_hidden_layers"]
    assert micro.max_context >= 16384


def test_local_checkpoint_round_trip(micro, tmp_path):
    from schedlab.engine.backend import reference_tokens

    path = save_checkpoint(micro, tmp_path / "ckpt")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    loaded = load_model(str(path))
    assert loaded.kind == "checkpoint" and loaded.n_params == micro.n_params and loaded.fast_head
    for rid, n in (("r1", 40), ("r2", 200)):
        ids = prompt_ids(0, rid, n, micro.vocab_size)
        assert reference_tokens(loaded, ids, 16) == reference_tokens(micro, ids, 16)


def test_dtype_is_applied(tmp_path):
    half = load_model("micro", dtype="bfloat16")
    assert half.model.model.layers[0].mlp.up_proj.weight.dtype == mx.bfloat16
    assert half.metadata()["dtype"] == "bfloat16"


def test_bad_model_inputs_are_engine_errors(tmp_path, micro):
    cases = []
    cases.append(("no/such/dir", "model not found"))
    (tmp_path / "empty").mkdir()
    cases.append((str(tmp_path / "empty"), "no config.json"))
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cases.append((str(tmp_path / "cfg"), "no model*.safetensors"))
    bad = save_checkpoint(micro, tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-architecture", "vocab_size": 10}))
    cases.append((str(bad), "could not be loaded by mlx-lm"))
    cases.append(("enormous", "unknown model preset"))
    for spec, fragment in cases:
        with pytest.raises(EngineError, match=fragment.replace("*", r"\*")) as err:
            load_model(spec)
        assert "\n" not in str(err.value)
    with pytest.raises(EngineError, match="unknown dtype"):
        load_model("micro", dtype="float64")


def test_trace_longer_than_the_context_names_the_request(micro):
    ok = Request("fits", 0.0, micro.max_context - 10, 10)
    too = Request("too-long", 0.0, micro.max_context - 10, 11)
    micro.check_trace([ok])
    with pytest.raises(EngineError, match="request too-long needs"):
        micro.check_trace([ok, too])


# ---------------------------------------------------------------------- BLAS


def py(code: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    for k, v in env.items():
        if v is None:
            full.pop(k)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


INFO = (
    "import json; from schedlab import engine; import mlx.core as mx; from schedlab.engine import blas; "
    "mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8))); print(json.dumps(blas.info()))"
)
# macOS uses Accelerate; on Linux these tests need OpenBLAS (.ci/run installs it) and fail without it
SKIP_BLAS = sys.platform == "darwin"


@pytest.mark.skipif(SKIP_BLAS, reason="no OpenBLAS installed (macOS uses Accelerate)")
def test_openblas_is_loaded_before_mlx_and_recorded():
    proc = py(INFO, SCHEDLAB_BLAS=None, OPENBLAS_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["name"] == "openblas" and info["active"] and info["loaded_before_mlx"]
    assert info["threads"] == 1 and os.path.isfile(info["path"])
    assert info["config"] and "OpenBLAS" in info["config"]
    assert proc.stderr.strip() == ""  # nothing to tell the user


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS uses Accelerate")
def test_blas_none_keeps_the_reference_blas_and_hints_once():
    code = INFO + "; blas.notify_if_missing(); blas.notify_if_missing()"
    proc = py(code, SCHEDLAB_BLAS="none")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert not info["active"] and info["path"] is None and info["source"] == "SCHEDLAB_BLAS=none"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "apt install libopenblas0-pthread" in lines[0] and "cmeel-openblas" in lines[0]


@pytest.mark.skipif(SKIP_BLAS, reason="no OpenBLAS installed (macOS uses Accelerate)")
def test_mlx_imported_first_is_detected():
    proc = py(
        "import json, mlx.core; from schedlab import engine; from schedlab.engine import blas; "
        "print(json.dumps(blas.info()))",
        SCHEDLAB_BLAS=None,
    )
    info = json.loads(proc.stdout)
    assert not info["active"] and not info["loaded_before_mlx"]
    assert any("from schedlab import engine first" in n for n in info["notes"])


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS uses Accelerate")
def test_blas_override_path_that_does_not_exist_is_noted():
    proc = py(INFO, SCHEDLAB_BLAS="/no/such/libopenblas.so")
    info = json.loads(proc.stdout)
    assert not info["active"] and any("no such file" in n for n in info["notes"])
